"""A stand-in for a device event (``torch.cuda.Event``) on a host without a device: it counts the waits."""

from __future__ import annotations

__all__ = ["CountingEvent"]


class CountingEvent:
    """``synchronize()`` returns at once and counts itself in ``waits``."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
