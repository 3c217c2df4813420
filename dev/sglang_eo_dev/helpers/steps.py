"""Test helpers around ``GrammarStep`` and ``AcceptLedger``: a step built from flat keyword arguments, one run fed at
a time, and whether a run was fed.

The product builds a step from its parts (``StepConfig``, ``StepTelemetry``, ``integration/runtime.create``); tests
mostly vary one or two knobs, so :func:`make_step` takes every knob of either part by keyword.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Optional, Sequence, Union

from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.ledger import AcceptLedger, FeedOutcome, GrammarLike, LedgerError, MatcherLike, Run
from sglang_eagle_overlap.core.native import NativeGrammar
from sglang_eagle_overlap.core.protocols import ForwardProbe, StatValue, StepExporter
from sglang_eagle_overlap.core.step import CudaDevices, GrammarStep, StepConfig
from sglang_eagle_overlap.core.telemetry import StepTelemetry
from sglang_eagle_overlap.core.timeline import Timeline

__all__ = ["feed_one", "make_step", "was_fed"]


def make_step(
    *,
    mask_threads: Optional[int] = None,
    mask_time_limit_s: Optional[float] = 0.05,
    pin_memory: Optional[bool] = None,
    grammar_thread: bool = False,
    grammar_thread_min_batch: int = 1,
    upload_stream: bool = False,
    probe: Optional[ForwardProbe] = None,
    exporter: Optional[StepExporter] = None,
    timeline: Optional[Timeline] = None,
    stats_file: Optional[str] = None,
    log_interval_s: float = 30.0,
    state: Optional[Callable[[], Mapping[str, StatValue]]] = None,
    forced: Optional[ForcedDrafts] = None,
    native: Optional[Callable[[], Optional[NativeGrammar]]] = None,
    devices: Optional[CudaDevices] = None,
) -> GrammarStep:
    """A ``GrammarStep`` with these ``StepConfig`` and ``StepTelemetry`` fields and parts (defaults: theirs)."""
    config = StepConfig(mask_threads=mask_threads, mask_time_limit_s=mask_time_limit_s, pin_memory=pin_memory,
                        grammar_thread=grammar_thread, grammar_thread_min_batch=grammar_thread_min_batch,
                        upload_stream=upload_stream)
    telemetry = StepTelemetry(probe=probe, exporter=exporter, timeline=timeline, stats_file=stats_file,
                              log_interval_s=log_interval_s, state=state)
    return GrammarStep(config, telemetry=telemetry, forced=forced, native=native, devices=devices)


def feed_one(target: Union[AcceptLedger, GrammarStep], key: Hashable, grammar: Any, start: int,
             tokens: Sequence[int], matcher: Optional[MatcherLike] = None,
             on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None) -> FeedOutcome:
    """Feed one run through ``target``'s ``feed``. A ledger's disagreement is raised (``LedgerGapError`` /
    ``LedgerConflictError``); a step re-anchors instead (``GrammarStep.feed``)."""
    grammar_like: GrammarLike = grammar
    run = Run(key=key, grammar=grammar_like, matcher=matcher, start=start, tokens=tokens)
    result = target.feed([run], on_feed)[0]
    if isinstance(result, LedgerError):
        raise result
    return result


def was_fed(step: GrammarStep, key: Hashable, start: int) -> bool:
    """Whether ``key``'s run at output position ``start`` is in ``step``'s ledger (a later ask is a replay). Goes
    through a ledger entry point first (``prune`` of nothing), which settles a grammar-thread job whose verify
    raised, as every entry point does."""
    step.prune(None)
    return step.ledger.outcome(key, start) is not None
