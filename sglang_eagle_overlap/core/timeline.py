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

``sglang_eo_dev.timeline_events.group_steps`` (dev tools) turns the flat event log into per-step records relative to the verify launch: a step is closed
by its ``sample`` point and owns every grammar phase that ended since the previous ``sample`` -- whichever side of
the launch it ran on (stock 0.5.16 advances in post-processing, before the next launch: negative times) -- and the
``mask_apply`` that follows its ``sample``.

On a CPU engine the "forward" runs synchronously in the launching thread, so a measured timeline shows no real
overlap; it measures the CPU phases. On a GPU the ``forward`` span is only the launch call.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Deque, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "FLUSH_INTERVAL_S",
    "GRAMMAR_PHASES",
    "Event",
    "TIMELINE_ENV",
    "Timeline",
    "process_timeline",
]

TIMELINE_ENV = "SGLANG_EAGLE_OVERLAP_TIMELINE_FILE"
FLUSH_INTERVAL_S = 0.25
GRAMMAR_PHASES: Tuple[str, ...] = ("advance", "tree_wait", "mask_build", "mask_upload")
_POINTS = frozenset({"tree_copy", "sample"})

Event = Tuple[str, float, float, int, bool]


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
