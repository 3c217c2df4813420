"""Hook: ``sglang.srt.speculative.eagle_utils.eagle_sample`` (AROUND).

Why: this is the first point after the target-verify launch where the grammar mask is needed, i.e. the window in
which host grammar work overlaps the GPU forward.

How: for a plugin-owned step (in flight from ``run_eagle_verify``'s hook, for this batch): restore
``batch.has_grammar``, then :func:`~.band.build_vocab_mask` (barrier advance through the ledger, tree copy wait,
native mask, non-blocking upload, unmasked drafts neutralised, failed requests aborted alone) and call the original
with that mask; after it returns, the grammar-forced drafts pick the accepted node's row on the device
(:func:`~.band.after_sample`). Everything else (ngram worker, unconstrained
batches, plugin inactive) passes straight through.

Upstream state: 0.5.17 runs ``build_grammar_vocab_mask(..., barrier=Scheduler._advance_pending_grammar)`` here.

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.adapters.v0_5_16.run_eagle_verify import in_flight_for
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

if TYPE_CHECKING:
    import torch

TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"


# ``verify_input`` (EagleVerifyInput), ``batch``, ``logits_output`` and the return value are SGLang's objects: Any
# (SGLang ships no types).
def eagle_sample(original: Callable[..., Any], verify_input: Any, batch: Any, logits_output: Any,
                 vocab_mask: Optional[torch.Tensor] = None, *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    cur = in_flight_for(rt, batch)
    if rt is None or cur is None or vocab_mask is not None:
        return original(verify_input, batch, logits_output, vocab_mask, *args, **kwargs)
    cur.restore()
    vocab_mask = band.build_vocab_mask(rt, cur.verify, verify_input, batch)
    result = original(verify_input, batch, logits_output, vocab_mask, *args, **kwargs)
    band.after_sample(rt, batch, result)  # grammar-forced drafts: the accepted node's row, on the device
    return result


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=eagle_sample,
    callers=(
        ("sglang.srt.speculative.eagle_worker_common", "eagle_sample"),
        ("sglang.srt.speculative.ngram_worker", "eagle_sample"),
    ),
    why="advance pending grammars, build and upload the tree mask after the verify launch",
)
