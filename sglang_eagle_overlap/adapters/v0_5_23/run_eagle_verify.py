"""Hook: ``sglang.srt.speculative.eagle_worker_common.run_eagle_verify`` (AROUND).

Why: the grammar thread must start the step's grammar work -- SGLang's barrier (the previous batch's
accepted tokens into the matchers) and the tree mask -- *before* the target-verify launch, so that it runs while the
forward does, off the scheduler thread. The earliest point that has the verify tree is ``GrammarTree.from_device``
(REPLACEd by :class:`~.band.PluginGrammarTree`), but SGLang hands the batch and the barrier only to the later
``build_grammar_vocab_mask`` call.

How: on entry the grammar-forced drafts replace the top-path drafts (:func:`~.band.before_verify`;
``eagle_prepare_for_verify`` then copies them into the target's input), then ``Band.run_verify`` runs the original
with this call's step in flight on the band (``Band023.verify_step``: the batch and the ``grammar_barrier`` keyword;
the vendored patch hands it over right before ``GrammarTree.from_device``, :func:`~.band.hand_over_verify`);
``PluginGrammarTree.from_device`` takes it and starts the job (:func:`~.band.start_grammar_job`);
``build_grammar_vocab_mask`` joins it. ``Band.run_verify`` clears the hand-off whatever happens. Batches without a
grammar pass straight through; whether the job runs on the grammar thread or inline after the launch is
``GrammarStep``'s decision.

Upstream state: 0.5.23 runs the barrier inside ``build_grammar_vocab_mask``, after the launch, on the scheduler
thread.

When to remove: when upstream hands the barrier to the tree constructor or runs the grammar work off the scheduler
thread itself.
"""

from __future__ import annotations

from typing import Any

from sglang_eagle_overlap.adapters.v0_5_23 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.eagle_worker_common.run_eagle_verify"


def run_eagle_verify(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    if rt is None:
        return original(batch, *args, **kwargs)
    # Grammar-forced drafts replace top-path drafts before eagle_prepare_for_verify makes them the target's input (a
    # step without a grammar drops the previous step's picks); before the hand-off, so that if it raises nothing is
    # left in flight for a later tree of another batch to pick up.
    band.before_verify(rt, batch, getattr(batch, "spec_info", None))
    b = band.band_of(rt)
    return b.run_verify(b.verify_step(batch, kwargs.get("grammar_barrier")), original, batch, *args, **kwargs)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=run_eagle_verify,
    callers=(
        ("sglang.srt.speculative.eagle_worker_v2", "run_eagle_verify"),
        ("sglang.srt.speculative.multi_layer_eagle_worker_v2", "run_eagle_verify"),
        ("sglang.srt.speculative.uno_worker_v2", "run_eagle_verify"),
    ),
    why="hand the batch and the grammar barrier to the verify-tree constructor (grammar thread)",
)
