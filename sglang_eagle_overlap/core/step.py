"""One grammar-constrained verify step, engine-agnostic: the object every SGLang integration drives.

:class:`GrammarStep` owns the verify tree's host copier, the exactly-once accept ledger, the tree-mask builder and the
instrumentation (stats, timeline, forward-ready probe, Prometheus). One lives in each worker process; the host
integration (hooks or a patched SGLang) only translates its objects into these calls.

Call order of one verify step (the host's scheduler thread)::

    pending = step.copy_tree(next_token, next_sibling, draft)     # 1. before the target-verify launch
    ... the host launches the target-verify forward ...
    mask = step.build_mask(requests, pending, vocab_size=..., device=..., barrier=..., draft_device=...)
        # 2. barrier(): the previous batch's accepted runs -> step.advance(...) (exactly once each)
        # 3. wait for the tree copy, build the mask, upload it non-blocking, neutralise unmasked drafts
    ... the host samples with mask.device_mask; it aborts mask.failed requests alone ...
    step.advance(rid, grammar, start, tokens)                      # 4. post-processing: replays what 2 fed

Invariants: a run of accepted tokens reaches ``grammar.accept_token`` exactly once per (request id, output position),
whichever of 2 and 4 asks first; the host bitmask buffer is reused only after the previous upload left it; every
request whose rows are not exact this step (time limit, failed build) has its drafts neutralised before sampling; a
process that is one rank of several (tensor parallelism) builds without the time limit, so that every rank's mask
is the same function of the same grammar states.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Hashable, Optional, Sequence

from sglang_eagle_overlap.core.ledger import (
    AcceptLedger,
    AdvanceOutcome,
    GrammarLike,
    LedgerConflictError,
    LedgerGapError,
)
from sglang_eagle_overlap.core.mask import MaskRequest, TreeMask, TreeMaskBuilder, neutralize_timed_out_drafts
from sglang_eagle_overlap.core.stats import StepStats, distributed_rank, rank_stats_path
from sglang_eagle_overlap.core.timeline import Timeline
from sglang_eagle_overlap.core.tree_copy import HostTreeCopier, PendingTree

__all__ = ["GrammarStep", "StepMask"]

logger = logging.getLogger("sglang_eagle_overlap")


@dataclass(slots=True)
class StepMask:
    """What :meth:`GrammarStep.build_mask` hands back: the device mask for sampling (None: nothing constrained) and
    the host build's result (``failed`` rows the host must abort alone; ``timed_out`` rows already neutralised)."""

    device_mask: Any
    tree: TreeMask


class _Inert:
    """Stands in for an absent probe / exporter."""

    def on_launch(self, device: Any = None) -> None:
        pass

    def on_mask_start(self, device: Any = None, t: Optional[float] = None) -> None:
        pass

    def on_mask_ready(self, t_ready: float) -> float:
        return 0.0

    def observe_step(self, grammar_s: float, unhidden_s: float, timeouts: int) -> None:
        pass


class GrammarStep:
    """Copier + ledger + mask builder + instrumentation of one worker process (see the module docstring)."""

    def __init__(
        self,
        *,
        mask_threads: Optional[int] = None,
        mask_time_limit_s: Optional[float] = 0.05,
        pin_memory: Optional[bool] = None,
        probe: Any = None,
        exporter: Any = None,
        timeline: Optional[Timeline] = None,
        stats_file: Optional[str] = None,
        log_interval_s: float = 30.0,
        state: Optional[Callable[[], Dict[str, Any]]] = None,
    ) -> None:
        self.copier = HostTreeCopier()
        self.ledger = AcceptLedger()
        self.stats = StepStats()
        self._threads = mask_threads
        self._limit_s = mask_time_limit_s
        self._pin = pin_memory
        self._builder: Optional[TreeMaskBuilder] = None
        self.probe = probe if probe is not None else _Inert()
        self.exporter = exporter if exporter is not None else _Inert()
        self.timeline = timeline if timeline is not None else Timeline(None)
        self.stats_file = stats_file
        self._stats_path: Optional[str] = None  # stats_file made rank-aware, fixed once the process group is known
        self.log_interval_s = log_interval_s
        self._state = state  # extra fields for the stats file (the integration's own, e.g. whether it is active)
        self._time_limit_ok: Optional[bool] = None  # see _may_time_out
        self._upload_event: Any = None  # fence: the builder's host buffer is reused by the next build
        self._last_log = float("-inf")

    @property
    def builder(self) -> TreeMaskBuilder:
        if self._builder is None:
            pin = self._pin
            if pin is None:
                import torch

                pin = bool(torch.cuda.is_available())
            self._builder = TreeMaskBuilder(threads=self._threads, time_limit_s=self._limit_s, pin_memory=pin)
        return self._builder

    # -- 1. before the verify launch ---------------------------------------------------------------------------
    def copy_tree(self, retrieve_next_token: Any, retrieve_next_sibling: Any, draft_tokens: Any) -> PendingTree:
        """Start the verify tree's host copy (reused pinned buffers, one event). Call just before the target-verify
        launch, on the stream that produced the tree."""
        self.probe.on_launch(retrieve_next_token.device)
        self.timeline.point("tree_copy")
        return self.copier.start(retrieve_next_token, retrieve_next_sibling, draft_tokens)

    # -- 2./4. the exactly-once advance --------------------------------------------------------------------------
    def advance(self, key: Hashable, grammar: GrammarLike, start: int, tokens: Sequence[int]) -> AdvanceOutcome:
        """Feed ``tokens`` (committed at output position ``start``) to ``grammar`` exactly once.

        If the ledger and the host disagree about the position (the host rolled or rebuilt the matcher behind the
        ledger's back), the entry is re-anchored at the host's position, counted and logged, instead of raising into
        the host's scheduler loop."""
        try:
            return self.ledger.advance(key, grammar, start, tokens)
        except (LedgerGapError, LedgerConflictError) as exc:
            logger.warning("sglang-eagle-overlap: re-anchoring grammar ledger of request %s at position %d: %s",
                           key, start, exc)
            self.stats.count("ledger_resets")
            self.ledger.reset(key, start)
            return self.ledger.advance(key, grammar, start, tokens)

    def prune(self, live: Collection[Hashable], finished: Sequence[Hashable] = ()) -> None:
        """Keep the ledger bounded: drop ``finished`` requests, and all not ``live`` once it outgrows the batch."""
        for key in finished:
            self.ledger.forget(key)
        if len(self.ledger) > max(64, 4 * len(live)):
            self.stats.count("ledger_forgets", self.ledger.retain(live))

    # -- 2./3. after the verify launch ---------------------------------------------------------------------------
    def build_mask(
        self,
        requests: Sequence[MaskRequest],
        tree: PendingTree,
        *,
        vocab_size: int,
        device: Any,
        barrier: Optional[Callable[[], Any]] = None,
        draft_device: Any = None,
    ) -> StepMask:
        """The grammar work of one verify step. Call after the target-verify launch, before sampling.

        Order: ``barrier()`` (the previous batch's accepted runs into the matchers, through :meth:`advance`) -> wait
        for the tree copy -> wait until the previous upload left the reused host buffer -> build -> non-blocking
        upload (fenced by an event) -> neutralise the drafts of requests whose rows are not exact (time limit or a
        failed build). ``draft_device`` is the device draft-token tensor the sampler will read; None means the caller
        cannot neutralise, so the build runs without a time limit. On a CPU device the returned mask aliases the
        builder's buffer: this step's sampling consumes it before the next build."""
        t0 = time.perf_counter()
        self.probe.on_mask_start(device, t0)
        if barrier is not None:
            barrier()
        t1 = time.perf_counter()
        nxt, sib, draft = tree.resolve()
        t2 = time.perf_counter()
        if self._upload_event is not None:
            self._upload_event.synchronize()  # normally long done
            self._upload_event = None
        bs, n = nxt.shape[0], nxt.shape[-1]
        result = self.builder.build(requests, nxt.reshape(bs, n), sib.reshape(bs, n), draft.reshape(bs, n),
                                    vocab_size, allow_timeout=draft_device is not None and self._may_time_out())
        t_built = time.perf_counter()
        device_mask = None
        if result.bitmask is not None:
            device_mask = result.bitmask.to(device, non_blocking=True)
            if device_mask.device.type != "cpu":
                import torch

                self._upload_event = torch.get_device_module(device_mask.device).Event()
                self._upload_event.record()
        unmasked = result.timed_out + [i for i, _ in result.failed]
        if unmasked and draft_device is not None:
            neutralize_timed_out_drafts(draft_device, unmasked, n)
        t3 = time.perf_counter()
        unhidden = self.probe.on_mask_ready(t3)
        self.stats.record_step(t1 - t0, t2 - t1, t3 - t2, len(result.timed_out), bs, unhidden)
        self.stats.count("mask_failures", len(result.failed))
        self.exporter.observe_step(t3 - t0, unhidden, len(result.timed_out))
        tl = self.timeline
        if tl.enabled:
            tl.span("advance", t0, t1, bs)
            tl.span("tree_wait", t1, t2, bs)
            tl.span("mask_build", t2, t_built, bs)
            tl.span("mask_upload", t_built, t3, bs)
            tl.point("sample", t3, bs)
        self.report()
        return StepMask(device_mask, result)

    def _may_time_out(self) -> bool:
        """Whether this process may apply the mask time limit: not when it is one of several ranks of a
        ``torch.distributed`` group (TP > 1). The limit is wall-clock time, so two ranks building the same mask could
        disagree on which requests keep their drafts, accept different tokens and silently diverge (the next
        collectives then mix different sequences); without it every rank builds the same exact mask, the ranks stay
        in step and a slow grammar costs time only, as in stock SGLang. Decided once, at the first verify step
        (the process group exists by then), and logged once."""
        if self._time_limit_ok is None:
            rank = distributed_rank()
            self._time_limit_ok = rank is None or rank[1] <= 1
            if not self._time_limit_ok and self._limit_s:
                logger.info("sglang-eagle-overlap: mask time limit off in this process (rank %d of %d): tensor-"
                            "parallel ranks must build identical masks", *rank)
        return self._time_limit_ok

    # -- reporting -----------------------------------------------------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        s = self.stats
        d: Dict[str, Any] = {
            "steps": s.steps,
            "grammar_s": s.grammar_s,
            "unhidden_s": s.unhidden_s,
            "advance_s": s.advance_s,
            "tree_wait_s": s.tree_wait_s,
            "mask_s": s.mask_s,
            "mask_timeouts": s.mask_timeouts,
            "tokens_advanced": self.ledger.tokens_fed,
            "ledger_requests": len(self.ledger),
            "pinned_allocations": self.copier.pinned_allocations,
            "pid": os.getpid(),
        }
        rank = distributed_rank()
        d["rank"], d["world_size"] = rank if rank is not None else (None, None)
        d.update(s.counters)
        if self._state is not None:
            d.update(self._state())
        return d

    def report(self) -> None:
        """An INFO line on the first step and then every ``log_interval_s``; the JSON stats file every step when
        ``stats_file`` is set (tests, debugging). The line's numbers are means per verify step since start: grammar
        ms (advance + tree wait + mask), the part not hidden by the forward, and the mask time-limit hits."""
        s = self.stats
        now = time.monotonic()
        if s.steps == 1 or now - self._last_log >= self.log_interval_s:
            self._last_log = now
            m = s.per_step_ms()
            logger.info(
                "sglang-eagle-overlap: %d grammar verify steps; per step: grammar %.3f ms (advance %.3f, tree wait "
                "%.3f, mask %.3f), not hidden by the forward %.3f ms; %d mask time-limit hits; ledger %d requests; %s",
                s.steps, m["grammar_ms"], m["advance_ms"], m["tree_wait_ms"], m["mask_ms"], m["unhidden_ms"],
                s.mask_timeouts, len(self.ledger), s.counters,
            )
        self.write_stats()

    def stats_path(self) -> Optional[str]:
        """Where :meth:`write_stats` writes: ``stats_file``, suffixed with the process's rank when it is one of
        several ranks of a ``torch.distributed`` group (TP > 1: ``stats.json`` -> ``stats.rank<r>.json`` for every
        rank, see :func:`~sglang_eagle_overlap.core.stats.rank_stats_path`). Fixed at the first call that finds the
        group initialised; before that (or without torch.distributed) ``stats_file`` itself."""
        if not self.stats_file or self._stats_path is not None:
            return self._stats_path or self.stats_file
        rank = distributed_rank()
        if rank is None:
            return self.stats_file
        self._stats_path = rank_stats_path(self.stats_file, *rank)
        return self._stats_path

    def write_stats(self) -> None:
        path = self.stats_path()
        if not path:
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, path)
        except OSError as exc:  # stats are best effort, never fail a step for them
            logger.debug("sglang-eagle-overlap: cannot write stats file %s: %s", path, exc)
