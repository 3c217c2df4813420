"""Counters of the scheduler's overlap decisions for grammar decode batches, readable from the test process.

The scheduler runs in a spawned subprocess, so the counters are written (atomically, on every change) to the JSON
file named by ``SGLANG_EO_STATS_FILE``; :func:`read_stats` reads it back. Without that variable nothing is written.
With several ranks (TP > 1) each scheduler writes its own file, ``<stem>.rank<r><ext>``
(:func:`sglang_eagle_overlap.core.stats.rank_stats_path`); :func:`read_rank_stats` reads them all.

``grammar_decode_batches``: calls of ``Scheduler.is_disable_overlap_for_batch`` for a decode batch with speculative
decoding on and at least one grammar request. ``overlap_disabled_grammar_decode_batches``: those of them for which it
returned True (the loop synced instead of overlapping).

``idle_memory_checks``: SGLang's own memory-leak checks when the scheduler is idle that completed without finding a
leak (``SchedulerInvariantChecker._check_req_pool`` returned; with SGLang's default strict idle check a leak raises and
kills the scheduler instead). Written at most every 0.25 s. ``faults_*``: injections of :mod:`.faults` (tests only).
``abort_requests``: rids of the abort requests the scheduler received (``/abort_request``, client disconnects), last 256.
``grammar_cache``: what SGLang's grammar cache stored (``BaseGrammarBackend.set_cache``), last 64: the key's type, the
SHA-256 of the key's text and of the cached grammar's ``key_string`` (None when it has none).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

__all__ = ["STATS_ENV", "count", "count_idle_memory_check", "record_abort_request", "count_overlap_decision",
           "read_rank_stats", "read_stats", "record_error", "record_grammar_cache", "mark_scheduler_started", "peek",
           "text_sha256", "update"]

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
    "idle_memory_checks": 0,
    "faults_raised": 0,
    "faults_slow_fills": 0,
    "abort_requests": [],
    "grammar_cache": [],
    # written by .ledger_probe (constrained stress tests)
    "retracted_requests": 0,
    "retracted_constrained": 0,
    "ledger_max_entries": 0,
    "ledger_prefills_over_64": 0,
    "ledger_live_misses": 0,
}
_last_idle_write = [0.0]


def _write() -> None:
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    from sglang_eagle_overlap.core.stats import distributed_rank, rank_stats_path

    rank = distributed_rank()
    if rank is not None:  # TP > 1: one file per rank (stats.json -> stats.rank<r>.json), as the product plugin does
        path = rank_stats_path(path, *rank)
        _state["rank"], _state["world_size"] = rank
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


def is_grammar_spec_decode(batch: Any) -> bool:
    """A decode batch with speculative decoding on and at least one grammar request (also :mod:`.step_times`)."""
    try:
        return (
            batch is not None
            and not batch.spec_algorithm.is_none()
            and bool(batch.has_grammar)
            and batch.forward_mode.is_decode()
        )
    except AttributeError:
        return False


def count_overlap_decision(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """Called with the final result of ``Scheduler.is_disable_overlap_for_batch(batch, last_batch)``."""
    with _lock:
        _state["overlap_decisions"] += 1
        if is_grammar_spec_decode(batch):
            _state["grammar_decode_batches"] += 1
            if result:
                _state["overlap_disabled_grammar_decode_batches"] += 1
            _write()
    return None


def update(change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to the counters under the lock and write the file (several related counters at once)."""
    with _lock:
        change(_state)
        _write()


def peek(name: str, default: Any = None) -> Any:
    """The current value of counter ``name`` in this process (no file read)."""
    return _state.get(name, default)


def count(name: str, k: int = 1) -> None:
    """Add ``k`` to counter ``name`` and write the file."""
    with _lock:
        _state[name] = _state.get(name, 0) + k
        _write()


def count_idle_memory_check(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of SGLang's idle ``SchedulerInvariantChecker._check_req_pool`` (reached only when no leak raised)."""
    with _lock:
        _state["idle_memory_checks"] += 1
        now = time.monotonic()
        if now - _last_idle_write[0] >= 0.25:  # the idle loop runs this often; the file needs only the trend
            _last_idle_write[0] = now
            _write()
    return None


def record_abort_request(result: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``Scheduler.abort_request(recv_req)``: remember which request the scheduler was told to abort."""
    with _lock:
        rids = _state["abort_requests"]
        rids.append("*" if getattr(recv_req, "abort_all", False) else str(getattr(recv_req, "rid", "")))
        del rids[:-256]
        _write()
    return None


def text_sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


def record_grammar_cache(result: Any, backend: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``BaseGrammarBackend.set_cache(key, value)``: which key SGLang's grammar cache stored, and the
    cached grammar's own ``key_string``."""
    key_type, key_string = key
    named = getattr(value, "key_string", None)
    with _lock:
        entries = _state["grammar_cache"]
        entries.append({"key_type": str(key_type), "key_sha256": text_sha256(str(key_string)),
                        "grammar_key_sha256": None if named is None else text_sha256(str(named))})
        del entries[:-64]
        _write()
    return None


def read_rank_stats(path: str | os.PathLike[str], world_size: int) -> list[dict[str, Any]]:
    """The counters of each of ``world_size`` ranks (index = rank) written for ``path`` (empty dicts for ranks that
    wrote nothing yet); ``world_size`` 1 reads ``path`` itself."""
    from sglang_eagle_overlap.core.stats import rank_stats_path

    return [read_stats(rank_stats_path(str(path), r, world_size)) for r in range(world_size)]


def read_stats(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The last counters the scheduler wrote to ``path`` (empty dict when none yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
