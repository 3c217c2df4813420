"""AROUND ``sglang.srt.speculative.spec_utils.build_grammar_vocab_mask``.

Why: upstream builds the verify-tree bitmask with ``generate_token_bitmask``, a recursive Python DFS that calls
``XGrammarGrammar.accept_token`` / ``fill_vocab_mask`` / ``rollback(1)`` per node; that ``rollback`` slices the
request's ``accepted_tokens`` list, so its cost grows with the output length (SG#38863), and the DFS itself is 4-28x
slower than xgrammar's native walk (see notes/landscape.md).

How (keyword-only signature of 0.5.23: ``reqs, tree, sampling_info, device, barrier``):

1. ``barrier()`` -- the scheduler's ``_advance_pending_grammar``; it reaches the ledger through
   ``hook_advance_grammar_fsm`` (exactly-once advance of the previous batch's accepted tokens);
2. ``tree.resolve()`` -- waits on the plugin copier's event only;
3. ``STATE.builder.build`` -- native / lockstep xgrammar build on the bare matchers (never
   ``XGrammarGrammar.rollback``), rejected rows all-allowed like SGLang, finished requests unconstrained (SG#28986);
4. non-blocking upload; ``sampling_info.grammar_mask = None`` whenever a request of the batch has a grammar (upstream
   resets it so the extend stage's leftover mask is not applied);
5. requests in ``TreeMask.timed_out`` get their device draft candidates neutralised
   (:func:`~sglang_eagle_overlap.core.neutralize_timed_out_drafts`) before the caller samples, so the step accepts
   only the grammar-masked bonus token for them.

Trees the plugin did not create (SGLang's own ``GrammarTree``, or plugin inactive) go to SGLang's function unchanged.
Chain trees without a neutralisable draft tensor are built without a time limit (exact, never neutralised).

Upstream state: 0.5.23 still uses the Python DFS (SG#15465, native traversal, open).

When to remove: when upstream builds tree masks natively without per-node ``rollback`` list slicing.
"""

from __future__ import annotations

from typing import Any

from sglang_eagle_overlap.adapters.common import STATE, Hook, mask_step
from sglang_eagle_overlap.adapters.v0_5_23.hook_grammar_tree import PluginGrammarTree

__all__ = ["HOOK", "TARGET", "build_grammar_vocab_mask_around", "build_mask"]

TARGET = "sglang.srt.speculative.spec_utils.build_grammar_vocab_mask"


def build_grammar_vocab_mask_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    tree = kwargs.get("tree")
    if args or not STATE.active or not isinstance(tree, PluginGrammarTree):
        return original(*args, **kwargs)
    return build_mask(
        reqs=kwargs["reqs"], tree=tree, sampling_info=kwargs["sampling_info"], device=kwargs["device"],
        barrier=kwargs.get("barrier"),
    )


def build_mask(*, reqs: Any, tree: PluginGrammarTree, sampling_info: Any, device: Any, barrier: Any) -> Any:
    """The plugin's mask step (:func:`~sglang_eagle_overlap.adapters.common.mask_step`) in 0.5.23's return type."""
    vocab_mask, _ = mask_step(
        reqs=reqs, tree=tree.pending, vocab_size=sampling_info.vocab_size, device=device, barrier=barrier,
        draft_device=tree.draft_device,
    )
    handle = next((r.grammar for r in reqs if getattr(r, "grammar", None) is not None), None)
    if handle is None:
        return None
    # Upstream resets it whenever it builds a mask; otherwise the extend stage's leftover mask is applied.
    sampling_info.grammar_mask = None
    if vocab_mask is None:
        return None
    from sglang.srt.constrained.base_grammar_backend import GrammarMask

    return GrammarMask(handle, vocab_mask)


# Modules that do ``from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask``.
HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=build_grammar_vocab_mask_around,
    callers=(
        ("sglang.srt.speculative.eagle_worker_common", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.ngram_worker", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.dspark_components.dspark_worker_v2", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.dflash_worker_v2", "build_grammar_vocab_mask"),
    ),
    why="native tree mask (TreeMaskBuilder) after the barrier, timeouts neutralised",
)
