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

import json
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, List, Optional

from sglang_eagle_overlap.adapters.common import STATE, mask_request_for
from sglang_eagle_overlap.core import PendingTree, neutralize_timed_out_drafts

logger = logging.getLogger("sglang_eagle_overlap")

EAGLE_FAMILY = frozenset({"EAGLE", "EAGLE3", "STANDALONE"})
LOG_EVERY_STEPS = int(os.environ.get("SGLANG_EAGLE_OVERLAP_LOG_EVERY", "500"))
STATS_FILE_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"


@dataclass
class Extra:
    """Adapter-specific counters, merged into the stats JSON."""

    overlap_kept: int = 0  # grammar decode batches whose forced sync the plugin dropped
    plugin_steps: int = 0  # verify steps whose grammar work the plugin did
    fallback_steps: int = 0  # grammar verify steps left to upstream (non-xgrammar grammar backend)
    barrier_runs: int = 0  # (batch, result) pairs from result_queue advanced before sampling
    replays: int = 0  # post-processing asks answered from the ledger
    ledger_forgets: int = 0


EXTRA = Extra()


@dataclass
class StepContext:
    batch: Any
    pending: Optional[PendingTree]
    saved_has_grammar: bool = True
    hidden: bool = False
    t_start: float = field(default_factory=time.perf_counter)


_ctx: List[Optional[StepContext]] = [None]
_scheduler_ref: List[Any] = [None]
_upload_event: List[Any] = [None]


def algorithm_name(batch_or_args: Any) -> str:
    algo = getattr(batch_or_args, "spec_algorithm", None)
    if algo is None:
        algo = getattr(batch_or_args, "speculative_algorithm", None)
    if algo is None:
        return ""
    return str(getattr(algo, "name", algo)).upper()


def is_eagle_family(batch_or_args: Any) -> bool:
    return algorithm_name(batch_or_args) in EAGLE_FAMILY


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
        EXTRA.fallback_steps += 1
        return None
    vi = batch.spec_info
    pending = STATE.copier.start(vi.retrieve_next_token, vi.retrieve_next_sibling, vi.draft_token)
    ctx = StepContext(batch=batch, pending=pending, saved_has_grammar=batch.has_grammar)
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
        ctx.batch.has_grammar = ctx.saved_has_grammar
        ctx.hidden = False
    if _ctx[0] is ctx:
        _ctx[0] = None


# -- barrier ------------------------------------------------------------------------------------------------------
def _advance(req: Any, start: int, tokens: List[int]):
    return STATE.ledger.advance(str(req.rid), req.grammar, start, tokens)


def advance_pending_results() -> int:
    """Feed the unprocessed results in ``scheduler.result_queue`` to the grammars (exactly once, via the ledger).

    Mirrors what post-processing will do with them: same rows skipped (finished / retracted / still-chunked), same
    output positions (``len(req.output_ids)`` before the tokens are appended).
    """
    sched = scheduler()
    queue = getattr(sched, "result_queue", None) if sched is not None else None
    if not queue:
        return 0
    fed_before = STATE.ledger.tokens_fed
    live = set()
    for item in list(queue):
        try:
            b, r = item
        except (TypeError, ValueError):
            continue
        reqs = getattr(b, "reqs", None) or []
        for req in reqs:
            live.add(str(req.rid))
        if r is None or getattr(r, "next_token_ids", None) is None:
            continue
        if not any(getattr(req, "grammar", None) is not None for req in reqs):
            continue
        fm = b.forward_mode
        if fm.is_idle():
            continue
        copy_done = getattr(r, "copy_done", None)
        if copy_done is not None:
            copy_done.synchronize()
        ids = r.next_token_ids.tolist()
        EXTRA.barrier_runs += 1
        if fm.is_decode() and getattr(r, "accept_lens", None) is not None:
            lens = r.accept_lens.tolist()
            stride = r.speculative_num_draft_tokens
            for i, req in enumerate(reqs):
                if req.grammar is None or req.is_retracted or req.finished():
                    continue
                _advance(req, len(req.output_ids), ids[i * stride : i * stride + lens[i]])
        elif fm.is_extend():
            for i, req in enumerate(reqs):
                if req.grammar is None or req.is_retracted or req.finished():
                    continue
                if getattr(req, "inflight_middle_chunks", 0) > 0:
                    continue  # a chunk that did not finish the prompt emits no token
                _advance(req, len(req.output_ids), [int(ids[i])])
    if sched is not None:
        cur = current()
        if cur is not None:
            live.update(str(req.rid) for req in cur.batch.reqs)
        _sweep(live)
    return STATE.ledger.tokens_fed - fed_before  # replays feed nothing


def _sweep(live: set) -> None:
    # Forget requests no longer anywhere the scheduler can hand them to us again before their next step; a request
    # that comes back (retraction) is re-anchored at first sight, which is exact because every advance went through
    # the ledger.
    entries = getattr(STATE.ledger, "_entries", None)
    if entries is None or len(entries) <= len(live):
        return
    for key in [k for k in entries if k not in live]:
        STATE.ledger.forget(key)
        EXTRA.ledger_forgets += 1


# -- mask ---------------------------------------------------------------------------------------------------------
def build_vocab_mask(verify_input: Any, batch: Any, num_draft_tokens: int) -> Any:
    """Called in ``eagle_sample`` (after the verify launch, before sampling). Returns the device mask or None."""
    ctx = _ctx[0]
    if ctx.hidden:
        batch.has_grammar = ctx.saved_has_grammar
        ctx.hidden = False
    stats = STATE.stats
    t0 = time.perf_counter()
    stats.tokens_advanced += advance_pending_results()
    t1 = time.perf_counter()
    nxt, sib, tok = ctx.pending.resolve()
    t2 = time.perf_counter()
    prev = _upload_event[0]
    if prev is not None:
        prev.synchronize()  # the builder reuses its host buffer; the last upload must have read it
        _upload_event[0] = None
    requests = [mask_request_for(req) for req in batch.reqs]
    vocab_size = batch.sampling_info.vocab_size
    result = STATE.builder.build(requests, nxt, sib, tok, vocab_size)
    t3 = time.perf_counter()
    device_mask = None
    if result.bitmask is not None:
        device = verify_input.retrieve_next_token.device
        device_mask = result.bitmask.to(device, non_blocking=True)
        if device.type != "cpu":
            import torch

            ev = torch.get_device_module(device).Event()
            ev.record()
            _upload_event[0] = ev
        grammar = None
        for req in batch.reqs:
            if req.grammar is not None:
                grammar = req.grammar
        verify_input.grammar = grammar
        # Otherwise the extend-stage vocab mask would be applied again (upstream does the same).
        batch.sampling_info.vocab_mask = None
        if result.timed_out:
            neutralize_timed_out_drafts(verify_input.draft_token, result.timed_out, num_draft_tokens)
            stats.mask_timeouts += len(result.timed_out)
    stats.steps += 1
    EXTRA.plugin_steps += 1
    stats.advance_s += t1 - t0
    stats.tree_wait_s += t2 - t1
    stats.mask_s += t3 - t2
    stats.grammar_s += t3 - t0
    stats.last = {"advance_s": t1 - t0, "tree_wait_s": t2 - t1, "mask_s": t3 - t2, "bs": float(len(batch.reqs))}
    _report()
    return device_mask


def stats_dict() -> dict:
    d = dict(STATE.stats.as_dict())
    d.update(EXTRA.__dict__)
    d["pid"] = os.getpid()
    d["active"] = bool(STATE.active)
    return d


def _report() -> None:
    s = STATE.stats
    if LOG_EVERY_STEPS > 0 and s.steps % LOG_EVERY_STEPS == 0:
        n = max(s.steps, 1)
        logger.info(
            "sglang-eagle-overlap: %d grammar verify steps; mean per step advance %.3f ms, tree wait %.3f ms, "
            "mask %.3f ms; %d mask timeouts; %d batches kept overlapped",
            s.steps, s.advance_s / n * 1e3, s.tree_wait_s / n * 1e3, s.mask_s / n * 1e3, s.mask_timeouts,
            EXTRA.overlap_kept,
        )
    write_stats_file()


def write_stats_file() -> None:
    path = os.environ.get(STATS_FILE_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(stats_dict(), f)
        os.replace(tmp, path)
    except OSError as exc:  # never break serving for a stats file
        logger.debug("sglang-eagle-overlap: could not write stats file %s: %s", path, exc)
