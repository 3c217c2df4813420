"""Operator-facing numbers of the grammar work, per process (engine-agnostic)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

__all__ = ["COUNTERS", "StepStats", "distributed_rank", "rank_stats_path"]

# Event counters every integration reports under these names (patched SGLang and hooks alike).
COUNTERS = (
    "aborts",  # requests aborted because the grammar rejected a committed token
    "mask_failures",  # requests aborted because their grammar raised during the tree mask build
    "ledger_resets",  # ledger re-anchored at the host's position (gap / conflict)
    "ledger_forgets",  # entries dropped when the ledger outgrew the live batch
    "overlap_kept",  # grammar decode batches whose forced sync the integration dropped (0.5.16)
    "fallback_steps",  # grammar verify steps left to the host's own path (non-xgrammar backend)
    "barrier_runs",  # (batch, result) pairs advanced at the verify barrier
    "replays",  # post-processing asks answered from the ledger (already fed at the barrier)
    "stand_aside_algorithms",  # algorithms whose grammar batches the integration left to SGLang (logged once each)
    "thread_steps",  # verify steps whose native call ran on the grammar thread
    "guidance_steps",  # verify steps whose llguidance rows took the batched walk (llguidance's parallel fills)
    "schemas_rewritten",  # JSON schemas compiled with maxLength strings as patterns (integration.schemas)
)


@dataclass
class StepStats:
    """``grammar_s`` is what verify steps spent on the CPU between the verify launch and the mask upload: ledger
    advance (barrier) + tree-copy wait + mask build (+ upload). ``unhidden_s`` is the part of it after the verify
    forward was ready, i.e. what sampling waited for (estimated by
    :class:`~sglang_eagle_overlap.metrics.ForwardReadyProbe`; on CPU all of ``grammar_s``)."""

    steps: int = 0
    unhidden_s: float = 0.0
    advance_s: float = 0.0
    tree_wait_s: float = 0.0
    mask_s: float = 0.0
    mask_timeouts: int = 0
    # Scheduler-thread accounting (the grammar's cost to SGLang's own loop): ``sched_s`` is what the step's grammar
    # calls cost the scheduler thread (inline: all of the work; grammar thread: hand-off + join wait + upload),
    # ``join_wait_s`` the part of it spent waiting for the grammar thread, ``helper_gil_s`` the grammar thread's CPU
    # time outside GIL-free native fills (an upper bound of the GIL time it took from the scheduler thread),
    # ``handoff_s`` the grammar thread's wake-up latency (from the hand-off until it ran Python: the OS wake-up and
    # winning the GIL), a latency, not CPU time.
    sched_s: float = 0.0
    join_wait_s: float = 0.0
    helper_gil_s: float = 0.0
    handoff_s: float = 0.0
    _last: Optional[Tuple[float, float, float, int, float]] = None
    # Every counter is present (0) from the start, so readers never see a missing key.
    counters: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def count(self, name: str, k: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + k

    def record_step(self, advance_s: float, tree_wait_s: float, mask_s: float, timeouts: int, bs: int,
                    unhidden_s: float = 0.0, *, sched_s: Optional[float] = None, join_wait_s: float = 0.0,
                    helper_gil_s: float = 0.0, handoff_s: float = 0.0) -> None:
        """One verify step. ``unhidden_s`` may belong to earlier steps (CUDA events are read lazily). ``sched_s``
        defaults to the whole work (the inline path runs all of it on the scheduler thread)."""
        self.steps += 1
        self.sched_s += (advance_s + tree_wait_s + mask_s) if sched_s is None else sched_s
        self.join_wait_s += join_wait_s
        self.helper_gil_s += helper_gil_s
        self.handoff_s += handoff_s
        self.advance_s += advance_s
        self.tree_wait_s += tree_wait_s
        self.mask_s += mask_s
        self.unhidden_s += unhidden_s
        self.mask_timeouts += timeouts
        self._last = (advance_s, tree_wait_s, mask_s, bs, unhidden_s)  # :attr:`last` makes the dict when read

    @property
    def last(self) -> Dict[str, float]:
        """The last step's numbers (empty before the first)."""
        if self._last is None:
            return {}
        advance_s, tree_wait_s, mask_s, bs, unhidden_s = self._last
        return {"advance_s": advance_s, "tree_wait_s": tree_wait_s, "mask_s": mask_s, "bs": float(bs),
                "unhidden_s": unhidden_s}

    @property
    def grammar_s(self) -> float:
        return self.advance_s + self.tree_wait_s + self.mask_s

    def per_step_ms(self) -> Dict[str, float]:
        """Mean per step, in ms, of the operator numbers (0 before the first step)."""
        n = max(self.steps, 1)
        return {
            "grammar_ms": self.grammar_s / n * 1e3,
            "unhidden_ms": self.unhidden_s / n * 1e3,
            "advance_ms": self.advance_s / n * 1e3,
            "tree_wait_ms": self.tree_wait_s / n * 1e3,
            "mask_ms": self.mask_s / n * 1e3,
            "sched_ms": self.sched_s / n * 1e3,
            "join_wait_ms": self.join_wait_s / n * 1e3,
            "helper_gil_ms": self.helper_gil_s / n * 1e3,
            "handoff_ms": self.handoff_s / n * 1e3,
        }


def rank_stats_path(path: str, rank: int, world_size: int) -> str:
    """The stats file one process of a ``world_size``-process group writes: ``path`` itself when it is alone, else
    ``<stem>.rank<rank><ext>`` (``stats.json`` -> ``stats.rank1.json``), so that the TP ranks of one server, each a
    scheduler process with its own grammar step, do not overwrite each other's file."""
    if world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def distributed_rank() -> Optional[Tuple[int, int]]:
    """``(rank, world_size)`` of this process's initialised ``torch.distributed`` group, else None.

    Never imports torch (a process that has not imported it has no group); SGLang initialises the group of its TP
    (x PP) ranks in every scheduler process before the first verify step. Data-parallel replicas without DP
    attention each have a group of their own, so their ranks repeat across replicas."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()
