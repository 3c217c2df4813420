"""Hook: ``sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify`` (AROUND).

Why: ``run_eagle_verify`` tests ``batch.has_grammar`` right after this call to do a blocking ``.cpu()`` of the verify
tree. ``has_grammar`` must still be True *inside* this call, because ``ForwardBatch.init_new`` uses it to fill
``sampling_info.grammars``.

How: run the original untouched; afterwards, if the plugin owns this step (``run_eagle_verify``'s hook put it in
flight for this very batch), hide ``batch.has_grammar``. It is restored in the ``eagle_sample`` hook and, in any
case, in ``run_eagle_verify``'s ``finally``. The only other reader of ``has_grammar`` between the two points is
SGLang's own mask block, which is exactly what is skipped.

Upstream state: not needed on 0.5.17+ (upstream's own async path).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify"


# The arguments and the return value are SGLang's objects: Any (SGLang ships no types).
def eagle_prepare_for_verify(original: Callable[..., Any], verify_input: Any, req_to_token_pool: Any, batch: Any,
                             *args: Any, **kwargs: Any) -> Any:
    result = original(verify_input, req_to_token_pool, batch, *args, **kwargs)
    rt = runtime.active()
    cur = None if rt is None else band.band_of(rt).in_flight_for(batch)
    if cur is not None:
        cur.hide()
    return result


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=eagle_prepare_for_verify,
    callers=(("sglang.srt.speculative.eagle_worker_common", "eagle_prepare_for_verify"),),
    why="skip upstream's blocking verify-tree .cpu() for plugin-owned steps",
)
