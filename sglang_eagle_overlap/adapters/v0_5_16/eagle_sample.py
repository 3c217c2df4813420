"""Hook: ``sglang.srt.speculative.eagle_utils.eagle_sample`` (AROUND).

Why: this is the first point after the target-verify launch where the grammar mask is needed, i.e. the window in
which host grammar work overlaps the GPU forward.

How: for a plugin-owned step (see ``run_eagle_verify``): restore ``batch.has_grammar``; advance the previous batch's
accepted tokens from ``scheduler.result_queue`` through ``STATE.ledger`` (exactly once per (rid, position)); wait for
the async tree copy; build the tree mask with ``STATE.builder``; neutralise the draft candidates of requests whose
mask build timed out (``neutralize_timed_out_drafts``); upload the mask non-blocking; set ``verify_input.grammar``
and clear ``batch.sampling_info.vocab_mask`` as upstream does; then call the original with the mask. Everything else
(ngram worker, unconstrained batches, plugin inactive) passes straight through.

Upstream state: 0.5.17 runs ``build_grammar_vocab_mask(..., barrier=Scheduler._advance_pending_grammar)`` here.

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.common import STATE, Hook
from sglang_eagle_overlap.adapters.v0_5_16 import _runtime

TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"


def eagle_sample(original, verify_input, batch, logits_output, vocab_mask=None, *args, **kwargs):
    ctx = _runtime.current() if STATE.active else None
    if ctx is None or ctx.batch is not batch or vocab_mask is not None:
        return original(verify_input, batch, logits_output, vocab_mask, *args, **kwargs)
    vocab_mask = _runtime.build_vocab_mask(verify_input, batch)
    return original(verify_input, batch, logits_output, vocab_mask, *args, **kwargs)


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
