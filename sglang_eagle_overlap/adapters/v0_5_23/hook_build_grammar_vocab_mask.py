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

import time
from typing import Any, Dict

from sglang_eagle_overlap.adapters.common import STATE, Hook, mask_request_for
from sglang_eagle_overlap.adapters.v0_5_23 import _support
from sglang_eagle_overlap.adapters.v0_5_23.hook_grammar_tree import PluginGrammarTree
from sglang_eagle_overlap.core import TreeMaskBuilder, neutralize_timed_out_drafts

__all__ = ["HOOK", "TARGET", "build_grammar_vocab_mask_around", "build_mask"]

TARGET = "sglang.srt.speculative.spec_utils.build_grammar_vocab_mask"
_exact: Dict[str, Any] = {"builder": None}


def _exact_builder() -> TreeMaskBuilder:
    if _exact["builder"] is None:
        import torch

        _exact["builder"] = TreeMaskBuilder(time_limit_s=None, pin_memory=bool(torch.cuda.is_available()))
    return _exact["builder"]


def build_grammar_vocab_mask_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    tree = kwargs.get("tree")
    if args or not STATE.active or not isinstance(tree, PluginGrammarTree):
        return original(*args, **kwargs)
    return build_mask(
        reqs=kwargs["reqs"], tree=tree, sampling_info=kwargs["sampling_info"], device=kwargs["device"],
        barrier=kwargs.get("barrier"),
    )


def build_mask(*, reqs: Any, tree: PluginGrammarTree, sampling_info: Any, device: Any, barrier: Any) -> Any:
    """The plugin's mask step. Call after the target verify launch, before sampling."""
    t0 = time.perf_counter()
    if barrier is not None:
        barrier()
    t1 = time.perf_counter()
    nxt, sib, draft = tree.resolve()
    t2 = time.perf_counter()
    _support.wait_previous_upload()
    requests = [mask_request_for(r) for r in reqs]
    builder = STATE.builder if tree.draft_device is not None else _exact_builder()
    bs = nxt.shape[0]
    n = nxt.shape[-1]
    result = builder.build(requests, nxt.reshape(bs, n), sib.reshape(bs, n), draft.reshape(bs, n),
                           sampling_info.vocab_size)
    handle = next((r.grammar for r in reqs if getattr(r, "grammar", None) is not None), None)
    grammar_mask = None
    if handle is not None:
        # Upstream resets it whenever it builds a mask; otherwise the extend stage's leftover mask is applied.
        sampling_info.grammar_mask = None
    if result.bitmask is not None:
        host = result.bitmask
        import torch

        if torch.device(device).type == "cpu":
            vocab_mask = host.clone()  # the builder reuses its buffer; a CPU "upload" would alias it
        else:
            vocab_mask = host.to(device, non_blocking=True)
            _support.fence_upload(vocab_mask)
        from sglang.srt.constrained.base_grammar_backend import GrammarMask

        grammar_mask = GrammarMask(handle, vocab_mask)
    if result.timed_out:
        if tree.draft_device is not None:
            neutralize_timed_out_drafts(tree.draft_device, result.timed_out, n)
            _support.EXTRA["neutralized_requests"] += len(result.timed_out)
    t3 = time.perf_counter()
    _support.record_step(t1 - t0, t2 - t1, t3 - t2, len(result.timed_out))
    return grammar_mask


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
