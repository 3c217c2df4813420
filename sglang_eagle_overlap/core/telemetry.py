"""A grammar step's instrumentation: counters and timings, the forward-ready probe, the Prometheus exporter, the
timeline, the periodic log line and the JSON stats file.

:class:`StepTelemetry` is a part that :class:`~sglang_eagle_overlap.core.step.GrammarStep` is given (the integration
builds it from its settings; tests build it bare). The step records into it and, once constructed, attaches itself
as the telemetry's *source*: a callable returning a :class:`StepState` (what the stats file and the log line say
about the step itself). Before that, :meth:`StepTelemetry.snapshot` reports an empty step.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Dict, Mapping, NamedTuple, Optional

from sglang_eagle_overlap.core.protocols import ForwardProbe, StatValue, StepExporter
from sglang_eagle_overlap.core.stats import StepStats, distributed_rank, rank_stats_path
from sglang_eagle_overlap.core.timeline import Timeline

if TYPE_CHECKING:
    from torch.types import Device

__all__ = ["ForcedCounts", "StepState", "StepTelemetry"]

logger = logging.getLogger("sglang_eagle_overlap")


class ForcedCounts(NamedTuple):
    """Grammar-forced drafts since start: proposed, changed, accepted, accepted among the changed ones, draft nodes
    that recorded a continuation, and nodes that recorded none but one after a bonus key (all zero when forced drafts
    are off)."""

    proposed: int = 0
    changed: int = 0
    accepted: int = 0
    changed_accepted: int = 0
    nodes: int = 0
    keyed_nodes: int = 0


class StepState(NamedTuple):
    """What the step says about itself in the stats file and the log line (read at each report)."""

    grammar_thread: bool = False
    forced: Optional[ForcedCounts] = None  # None: forced drafts off
    native: bool = False
    tokens_fed: int = 0
    ledger_requests: int = 0
    pinned_allocations: int = 0


class _Inert:
    """Stands in for an absent probe / exporter (an exporter that is not ``enabled`` is not called)."""

    enabled = False

    def on_launch(self, device: Device = None) -> None:
        pass

    def on_mask_start(self, device: Device = None, t: Optional[float] = None) -> None:
        pass

    def on_mask_ready(self, t_ready: float) -> float:
        return 0.0

    def observe_step(self, grammar_s: float, unhidden_s: float, timeouts: int, *, forced_proposed: int = 0,
                     forced_accepted: int = 0) -> None:
        pass


class StepTelemetry:
    """Stats, probe, exporter, timeline and stats file of one grammar step (see the module docstring).

    ``stats_file``: the JSON file :meth:`write_stats` writes every step (None: none); ``log_interval_s``: the period of
    the INFO line; ``state``: extra fields for the stats file (the integration's own, e.g. whether it is active)."""

    def __init__(
        self,
        *,
        probe: Optional[ForwardProbe] = None,
        exporter: Optional[StepExporter] = None,
        timeline: Optional[Timeline] = None,
        stats_file: Optional[str] = None,
        log_interval_s: float = 30.0,
        state: Optional[Callable[[], Mapping[str, StatValue]]] = None,
    ) -> None:
        self.stats = StepStats()
        self.probe: ForwardProbe = probe if probe is not None else _Inert()
        self.exporter: StepExporter = exporter if exporter is not None else _Inert()
        self.timeline = timeline if timeline is not None else Timeline(None)
        self.stats_file = stats_file
        self._stats_path: Optional[str] = None  # stats_file made rank-aware, fixed once the process group is known
        self.log_interval_s = log_interval_s
        self._state = state
        self._source: Callable[[], StepState] = StepState
        self._last_log = float("-inf")
        # Whether the exporter takes steps (its ``enabled``, absent: True), read at the first step: a disabled one
        # (no ``--enable-metrics``) is not called at all, nor are the forced-draft counts it would get computed.
        self._exporting: Optional[bool] = None

    def attach(self, source: Callable[[], StepState]) -> None:
        """Read the step's own fields from ``source`` at each report (``GrammarStep`` attaches itself once)."""
        self._source = source

    @property
    def exporting(self) -> bool:
        """Whether the exporter takes steps (decided at the first ask)."""
        exporting = self._exporting
        if exporting is None:
            exporting = self._exporting = bool(getattr(self.exporter, "enabled", True))
        return exporting

    def count(self, name: str, k: int = 1) -> None:
        """Add ``k`` to the counter ``name`` (names: ``core.stats.COUNTERS``)."""
        self.stats.count(name, k)

    def snapshot(self) -> Dict[str, StatValue]:
        s = self.stats
        step = self._source()
        d: Dict[str, StatValue] = {
            "steps": s.steps,
            "grammar_s": s.grammar_s,
            "unhidden_s": s.unhidden_s,
            "advance_s": s.advance_s,
            "tree_wait_s": s.tree_wait_s,
            "mask_s": s.mask_s,
            "mask_timeouts": s.mask_timeouts,
            "sched_s": s.sched_s,
            "join_wait_s": s.join_wait_s,
            "helper_gil_s": s.helper_gil_s,
            "handoff_s": s.handoff_s,
            "grammar_thread": step.grammar_thread,
            "forced_drafts": step.forced is not None,
            "native": step.native,
            "tokens_advanced": step.tokens_fed,
            "ledger_requests": step.ledger_requests,
            "pinned_allocations": step.pinned_allocations,
            "pid": os.getpid(),
        }
        (d["forced_proposed"], d["forced_changed"], d["forced_accepted"], d["forced_changed_accepted"],
         d["forced_nodes"], d["forced_keyed_nodes"]) = step.forced or ForcedCounts()
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
            step = self._source()
            forced = step.forced or ForcedCounts()
            logger.info(
                "sglang-eagle-overlap: %d grammar verify steps; per step: grammar %.3f ms (advance %.3f, tree wait "
                "%.3f, mask %.3f), on the scheduler thread %.3f ms (grammar thread %s: hand-off %.3f, join wait %.3f, "
                "its GIL time <= %.3f), not hidden by the forward %.3f ms; %d mask time-limit hits; forced drafts %s "
                "(%d proposed, %d changed, %d accepted); ledger %d requests; %s",
                s.steps, m["grammar_ms"], m["advance_ms"], m["tree_wait_ms"], m["mask_ms"], m["sched_ms"],
                "on" if step.grammar_thread else "off", m["handoff_ms"], m["join_wait_ms"], m["helper_gil_ms"],
                m["unhidden_ms"],
                s.mask_timeouts, "on" if step.forced is not None else "off", forced.proposed, forced.changed,
                forced.accepted, step.ledger_requests, s.counters,
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

