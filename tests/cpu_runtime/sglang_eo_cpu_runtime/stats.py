"""Counters of the scheduler's overlap decisions for grammar decode batches, readable from the test process.

The scheduler runs in a spawned subprocess, so the counters are written (atomically, on every change) to the JSON
file named by ``SGLANG_EO_STATS_FILE``; :func:`read_stats` reads it back. Without that variable nothing is written.

``grammar_decode_batches``: calls of ``Scheduler.is_disable_overlap_for_batch`` for a decode batch with speculative
decoding on and at least one grammar request. ``overlap_disabled_grammar_decode_batches``: those of them for which it
returned True (the loop synced instead of overlapping).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

__all__ = ["STATS_ENV", "count_overlap_decision", "read_stats", "record_error", "mark_scheduler_started"]

STATS_ENV = "SGLANG_EO_STATS_FILE"

_lock = threading.Lock()
_state: dict[str, Any] = {
    "pid": None,
    "scheduler_started": False,
    "overlap_enabled": None,
    "grammar_decode_batches": 0,
    "overlap_disabled_grammar_decode_batches": 0,
    "overlap_decisions": 0,
    "runtime_errors": [],
}


def _write() -> None:
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    _state["pid"] = os.getpid()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_state, f)
    os.replace(tmp, path)


def record_error(message: str) -> None:
    with _lock:
        _state["runtime_errors"].append(message)
        _write()


def mark_scheduler_started(scheduler: Any) -> None:
    with _lock:
        _state["scheduler_started"] = True
        _state["overlap_enabled"] = bool(getattr(scheduler, "enable_overlap", False))
        _write()


def _is_grammar_spec_decode(batch: Any) -> bool:
    if batch is None:
        return False
    try:
        return (
            not batch.spec_algorithm.is_none()
            and bool(batch.has_grammar)
            and batch.forward_mode.is_decode()
        )
    except AttributeError:
        return False


def count_overlap_decision(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """Called with the final result of ``Scheduler.is_disable_overlap_for_batch(batch, last_batch)``."""
    with _lock:
        _state["overlap_decisions"] += 1
        if _is_grammar_spec_decode(batch):
            _state["grammar_decode_batches"] += 1
            if result:
                _state["overlap_disabled_grammar_decode_batches"] += 1
            _write()
    return None


def read_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The last counters the scheduler wrote to ``path`` (empty dict when none yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
