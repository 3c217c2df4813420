"""The plugin's per-process state: one :class:`Runtime` per SGLang process, created once, passed on as an argument.

SGLang runs one scheduler (and its worker) per process, so a process needs exactly one tree copier, ledger and mask
builder: the :class:`~sglang_eagle_overlap.core.GrammarStep` inside the runtime. Hooks cannot take extra arguments
from SGLang, so they fetch it here, once per call, with :func:`active` (None unless the plugin activated in this
process); a patched SGLang fetches it with :func:`for_patched_sglang`. Everything below a hook or a patch call site
receives the runtime as an argument.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import List, Optional

from sglang_eagle_overlap.core import (ForcedDrafts, GrammarStep, NativeGrammar, NativeUnavailable, StepConfig,
                                       StepTelemetry, load_native, process_timeline)
from sglang_eagle_overlap.integration.band import Band
from sglang_eagle_overlap.settings import Settings, SettingsError

logger = logging.getLogger("sglang_eagle_overlap")

__all__ = ["Runtime", "active", "create", "current", "for_patched_sglang", "installed_xgrammar", "load_native_for",
           "reset"]


@dataclass
class Runtime:
    """``active`` is set only once every hook landed (plugin) or by a patched SGLang; ``band`` is the installed
    SGLang band's :class:`~sglang_eagle_overlap.integration.band.Band` over ``step``, made by the band module at its
    first call in this process (hooks and patched SGLang alike), holding that band's own state."""

    settings: Settings
    step: GrammarStep
    active: bool = False
    band: Optional[Band] = None
    origin: str = "plugin"
    forced_decided: bool = False  # forced drafts on "auto": kept or dropped at the first verify (drafts.before_verify)
    # the largest maxLength a band's JSON-schema hook compiles as a pattern (None: schemas compile as sent)
    max_length_pattern_bound: Optional[int] = None


_process: List[Optional[Runtime]] = [None]
_patched_off: List[bool] = [False]


def create(settings: Settings, origin: str = "plugin") -> Runtime:
    """The process's runtime, created on the first call from ``settings`` (later calls return the same object)."""
    rt = _process[0]
    if rt is not None:
        return rt
    from sglang_eagle_overlap.metrics import ForwardReadyProbe, PrometheusExporter

    holder: List[Runtime] = []
    config = StepConfig(
        mask_threads=settings.mask_threads,
        mask_time_limit_s=settings.mask_time_limit_s,
        grammar_thread=settings.grammar_thread,
        grammar_thread_min_batch=settings.grammar_thread_min_batch,
        upload_stream=settings.mask_upload_stream,
    )
    telemetry = StepTelemetry(
        probe=ForwardReadyProbe(),
        exporter=PrometheusExporter(),  # inert unless SGLang runs with --enable-metrics
        # the process-wide recorder (shared with the dev probes of stock SGLang)
        timeline=process_timeline(settings.timeline_file),
        stats_file=settings.stats_file,
        log_interval_s=settings.log_interval_s,
        state=lambda: {"active": bool(holder and holder[0].active), "origin": origin},
    )
    step = GrammarStep(
        config,
        telemetry=telemetry,
        # auto (None): created, then kept or dropped at the first verify, by its algorithm (drafts.before_verify)
        forced=(ForcedDrafts(require_admission=True, bonus_keys=settings.forced_bonus_keys,
                             draft_tail=settings.forced_tail)
                if settings.forced_drafts is not False else None),
        native=None if settings.native is False else functools.partial(load_native_for, settings.native),
    )
    rt = Runtime(settings=settings, step=step, origin=origin,
                 max_length_pattern_bound=settings.max_length_pattern_bound(installed_xgrammar()))
    holder.append(rt)
    _process[0] = rt
    return rt


def installed_xgrammar() -> Optional[str]:
    """The installed xgrammar distribution's version (None: not installed), from its metadata (not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xgrammar")
    except PackageNotFoundError:
        return None


def load_native_for(required: Optional[bool]) -> Optional[NativeGrammar]:
    """The native module for this process (``Settings.native``: None = auto, True = required). Auto: a module that
    cannot be built or loaded is a WARNING and the grammar work stays in Python (same results, slower steps);
    required: it is an error that names the cause."""
    try:
        native = load_native()
    except NativeUnavailable as exc:
        if required:
            raise RuntimeError(f"sglang-eagle-overlap: SGLANG_EAGLE_OVERLAP_NATIVE=1 but the native module is "
                               f"unavailable: {exc}") from exc
        logger.warning("sglang-eagle-overlap: native batch calls unavailable, the grammar work stays in Python: %s",
                       exc)
        return None
    logger.info("sglang-eagle-overlap: native batch calls loaded from %s", native.path)
    return native


def current() -> Optional[Runtime]:
    """The process's runtime, active or not (None before the plugin or a patched SGLang created it)."""
    return _process[0]


def active() -> Optional[Runtime]:
    """The process's runtime if the product is switched on in this process, else None (hooks pass through)."""
    rt = _process[0]
    return rt if rt is not None and rt.active else None


def for_patched_sglang() -> Optional[Runtime]:
    """A patched SGLang's runtime: created from the environment on first use and active at once (a patched SGLang
    has no hooks whose landing must be checked first). None -- SGLang's own path at every call site -- when
    ``SGLANG_EAGLE_OVERLAP=0`` or a switch is malformed (logged once at ERROR, naming the variable)."""
    rt = _process[0]
    if rt is not None:
        return rt if rt.active else None
    if _patched_off[0]:
        return None
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        logger.error("sglang-eagle-overlap: %s; the patched SGLang keeps its own grammar path", exc)
        settings = None
    if settings is None or not settings.enabled:
        _patched_off[0] = True
        return None
    rt = create(settings, origin="patched-sglang")
    rt.active = True
    return rt


def reset() -> None:
    """Forget the process's runtime (tests only; a process never needs it)."""
    _process[0] = None
    _patched_off[0] = False
