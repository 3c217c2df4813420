"""Per-step plumbing shared by the 0.5.16 hook modules (not itself a hook).

Call order inside one EAGLE verify step (all on the scheduler thread, which in 0.5.16 also drives the worker):

1. ``run_eagle_verify`` (AROUND) -> :func:`begin_step`: decide whether the plugin owns this step's grammar work,
   start the async host copy of the verify tree (before the target-verify launch), stash a :class:`StepContext`.
2. ``eagle_prepare_for_verify`` (AROUND) -> :func:`after_prepare`: once the verify ``ForwardBatch`` is built (it still
   sees ``batch.has_grammar``), hide ``has_grammar`` so upstream's blocking ``.cpu()`` and its Python mask are skipped.
3. target-verify forward is launched by upstream.
4. ``eagle_sample`` (AROUND) -> :func:`build_vocab_mask`: restore ``has_grammar``, advance the previous batch's
   accepted tokens through the ledger (the "barrier"), wait for the tree copy, build the mask, neutralise timed-out
   drafts, upload the mask non-blocking, then upstream samples with it.
5. ``run_eagle_verify`` finally -> :func:`end_step`: restore ``has_grammar`` whatever happened.

Post-processing (``_resolve_spec_v2_tokens`` -> ``_accept_grammar_tokens``, ``_apply_prefill_grammar``) replays the
ledger, so each matcher is advanced exactly once per accepted token.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional

from sglang_eagle_overlap import support
from sglang_eagle_overlap.adapters.common import (
    STATE,
    advance,
    mark_verify_launch,
    mask_step,
    prune_ledger,
    write_stats,
)
from sglang_eagle_overlap.core import PendingTree

logger = logging.getLogger("sglang_eagle_overlap")

BAND = "0.5.16"
# Algorithms whose grammar decode batches the plugin keeps in the overlap (EAGLE, EAGLE3, STANDALONE; NEXTN arrives
# resolved to EAGLE). The decision per algorithm, with its reason, is data in ``sglang_eagle_overlap.support``.
EAGLE_FAMILY = support.kept_algorithms(BAND)
_announced: set = set()


@dataclass
class StepContext:
    batch: Any
    pending: Optional[PendingTree]
    hidden: bool = False  # batch.has_grammar is False while hidden (it is True whenever a context exists)


_ctx: List[Optional[StepContext]] = [None]
_scheduler_ref: List[Any] = [None]


def algorithm_name(batch_or_args: Any) -> str:
    algo = getattr(batch_or_args, "spec_algorithm", None)
    if algo is None:
        algo = getattr(batch_or_args, "speculative_algorithm", None)
    if algo is None:
        return ""
    return str(getattr(algo, "name", algo)).upper()


def is_eagle_family(batch_or_args: Any) -> bool:
    return algorithm_name(batch_or_args) in EAGLE_FAMILY


def announce_stand_aside(batch: Any) -> None:
    """Log once per process and algorithm that a grammar batch of a non-family algorithm stays on SGLang's path."""
    name = algorithm_name(batch)
    if name and name != "NONE" and name not in EAGLE_FAMILY and name not in _announced:
        _announced.add(name)
        STATE.stats.count("stand_aside_algorithms")
        logger.info(support.stand_aside_message(BAND, name))
        write_stats()


def remember_scheduler(scheduler: Any) -> None:
    current = _scheduler_ref[0]
    if current is None or current() is not scheduler:
        _scheduler_ref[0] = weakref.ref(scheduler)


def scheduler() -> Any:
    ref = _scheduler_ref[0]
    return None if ref is None else ref()


def current() -> Optional[StepContext]:
    return _ctx[0]


def _innermost(grammar: Any) -> Any:
    seen = 0
    while type(grammar).__name__ == "ReasonerGrammarObject" and seen < 4:
        grammar = getattr(grammar, "grammar", None)
        seen += 1
    return grammar


def plugin_can_mask(batch: Any) -> bool:
    """Our int32 bitmask layout is xgrammar's; other backends (llguidance, outlines) stay on upstream's path."""
    for req in batch.reqs:
        g = getattr(req, "grammar", None)
        if g is None:
            continue
        inner = _innermost(g)
        if inner is None:
            continue  # reasoning wrapper without a grammar: generic walk, xgrammar-free, mask rows stay -1
        if type(inner).__name__ != "XGrammarGrammar":
            return False
    return True


def begin_step(batch: Any) -> Optional[StepContext]:
    """Called at the top of ``run_eagle_verify``. Returns the context when the plugin owns this step."""
    if not STATE.active or not getattr(batch, "has_grammar", False) or not is_eagle_family(batch):
        return None
    fm = getattr(batch, "forward_mode", None)
    if fm is not None and fm.is_idle():
        return None
    if not plugin_can_mask(batch):
        STATE.stats.count("fallback_steps")
        return None
    vi = batch.spec_info
    mark_verify_launch(vi.retrieve_next_token.device)
    pending = STATE.copier.start(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.draft_token)
    ctx = StepContext(batch=batch, pending=pending)
    _ctx[0] = ctx
    return ctx


def after_prepare(batch: Any) -> None:
    ctx = _ctx[0]
    if ctx is not None and ctx.batch is batch and not ctx.hidden:
        ctx.hidden = True
        batch.has_grammar = False


def end_step(ctx: Optional[StepContext]) -> None:
    if ctx is None:
        return
    if ctx.hidden:
        ctx.batch.has_grammar = True
        ctx.hidden = False
    if _ctx[0] is ctx:
        _ctx[0] = None


# -- barrier ------------------------------------------------------------------------------------------------------
def advance_pending_results() -> int:
    """Feed the unprocessed results in ``scheduler.result_queue`` to the grammars (exactly once, via the ledger).

    Mirrors what post-processing will do with them: same rows skipped (finished / retracted / still-chunked), same
    output positions (``len(req.output_ids)`` before the tokens are appended). Returns the tokens newly fed.
    """
    sched = scheduler()
    queue = getattr(sched, "result_queue", None) if sched is not None else None
    if not queue:
        return 0
    fed_before = STATE.ledger.tokens_fed
    live = set()
    for b, r in list(queue):
        reqs = getattr(b, "reqs", None) or []
        live.update(str(req.rid) for req in reqs)
        fm = b.forward_mode
        if r is None or r.next_token_ids is None or fm.is_idle():
            continue
        if not any(req.grammar is not None for req in reqs):
            continue
        is_decode = fm.is_decode() and r.accept_lens is not None
        if not (is_decode or fm.is_extend()):
            continue
        if r.copy_done is not None:
            r.copy_done.synchronize()
        ids = r.next_token_ids.tolist()
        if is_decode:
            lens = r.accept_lens.tolist()
            stride = r.speculative_num_draft_tokens
        STATE.stats.count("barrier_runs")
        for i, req in enumerate(reqs):
            if req.grammar is None or req.is_retracted or req.finished():
                continue
            if not is_decode and req.inflight_middle_chunks > 0:
                continue  # a chunk that did not finish the prompt emits no token
            run = ids[i * stride : i * stride + lens[i]] if is_decode else [int(ids[i])]
            advance(req, len(req.output_ids), run)
    cur = current()
    if cur is not None:
        live.update(str(req.rid) for req in cur.batch.reqs)
    prune_ledger(live)
    return STATE.ledger.tokens_fed - fed_before  # replays feed nothing


# -- mask ---------------------------------------------------------------------------------------------------------
def build_vocab_mask(verify_input: Any, batch: Any) -> Any:
    """Called in ``eagle_sample`` (after the verify launch, before sampling). Returns the device mask or None."""
    ctx = _ctx[0]
    if ctx.hidden:
        batch.has_grammar = True
        ctx.hidden = False
    device_mask, _ = mask_step(
        reqs=batch.reqs, tree=ctx.pending, vocab_size=batch.sampling_info.vocab_size,
        device=verify_input.retrieve_next_token.device, barrier=advance_pending_results,
        draft_device=verify_input.draft_token,
    )
    if device_mask is not None:
        verify_input.grammar = next(req.grammar for req in batch.reqs if req.grammar is not None)
        # Otherwise the extend-stage vocab mask would be applied again (upstream does the same).
        batch.sampling_info.vocab_mask = None
    return device_mask
