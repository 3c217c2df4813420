"""Per-step timeline of the grammar work around the target-verify forward (measurement only, off by default).

Recording: every timing point is one ``time.perf_counter()`` pair appended to a bounded ring buffer (``deque``), so
a busy engine never grows memory. Nothing is recorded unless ``SGLANG_EAGLE_OVERLAP_TIMELINE_FILE`` names a file;
then a daemon thread of the recording process (SGLang's scheduler) rewrites that JSON file every
``FLUSH_INTERVAL_S`` while new events arrive, so the step itself never pays for the file write.

Events (``name``, absolute ``t0`` / ``t1`` in seconds of ``perf_counter``, ``bs``, ``grammar``):

* ``forward``      -- the target-verify forward call (its start is the *verify launch*);
* ``advance``      -- grammar FSM advance of the previous step's accepted tokens;
* ``tree_wait``    -- waiting for the verify tree on the host (blocking ``.cpu()`` or an async copy's event);
* ``mask_build``   -- the tree bitmask build;
* ``mask_upload``  -- the mask's host-to-device copy (and the plugin's time-limit handling);
* ``tree_copy``    -- a point: the async tree copy was started (plugin, before the launch);
* ``sample``       -- a point: sampling needs the mask now (the mask is handed to the sampler);
* ``mask_apply``   -- the sampler applying the mask to the logits (after ``sample``; belongs to the step before);

:func:`group_steps` turns the flat event log into per-step records relative to the verify launch: a step is closed
by its ``sample`` point and owns every grammar phase that ended since the previous ``sample`` -- whichever side of
the launch it ran on (stock 0.5.16 advances in post-processing, before the next launch: negative times) -- and the
``mask_apply`` that follows its ``sample``.

On a CPU engine the "forward" runs synchronously in the launching thread, so a measured timeline shows no real
overlap; it measures the CPU phases. On a GPU the ``forward`` span is only the launch call.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import deque
from typing import Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, TypedDict

__all__ = [
    "FLUSH_INTERVAL_S",
    "GRAMMAR_PHASES",
    "StepRecord",
    "TIMELINE_ENV",
    "Timeline",
    "group_steps",
    "load_events",
    "step_periods",
    "timeline",
]

TIMELINE_ENV = "SGLANG_EAGLE_OVERLAP_TIMELINE_FILE"
FLUSH_INTERVAL_S = 0.25
GRAMMAR_PHASES: Tuple[str, ...] = ("advance", "tree_wait", "mask_build", "mask_upload")
_POINTS = frozenset({"tree_copy", "sample"})

Event = Tuple[str, float, float, int, bool]


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


class Timeline:
    """Bounded event ring buffer; ``enabled`` only when constructed with a path (see :func:`timeline`)."""

    def __init__(self, path: Optional[str] = None, capacity: int = 50_000, meta: Optional[Mapping[str, object]] = None):
        self.path = path
        self.enabled = bool(path)
        self.meta: Dict[str, object] = dict(meta or {})
        self._events: Deque[Event] = deque(maxlen=capacity)
        self._appended = 0
        self._written = 0
        self._lock = threading.Lock()
        self._writer: Optional[threading.Thread] = None

    # -- recording (hot path: a tuple append when enabled, an attribute test when not) --------------------------------
    def span(self, name: str, t0: float, t1: float, bs: int = 0, grammar: bool = True) -> None:
        if not self.enabled:
            return
        self._events.append((name, t0, t1, bs, grammar))
        self._appended += 1
        if self._writer is None:
            self._start_writer()

    def point(self, name: str, t: Optional[float] = None, bs: int = 0, grammar: bool = True) -> None:
        if not self.enabled:
            return
        t = time.perf_counter() if t is None else t
        self.span(name, t, t, bs, grammar)

    # -- reading -----------------------------------------------------------------------------------------------------
    def events(self) -> List[Event]:
        return list(self._events)

    def to_json(self) -> Dict[str, object]:
        return {
            "pid": os.getpid(),
            "meta": self.meta,
            "dropped": max(0, self._appended - len(self._events)),
            "events": [list(e) for e in self.events()],
        }

    def flush(self) -> bool:
        """Write the JSON file now (atomically). Returns False when disabled or the write failed."""
        if not self.path:
            return False
        with self._lock:
            self._written = self._appended
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(self.to_json(), f)
                os.replace(tmp, self.path)
            except OSError:
                return False
        return True

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is not None:
                return
            self._writer = threading.Thread(target=self._write_loop, name="eagle-overlap-timeline", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            if self._appended != self._written:
                self.flush()


_singleton: List[Optional[Timeline]] = [None]


def process_timeline(path: Optional[str]) -> Timeline:
    """The process's recorder, created on the first call with ``path`` (the plugin's ``Settings.timeline_file``, or a
    dev probe's own ``SGLANG_EAGLE_OVERLAP_TIMELINE_FILE``; None: disabled). Later calls return the same recorder
    whatever they pass: the plugin and the dev probes of stock SGLang share one file per process."""
    tl = _singleton[0]
    if tl is None:
        tl = _singleton[0] = Timeline(path or None)
    return tl


def load_events(path: str) -> List[Event]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return [(str(e[0]), float(e[1]), float(e[2]), int(e[3]), bool(e[4])) for e in data["events"]]


# -- analysis -------------------------------------------------------------------------------------------------------
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
