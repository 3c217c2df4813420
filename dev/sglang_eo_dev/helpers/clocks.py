"""A clock only the test moves, for code that times itself with ``time.perf_counter``.

``FakeTime`` stands in for the ``time`` module of the module under test (``monkeypatch.setattr(mod, "time",
FakeTime())``): its ``perf_counter`` reads ``now``, which only the test moves, from every thread alike; every other
function is the real ``time`` module's. ``perf_counter`` is one object (an instance attribute), so code given it as
its clock can still tell it is "the real clock" (``clock is time.perf_counter`` with the stand-in installed).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CpuClock", "FakeTime"]


class FakeTime:
    """``perf_counter`` reads ``now`` (moved by the test only); any other attribute is the real ``time`` module's."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.perf_counter = lambda: self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class CpuClock:
    """A thread CPU clock (``time.thread_time``'s stand-in) that moves only when the test's stand-ins call
    :meth:`tick`: by ``per_tick`` seconds, counted in ``ticks``. Sums of it are exact, not timings."""

    def __init__(self, per_tick: float, now: float = 50.0) -> None:
        self.now, self.per_tick, self.ticks = now, per_tick, 0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.per_tick
        self.ticks += 1
