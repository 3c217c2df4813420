"""Shared runtime pieces of the 0.5.23 adapter (no SGLang import at module level).

* per-step stats recording into ``STATE.stats`` and a periodic INFO line for operators;
* optional JSON stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``), so a test can read from the scheduler process that
  the plugin path ran;
* the mask upload fence (the host bitmask buffer is reused, so a build must not overwrite it before the previous
  step's non-blocking upload finished).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Optional

from sglang_eagle_overlap.adapters.common import STATE

__all__ = ["record_step", "record_advance", "snapshot", "wait_previous_upload", "fence_upload", "ENV_STATS_FILE"]

logger = logging.getLogger("sglang_eagle_overlap")

ENV_STATS_FILE = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
ENV_LOG_INTERVAL = "SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S"

_log: Dict[str, float] = {"last_log": 0.0, "last_write": 0.0, "steps_at_log": 0}
_upload: Dict[str, Any] = {"event": None}
EXTRA: Dict[str, int] = {"ledger_resets": 0, "aborts": 0, "neutralized_requests": 0}


def _log_interval_s() -> float:
    try:
        return float(os.environ.get(ENV_LOG_INTERVAL, "30"))
    except ValueError:
        return 30.0


def snapshot() -> Dict[str, Any]:
    d: Dict[str, Any] = dict(STATE.stats.as_dict())
    d.update(EXTRA)
    d["ledger_requests"] = len(STATE.ledger)
    d["ledger_tokens_fed"] = STATE.ledger.tokens_fed
    d["pinned_allocations"] = STATE.copier.pinned_allocations
    d["active"] = STATE.active
    d["pid"] = os.getpid()
    return d


def record_advance(seconds: float, tokens: int) -> None:
    st = STATE.stats
    st.advance_s += seconds
    st.tokens_advanced += tokens


def record_step(barrier_s: float, tree_wait_s: float, mask_s: float, timed_out: int) -> None:
    st = STATE.stats
    st.steps += 1
    st.tree_wait_s += tree_wait_s
    st.mask_s += mask_s
    st.grammar_s += barrier_s + tree_wait_s + mask_s
    st.mask_timeouts += timed_out
    st.last = {"barrier_s": barrier_s, "tree_wait_s": tree_wait_s, "mask_s": mask_s}
    now = time.monotonic()
    if st.steps == 1 or now - _log["last_log"] >= _log_interval_s():
        steps = st.steps - int(_log["steps_at_log"])
        logger.info(
            "sglang-eagle-overlap: %d grammar verify steps (+%d), per step avg: grammar %.3f ms (tree wait %.3f ms, "
            "mask %.3f ms), advance total %.3f s over %d tokens, mask timeouts %d, ledger requests %d",
            st.steps, steps, 1e3 * st.grammar_s / st.steps, 1e3 * st.tree_wait_s / st.steps,
            1e3 * st.mask_s / st.steps, st.advance_s, st.tokens_advanced, st.mask_timeouts, len(STATE.ledger),
        )
        _log["last_log"] = now
        _log["steps_at_log"] = st.steps
    write_stats_file(force=True)  # only when the env var is set (tests, debugging): one small write per step


def write_stats_file(force: bool = False) -> Optional[str]:
    path = os.environ.get(ENV_STATS_FILE)
    if not path:
        return None
    now = time.monotonic()
    if not force and now - _log["last_write"] < 0.5:
        return None
    _log["last_write"] = now
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(snapshot(), f)
        os.replace(tmp, path)
    except OSError as exc:  # stats are best effort, never fail a step for them
        logger.debug("sglang-eagle-overlap: cannot write stats file %s: %s", path, exc)
        return None
    return path


def wait_previous_upload() -> None:
    """Block until the previous step's mask upload left the reused host buffer (normally long done)."""
    ev = _upload["event"]
    if ev is not None:
        ev.synchronize()
        _upload["event"] = None


def fence_upload(device_tensor: Any) -> None:
    """Record an event after the non-blocking mask upload (device tensors only)."""
    dev = getattr(device_tensor, "device", None)
    if dev is None or dev.type == "cpu":
        return
    import torch

    ev = torch.get_device_module(dev).Event()
    ev.record()
    _upload["event"] = ev
