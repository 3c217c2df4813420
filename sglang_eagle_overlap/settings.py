"""The plugin's switches, read once per process from the environment into one immutable :class:`Settings`.

Every switch is parsed here and nowhere else; a malformed value is an error that names the variable, the value and
what is expected (the plugin then refuses to load, loudly), never a silent default.

| variable | meaning | default |
|---|---|---|
| ``SGLANG_EAGLE_OVERLAP`` | ``0`` / ``false`` / ``no`` / ``off`` turns the plugin off without uninstalling it | on |
| ``SGLANG_EAGLE_OVERLAP_MASK_THREADS`` | C++ threads for the tree-mask fills | 1 on <= 2 cores, else half the cores, <= 8 |
| ``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS`` | per-step mask time limit (``0`` = none) | 50 |
| ``SGLANG_EAGLE_OVERLAP_STATS_FILE`` | JSON stats file rewritten every verify step (tests, debugging) | none |
| ``SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S`` | seconds between the INFO summary lines | 30 |
| ``SGLANG_EAGLE_OVERLAP_TIMELINE_FILE`` | per-phase timeline JSON (benchmarks) | none |
| ``SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD`` | ``1``: the step's native call (the previous batch's runs fed, the tree mask \
walked) runs on a grammar thread started before the target-verify launch, joined before sampling; ``0``: inline on the \
scheduler thread after the launch | 1 |
| ``SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH`` | with the grammar thread on, a verify batch of fewer grammar requests than this runs its grammar work inline (a hand-off costs more than one request's native call) | 2 |
| ``SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM`` | ``1``: on a GPU the tree mask's host-to-device copy runs on a stream of its own, while the target verify still runs, and sampling waits for it; ``0``: on the verify's stream, after the verify | 1 |
| ``SGLANG_EAGLE_OVERLAP_NATIVE`` | ``1``: the batch's xgrammar calls (tree walk, ledger feed) go through the plugin's native module, built on first use with the system C++ compiler; a failed build is an error; ``0``: Python only; unset: ``auto``, native when it builds (a warning otherwise) | auto |
| ``SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS`` | ``1``: the grammar's forced continuation after the accepted node replaces the next step's top-path drafts (issue 19); ``0``: drafts are the draft model's only; unset: ``auto``, on for STANDALONE only | auto |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Type, Union

__all__ = ["DEFAULT_FORCED_DRAFTS", "DEFAULT_GRAMMAR_THREAD", "DEFAULT_GRAMMAR_THREAD_MIN_BATCH",
           "DEFAULT_MASK_UPLOAD_STREAM", "ENV", "FORCED_DRAFTS_AUTO_ALGORITHMS", "Settings", "SettingsError",
           "default_mask_threads"]

ENV = {
    "enabled": "SGLANG_EAGLE_OVERLAP",
    "mask_threads": "SGLANG_EAGLE_OVERLAP_MASK_THREADS",
    "mask_time_limit_ms": "SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS",
    "stats_file": "SGLANG_EAGLE_OVERLAP_STATS_FILE",
    "log_interval_s": "SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S",
    "timeline_file": "SGLANG_EAGLE_OVERLAP_TIMELINE_FILE",
    "grammar_thread": "SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD",
    "grammar_thread_min_batch": "SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH",
    "mask_upload_stream": "SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM",
    "forced_drafts": "SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS",
    "native": "SGLANG_EAGLE_OVERLAP_NATIVE",
}
# Grammar-forced drafts (issue 19): ``None`` is "auto", on where the draft model does not know the output's structure
# (STANDALONE: a generic small model drafts) and off for drafts trained on the target's outputs (EAGLE, EAGLE3, NEXTN).
# Measured on the real pair (benchmarks/bench_real_pair.py, README "Grammar-forced drafts"): verify steps per output
# token -13.3 % with the untrained STANDALONE draft, +0.0 % with the trained EAGLE3 draft (it already proposes 41 of
# 45 forced tokens); recording the continuations is ~20 % of the scheduler thread's grammar time per step at bs 64
# (0.4-0.5 ms on the project's CPU host, BENCH_SCHEMA, README "Scheduler-thread budget").
FORCED_DRAFTS_AUTO_ALGORITHMS = frozenset({"STANDALONE"})
DEFAULT_FORCED_DRAFTS: Optional[bool] = None
# The grammar thread is on unless switched off (issue 17). It takes only the step's one native call (the previous
# batch's runs fed and the tree walked, GIL-free, started before the verify launch); the scheduler thread keeps the
# Python (the ledger's checks before the launch, the records after the join). Measured on the project's CPU host, side
# by side in one run (README "Scheduler-thread budget"): the scheduler thread's extra time per constrained step at
# bs 64 fell to 0.28-0.33x of ce5faff's, against 0.46-0.52x inline. The thread design the H200 measured slower than
# inline (README "GPU benchmark": +4.4-24.5 % against +0.2-3.7 % over unconstrained) ran the barrier's and the walk's
# Python on the helper, which then waited for the GIL after each native call (benchmarks/bench_gil_convoy.py); this
# one crosses into Python twice per step. On the H200 (2026-11-26, README "GPU benchmark", one run with the inline path
# in its own engine) it was +1.7 % to +4.0 % over unconstrained at the median step at bs 8-64, as inline was (+1.5 % to
# +8.9 %), and worse than inline at bs 1: +9.3 % / +20.3 % (topk 1 / topk 4) against +4.1 % / +3.6 %.
DEFAULT_GRAMMAR_THREAD = True
# Hence the smallest verify batch (grammar requests) whose native call goes to the grammar thread: a batch of one runs
# inline. At bs 1 the call is ~0.1-0.3 ms of GIL-free work and hides under the GPU's step either way, while the thread
# path costs 0.35-1.2 ms more there (the H200 did not separate its causes: the work it runs before the verify launch,
# exposed when the draft is short, or the hand-off's GIL round trips). Chosen from that one run (one round per cell);
# bs 2-8 was not separated from noise there.
DEFAULT_GRAMMAR_THREAD_MIN_BATCH = 2
# The tree mask's upload on a side stream (2026-11-27, 15th session). On the verify's stream the copy waits for the
# target verify launched there and the sampling waits for the copy: serial GPU work after the verify, the kind the step
# model names for the H200's residual (+0.6 % to +3.1 % over unconstrained, README "GPU benchmark"). The mask is
# 4-8 MB at bs 64 (bs x tree nodes rows of 128k-vocab bitmasks). NOT YET MEASURED ON A GPU: the next GPU run's table
# says what it saves (prediction: up to a few tenths of a ms at bs 64, nothing on the CPU, where there is no upload).
DEFAULT_MASK_UPLOAD_STREAM = True
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def default_mask_threads(cores: Optional[int] = None) -> int:
    """Fill threads when none are asked for: 1 on <= 2 cores (measured in ``benchmarks/results/grammar_step.md``: the
    second fill thread competes with the scheduler and loses under load), else half the cores, at most 8."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return 1 if cores <= 2 else min(8, cores // 2)


class SettingsError(ValueError):
    """A switch has a value the plugin cannot use; the message names the variable and what it expects."""


@dataclass(frozen=True, slots=True)
class Settings:
    enabled: bool = True
    mask_threads: int = 1
    mask_time_limit_s: Optional[float] = 0.05
    stats_file: Optional[str] = None
    log_interval_s: float = 30.0
    timeline_file: Optional[str] = None
    grammar_thread: bool = DEFAULT_GRAMMAR_THREAD
    grammar_thread_min_batch: int = DEFAULT_GRAMMAR_THREAD_MIN_BATCH
    mask_upload_stream: bool = DEFAULT_MASK_UPLOAD_STREAM
    forced_drafts: Optional[bool] = DEFAULT_FORCED_DRAFTS  # None: auto (see FORCED_DRAFTS_AUTO_ALGORITHMS)
    native: Optional[bool] = None  # None: auto (native when it builds), True: required, False: Python only

    def forced_drafts_for(self, algorithm: str) -> bool:
        """Whether grammar-forced drafts run for speculative ``algorithm`` (its SGLang name, e.g. ``EAGLE3``): the
        switch when set, else on for :data:`FORCED_DRAFTS_AUTO_ALGORITHMS` only."""
        if self.forced_drafts is not None:
            return self.forced_drafts
        return algorithm.upper() in FORCED_DRAFTS_AUTO_ALGORITHMS

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if environ is None else environ

        def get(key: str) -> Optional[str]:
            raw = env.get(ENV[key])
            return None if raw is None else raw.strip()

        def optional_flag(key: str) -> Optional[bool]:
            raw = (get(key) or "").lower()
            if raw not in _OFF + _ON:
                raise SettingsError(f"{ENV[key]}={env.get(ENV[key])!r}: expected 1 / 0 (or on / off)")
            return None if not raw else raw not in _OFF

        def flag(key: str, default: bool) -> bool:
            value = optional_flag(key)
            return default if value is None else value

        enabled = flag("enabled", True)
        threads_raw = get("mask_threads")
        threads = default_mask_threads() if not threads_raw else _number(ENV["mask_threads"], threads_raw, int, 1)
        limit_raw = get("mask_time_limit_ms")
        limit_ms = 50.0 if not limit_raw else _number(ENV["mask_time_limit_ms"], limit_raw, float, 0.0)
        grammar_thread = flag("grammar_thread", DEFAULT_GRAMMAR_THREAD)
        min_batch_raw = get("grammar_thread_min_batch")
        min_batch = (DEFAULT_GRAMMAR_THREAD_MIN_BATCH if not min_batch_raw
                     else _number(ENV["grammar_thread_min_batch"], min_batch_raw, int, 1))
        mask_upload_stream = flag("mask_upload_stream", DEFAULT_MASK_UPLOAD_STREAM)
        forced_drafts = optional_flag("forced_drafts")
        native = optional_flag("native")
        interval_raw = get("log_interval_s")
        interval = 30.0 if not interval_raw else _number(ENV["log_interval_s"], interval_raw, float, 0.0)
        return cls(
            enabled=enabled,
            mask_threads=int(threads),
            mask_time_limit_s=None if limit_ms <= 0 else limit_ms / 1e3,
            stats_file=get("stats_file") or None,
            log_interval_s=float(interval),
            timeline_file=get("timeline_file") or None,
            grammar_thread=grammar_thread,
            grammar_thread_min_batch=int(min_batch),
            mask_upload_stream=mask_upload_stream,
            forced_drafts=forced_drafts,
            native=native,
        )


def _number(name: str, raw: str, kind: Union[Type[int], Type[float]], minimum: float) -> float:
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a {kind.__name__} >= {kind(minimum)}") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: expected a {kind.__name__} >= {kind(minimum)}")
    return value
