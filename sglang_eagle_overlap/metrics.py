"""Operator-facing metrics of the plugin's grammar work: how much of it the verify forward does not hide.

Per plugin-owned verify step the adapters measure (always on, a few ``perf_counter`` calls):

* ``grammar`` time -- ledger advance + tree-copy wait + mask build + upload, between the verify launch and sampling;
* ``unhidden`` time -- the part of it that ran after the verify forward was ready, i.e. that sampling waited for the
  mask. How "forward ready" is known (:class:`ForwardReadyProbe`):

  - **CUDA**: two timing events on the launching stream, one where the tree copy starts (just before the verify
    launch) and one where the mask step starts (right after the launch call returned); their GPU elapsed time is the
    forward's duration, read back lazily (``Event.query()``, never a sync) one or more steps later. Forward ready is
    estimated as ``launch host time + GPU duration``: the GPU may have started later (still busy with the draft), so
    this is the *earliest* ready time and the un-hidden part an upper bound.
  - **CPU**: the forward runs synchronously inside the launch call, so it is ready when the mask step starts and all
    grammar time counts as un-hidden -- a CPU engine has no real overlap.
  - a CUDA step without a launch stamp (trees the plugin did not copy before the launch, e.g. linear chains) is not
    measured: it adds 0.

* ``mask_timeouts`` -- requests whose mask build hit ``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS``.

They appear in the plugin's periodic INFO log line (``core.StepTelemetry.report``) and, when SGLang runs with
``--enable-metrics`` (SGLang then sets ``PROMETHEUS_MULTIPROC_DIR`` for all its processes and its ``/metrics``
endpoint collects every process's metrics from that directory), as Prometheus counters (:data:`PROMETHEUS_NAMES`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    import torch
    from prometheus_client import Counter
    from torch.types import Device

__all__ = ["ForwardReadyProbe", "PrometheusExporter", "PROMETHEUS_NAMES"]

logger = logging.getLogger("sglang_eagle_overlap")

# metric name -> help text; prometheus_client appends ``_total`` to counters.
PROMETHEUS_NAMES: Dict[str, str] = {
    "sglang_eagle_overlap:grammar_steps": "Grammar-constrained EAGLE verify steps whose grammar work the plugin did",
    "sglang_eagle_overlap:grammar_seconds": "Plugin grammar CPU time per verify step (advance + tree wait + mask)",
    "sglang_eagle_overlap:grammar_unhidden_seconds": (
        "Part of the plugin grammar time after the verify forward was ready (sampling waited for the mask)"),
    "sglang_eagle_overlap:mask_timeouts": "Requests whose tree-mask build hit the mask time limit",
    "sglang_eagle_overlap:forced_drafts_proposed": "Draft tokens replaced by grammar-forced tokens",
    "sglang_eagle_overlap:forced_drafts_accepted": "Grammar-forced draft tokens accepted by the target verify",
}


class ForwardReadyProbe:
    """Splits each step's grammar time into hidden / un-hidden (see the module docstring for the estimate).

    Call order per step: :meth:`on_launch` before the verify launch (where the tree copy starts), :meth:`on_mask_start`
    after the launch call returned, :meth:`on_mask_ready` when the mask is handed to sampling. The latter returns the
    un-hidden seconds that became known now (this step's on CPU, earlier steps' on CUDA).
    """

    def __init__(self, max_pending: int = 64) -> None:
        self._launch_t: Optional[float] = None
        self._start_evt: Optional[torch.cuda.Event] = None
        self._end_evt: Optional[torch.cuda.Event] = None
        self._mask_start_t: Optional[float] = None
        self._async_device = False
        self._pending: Deque[Tuple[torch.cuda.Event, torch.cuda.Event, float, float]] = deque(maxlen=max_pending)

    def on_launch(self, device: Device = None) -> None:
        self._launch_t = time.perf_counter()
        self._start_evt = self._record(device)

    def on_mask_start(self, device: Device = None, t: Optional[float] = None) -> None:
        self._mask_start_t = time.perf_counter() if t is None else t
        self._async_device = self._device_type(device) == "cuda"
        self._end_evt = self._record(device) if self._start_evt is not None else None

    def on_mask_ready(self, t_ready: float) -> float:
        start, end, launch_t = self._start_evt, self._end_evt, self._launch_t
        mask_start = self._mask_start_t if self._mask_start_t is not None else t_ready
        self._start_evt = self._end_evt = self._launch_t = self._mask_start_t = None
        if start is not None and end is not None and launch_t is not None:
            self._pending.append((start, end, launch_t, t_ready))
            return self._drain()
        if self._async_device:
            return self._drain()  # no launch stamp for this step: not measured
        return max(0.0, t_ready - mask_start)

    def _drain(self) -> float:
        total = 0.0
        while self._pending:
            start, end, launch_t, t_ready = self._pending[0]
            try:
                if not end.query():
                    break
                gpu_s = start.elapsed_time(end) / 1e3
            except Exception:  # events from another context / not timing-enabled: drop, never fail a step
                gpu_s = None
            self._pending.popleft()
            if gpu_s is not None:
                total += max(0.0, t_ready - (launch_t + gpu_s))
        return total

    @staticmethod
    def _device_type(device: Device) -> str:
        if device is None:
            return ""
        return getattr(device, "type", None) or str(device).split(":")[0]

    @staticmethod
    def _record(device: Device) -> Optional[torch.cuda.Event]:
        if ForwardReadyProbe._device_type(device) != "cuda":
            return None
        import torch

        evt = torch.cuda.Event(enable_timing=True)
        evt.record()
        return evt


class PrometheusExporter:
    """Prometheus counters in SGLang's multiprocess registry directory; inert unless ``PROMETHEUS_MULTIPROC_DIR`` is
    set (SGLang sets it when started with ``--enable-metrics``) and ``prometheus_client`` imports."""

    def __init__(self) -> None:
        self._counters: Optional[Dict[str, Counter]] = None
        self._tried = False

    @property
    def enabled(self) -> bool:
        return self._ensure() is not None

    def _ensure(self) -> Optional[Dict[str, Counter]]:
        if self._tried:
            return self._counters
        self._tried = True
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return None
        try:
            from prometheus_client import Counter
        except ImportError:
            logger.info("sglang-eagle-overlap: prometheus_client not importable; metrics only in the log line")
            return None
        try:
            self._counters = {name: Counter(name, doc) for name, doc in PROMETHEUS_NAMES.items()}
        except ValueError as exc:  # already registered in this process (a second exporter)
            logger.warning("sglang-eagle-overlap: cannot register Prometheus metrics: %s", exc)
            self._counters = None
        return self._counters

    def observe_step(self, grammar_s: float, unhidden_s: float, timeouts: int, *, forced_proposed: int = 0,
                     forced_accepted: int = 0) -> None:
        c = self._ensure()
        if c is None:
            return
        if forced_proposed > 0:
            c["sglang_eagle_overlap:forced_drafts_proposed"].inc(forced_proposed)
        if forced_accepted > 0:
            c["sglang_eagle_overlap:forced_drafts_accepted"].inc(forced_accepted)
        c["sglang_eagle_overlap:grammar_steps"].inc()
        c["sglang_eagle_overlap:grammar_seconds"].inc(grammar_s)
        if unhidden_s > 0:
            c["sglang_eagle_overlap:grammar_unhidden_seconds"].inc(unhidden_s)
        if timeouts:
            c["sglang_eagle_overlap:mask_timeouts"].inc(timeouts)

    def names(self) -> List[str]:
        return list(PROMETHEUS_NAMES)
