"""Hook: ``sglang.srt.speculative.eagle_utils.eagle_sample`` (AROUND).

Why: this is the first point after the target-verify launch where the grammar mask is needed, i.e. the window in
which host grammar work overlaps the GPU forward.

How: for a plugin-owned step (in flight from ``run_eagle_verify``'s hook, for this batch): restore
``batch.has_grammar``, then ``Band.finish`` (the barrier's feed through the ledger, tree copy wait,
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
    b = None if rt is None else band.band_of(rt)
    cur = None if b is None else b.in_flight_for(batch)
    if rt is None or b is None or cur is None or cur.job is None or vocab_mask is not None:
        return original(verify_input, batch, logits_output, vocab_mask, *args, **kwargs)
    cur.restore()
    # Band.finish itself (not band.build_vocab_mask): no pass-through frame between SGLang's call and the core
    vocab_mask = b.finish(cur.job, batch.reqs, batch.sampling_info, device=verify_input.retrieve_next_token.device,
                          draft_device=verify_input.draft_token, verify_input=verify_input)
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
    why="feed pending grammars, build and upload the tree mask after the verify launch",
)
