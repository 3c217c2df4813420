"""Hook: ``sglang.srt.speculative.eagle_utils.eagle_sample`` (AROUND), as called by ``eagle_worker_common``.

Why: grammar-forced drafts need the node each request accepted in this verify, and that is known only on
the device: ``eagle_sample`` returns it (``accept_index``) before ``run_eagle_verify`` compacts it for topk > 1.

How: call the original untouched; for a batch with a grammar, hand its ``accept_index`` to
:func:`~.band.after_sample` (a device gather of this step's forced-continuation
table, no host sync) and return the original's result unchanged.

Upstream state: 0.5.23 has no grammar-forced drafts.

When to remove: if upstream drafts grammar-forced tokens itself.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_23 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"


# The arguments and the return value are SGLang's objects: Any (SGLang ships no types).
def eagle_sample(original: Callable[..., Any], verify_input: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    result = original(verify_input, batch, *args, **kwargs)
    rt = runtime.active()
    if rt is not None:
        band.after_sample(rt, batch, result)
    return result


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=eagle_sample,
    callers=(("sglang.srt.speculative.eagle_worker_common", "eagle_sample"),),
    why="grammar-forced drafts: the accepted node's forced tokens, picked on the device after the verify",
)
