"""A clock only the test moves, for code that times itself with ``time.perf_counter``.

``FakeTime`` stands in for the ``time`` module of the module under test (``monkeypatch.setattr(mod, "time",
FakeTime())``): its ``perf_counter`` reads ``now``, which only the test moves, from every thread alike; every other
function is the real ``time`` module's. ``perf_counter`` is one object (an instance attribute), so code given it as
its clock can still tell it is "the real clock" (``clock is time.perf_counter`` with the stand-in installed).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["FakeTime"]


class FakeTime:
    """``perf_counter`` reads ``now`` (moved by the test only); any other attribute is the real ``time`` module's."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.perf_counter = lambda: self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)
