"""Analysis of the timeline the product records (:mod:`sglang_eagle_overlap.core.timeline`): the event file read
back, events grouped into per-step records relative to the verify launch, and launch-to-launch periods. Used by
``benchmarks/timeline.py`` and the tests; the product only records.

:func:`group_steps`: a step is closed by its ``sample`` point and owns every grammar phase that ended since the
previous ``sample`` -- whichever side of the launch it ran on (stock 0.5.16 advances in post-processing, before the
next launch: negative times) -- and the ``mask_apply`` that follows its ``sample``.
"""

from __future__ import annotations

import json
import statistics
from typing import Dict, Iterable, List, Optional, Sequence, TypedDict

from sglang_eagle_overlap.core.timeline import GRAMMAR_PHASES, Event

__all__ = ["StepRecord", "group_steps", "load_events", "median_or_none", "step_periods"]


class StepRecord(TypedDict):
    """One grammar verify step of :func:`group_steps` (times in ms relative to its verify launch)."""

    bs: int
    launch_s: float
    forward: List[float]
    phases: Dict[str, List[List[float]]]
    tree_copy: Optional[float]
    sample: float
    grammar_ms: float
    apply_ms: float
    period_ms: Optional[float]


def load_events(path: str) -> List[Event]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [(str(e[0]), float(e[1]), float(e[2]), int(e[3]), bool(e[4])) for e in data["events"]]


def group_steps(events: Iterable[Event]) -> List[StepRecord]:
    """Per grammar verify step: phase intervals in ms relative to the verify launch (start of its ``forward``).

    Returns dicts with ``bs``, ``launch_s`` (absolute), ``forward`` ``[0, end]``, ``phases`` ``{name: [[s, e], ...]}``,
    ``tree_copy`` (ms or None), ``sample`` (ms), ``grammar_ms`` (sum of the grammar phase durations, up to
    ``sample``), ``apply_ms`` (the sampler's mask application after it) and ``period_ms`` (launch to the next grammar
    step's launch with the same bs, None for the last). Steps without a grammar forward are skipped.
    """
    evs = sorted(events, key=lambda e: (e[2], e[1]))
    steps: List[StepRecord] = []
    pending: List[Event] = []
    last_forward: Optional[Event] = None
    for ev in evs:
        name = ev[0]
        if name == "forward":
            if ev[4]:
                last_forward = ev
            continue
        if name == "mask_apply":
            if steps and ev[1] >= steps[-1]["launch_s"] + steps[-1]["sample"] / 1e3:
                last = steps[-1]
                last["phases"].setdefault("mask_apply", []).append(
                    [(ev[1] - last["launch_s"]) * 1e3, (ev[2] - last["launch_s"]) * 1e3])
                last["apply_ms"] += (ev[2] - ev[1]) * 1e3
            continue
        if name != "sample":
            pending.append(ev)
            continue
        fwd = last_forward
        if fwd is None or fwd[1] > ev[1]:
            pending = []
            continue
        launch = fwd[1]

        def rel(t: float) -> float:
            return (t - launch) * 1e3

        phases: Dict[str, List[List[float]]] = {}
        tree_copy = None
        for p in pending:
            if p[0] == "tree_copy":
                tree_copy = rel(p[1])
            elif p[0] in GRAMMAR_PHASES:
                phases.setdefault(p[0], []).append([rel(p[1]), rel(p[2])])
        grammar_ms = sum(e - s for spans in phases.values() for s, e in spans)
        steps.append({
            "bs": ev[3] or fwd[3],
            "launch_s": launch,
            "forward": [0.0, rel(fwd[2])],
            "phases": phases,
            "tree_copy": tree_copy,
            "sample": rel(ev[1]),
            "grammar_ms": grammar_ms,
            "apply_ms": 0.0,
            "period_ms": None,
        })
        pending = []
        last_forward = None
    for a, b in zip(steps, steps[1:]):
        if a["bs"] == b["bs"]:
            a["period_ms"] = (b["launch_s"] - a["launch_s"]) * 1e3
    return steps


def step_periods(events: Iterable[Event], grammar: bool) -> Dict[int, List[float]]:
    """Launch-to-launch intervals (ms) of consecutive verify forwards with the same bs and grammar flag, by bs.

    An interval is kept only when no forward of the other kind ran in between (one batch decoding on its own)."""
    fwds = sorted((e for e in events if e[0] == "forward"), key=lambda e: e[1])
    out: Dict[int, List[float]] = {}
    for a, b in zip(fwds, fwds[1:]):
        if a[4] == grammar and b[4] == grammar and a[3] == b[3]:
            out.setdefault(a[3], []).append((b[1] - a[1]) * 1e3)
    return out


def median_or_none(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None
