"""Glue shared by the SGLang adapters: hook bookkeeping, the per-process plugin state, request -> core mapping.

Nothing here is imported by SGLang at import time; SGLang objects are only touched through duck typing, so this
module itself imports no SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

from sglang_eagle_overlap.core import (
    AcceptLedger,
    AdvanceOutcome,
    HostTreeCopier,
    LedgerConflictError,
    LedgerGapError,
    MaskRequest,
    PendingTree,
    TreeMask,
    TreeMaskBuilder,
    neutralize_timed_out_drafts,
)
from sglang_eagle_overlap.core.timeline import timeline
from sglang_eagle_overlap.metrics import ForwardReadyProbe, PrometheusExporter

__all__ = [
    "BandAdapter",
    "abort_mask_failed",
    "abort_rejected",
    "advance",
    "advance_or_abort",
    "mask_step",
    "prune_ledger",
    "report",
    "Hook",
    "PluginState",
    "STATE",
    "importable_callers",
    "mark_verify_launch",
    "mask_request_for",
    "register_hooks",
    "resolve_attr",
    "verify_hooks",
]

logger = logging.getLogger("sglang_eagle_overlap")


@dataclass(frozen=True)
class Hook:
    """One hooked SGLang target.

    ``callers`` are ``(module, attribute)`` pairs that must see the patched object after ``apply_hooks()`` (modules
    that did ``from X import name``), checked by :func:`verify_hooks`.
    """

    target: str
    hook_type: str  # "AROUND" | "AFTER" | "BEFORE" | "REPLACE"
    fn: Callable[..., Any]
    callers: Tuple[Tuple[str, str], ...] = ()
    why: str = ""


def resolve_attr(path: str) -> Any:
    import pkgutil

    obj_path, attr = path.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    if isinstance(obj, type) and attr in obj.__dict__:
        raw = obj.__dict__[attr]
        if isinstance(raw, (classmethod, staticmethod)):
            return raw.__func__
    return getattr(obj, attr)


def _contains_hook(obj: Any, fn: Callable[..., Any]) -> bool:
    """True if ``obj`` is ``fn`` or a HookRegistry wrapper chain that calls ``fn``."""
    seen = 0
    while obj is not None and seen < 32:
        if obj is fn:
            return True
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is fn:
                    return True
            except ValueError:
                continue
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return False


def register_hooks(registry: Any, hooks: Sequence[Hook]) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    for h in hooks:
        registry.register(h.target, h.fn, getattr(HookType, h.hook_type))


def verify_hooks(hooks: Sequence[Hook]) -> List[str]:
    """Return a description of every hook that did not land (target or a caller binding)."""
    import importlib

    missing: List[str] = []
    for h in hooks:
        try:
            current = resolve_attr(h.target)
        except Exception as exc:  # target renamed or removed
            missing.append(f"{h.target} ({type(exc).__name__}: {exc})")
            continue
        if not _contains_hook(current, h.fn):
            missing.append(f"{h.target} (not patched)")
            continue
        for mod_name, attr in h.callers:
            try:
                bound = getattr(importlib.import_module(mod_name), attr)
            except Exception as exc:
                missing.append(f"{mod_name}.{attr} ({type(exc).__name__}: {exc})")
                continue
            if not _contains_hook(bound, h.fn):
                missing.append(f"{mod_name}.{attr} (stale binding, still SGLang's own {h.target})")
    return missing


COUNTERS = (
    "aborts",  # requests aborted because the grammar rejected a committed token
    "ledger_resets",  # ledger re-anchored at SGLang's position (gap / conflict)
    "ledger_forgets",  # entries dropped by prune_ledger
    "overlap_kept",  # 0.5.16: grammar decode batches whose forced sync the plugin dropped
    "fallback_steps",  # 0.5.16: grammar verify steps left to upstream (non-xgrammar backend)
    "barrier_runs",  # 0.5.16: (batch, result) pairs advanced before sampling
    "replays",  # 0.5.16: post-processing asks answered from the ledger
    "mask_failures",  # requests aborted because their grammar raised during the tree mask build
)


@dataclass
class StepStats:
    """Operator-facing numbers of the plugin's grammar work (per process).

    ``grammar_s`` is what one verify step spends on the CPU between the verify launch and the mask upload: ledger
    advance (barrier) + tree-copy wait + mask build (+ upload). ``unhidden_s`` is the part of it after the verify
    forward was ready, i.e. what sampling waited for (estimated by
    :class:`~sglang_eagle_overlap.metrics.ForwardReadyProbe`; on CPU all of ``grammar_s``). ``counters`` holds the
    adapters' event counts.
    """

    steps: int = 0
    unhidden_s: float = 0.0
    advance_s: float = 0.0
    tree_wait_s: float = 0.0
    mask_s: float = 0.0
    mask_timeouts: int = 0
    last: Dict[str, float] = field(default_factory=dict)
    # Every counter is present (0) from the start, so readers never see a missing key.
    counters: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def count(self, name: str, k: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + k

    def record_step(self, advance_s: float, tree_wait_s: float, mask_s: float, timeouts: int, bs: int,
                    unhidden_s: float = 0.0) -> None:
        """One plugin-owned verify step. ``unhidden_s`` may belong to earlier steps (CUDA events are read lazily)."""
        self.steps += 1
        self.advance_s += advance_s
        self.tree_wait_s += tree_wait_s
        self.mask_s += mask_s
        self.unhidden_s += unhidden_s
        self.mask_timeouts += timeouts
        self.last = {"advance_s": advance_s, "tree_wait_s": tree_wait_s, "mask_s": mask_s, "bs": float(bs),
                     "unhidden_s": unhidden_s}

    @property
    def grammar_s(self) -> float:
        return self.advance_s + self.tree_wait_s + self.mask_s

    def per_step_ms(self) -> Dict[str, float]:
        """Mean per step, in ms, of the operator numbers (0 before the first step)."""
        n = max(self.steps, 1)
        return {
            "grammar_ms": self.grammar_s / n * 1e3,
            "unhidden_ms": self.unhidden_s / n * 1e3,
            "advance_ms": self.advance_s / n * 1e3,
            "tree_wait_ms": self.tree_wait_s / n * 1e3,
            "mask_ms": self.mask_s / n * 1e3,
        }


STATS_FILE_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
LOG_INTERVAL_ENV = "SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S"


def _log_interval_s() -> float:
    try:
        return float(os.environ.get(LOG_INTERVAL_ENV, "30"))
    except ValueError:
        return 30.0


class PluginState:
    """Per-process state: one scheduler / one worker per process in SGLang, so one of each object.

    The switches are read once, when the process's state is created (SGLang's scheduler imports the plugin at start).
    """

    def __init__(self) -> None:
        self.active = False
        self.stats_path = os.environ.get(STATS_FILE_ENV) or None
        self.log_interval_s = _log_interval_s()
        self.copier = HostTreeCopier()
        self.ledger = AcceptLedger()
        limit_ms = float(os.environ.get("SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS", "50"))
        self._builder: Optional[TreeMaskBuilder] = None
        self._limit_s = None if limit_ms <= 0 else limit_ms / 1e3
        self.stats = StepStats()
        self.probe = ForwardReadyProbe()  # forward-ready estimate for the un-hidden part (operator metric)
        self.prometheus = PrometheusExporter()  # inert unless SGLang runs with --enable-metrics
        self.upload_event: Any = None  # fence: the builder's host buffer is reused by the next build

    @property
    def builder(self) -> TreeMaskBuilder:
        if self._builder is None:
            import torch

            pin = bool(torch.cuda.is_available())
            self._builder = TreeMaskBuilder(time_limit_s=self._limit_s, pin_memory=pin)
        return self._builder

    def snapshot(self) -> Dict[str, Any]:
        s = self.stats
        d: Dict[str, Any] = {
            "steps": s.steps,
            "grammar_s": s.grammar_s,
            "unhidden_s": s.unhidden_s,
            "advance_s": s.advance_s,
            "tree_wait_s": s.tree_wait_s,
            "mask_s": s.mask_s,
            "mask_timeouts": s.mask_timeouts,
            "tokens_advanced": self.ledger.tokens_fed,
            "ledger_requests": len(self.ledger),
            "pinned_allocations": self.copier.pinned_allocations,
            "active": self.active,
            "pid": os.getpid(),
        }
        d.update(s.counters)
        return d


STATE = PluginState()


def mask_request_for(req: Any) -> MaskRequest:
    """Map an SGLang ``Req`` to the core's mask input.

    * no grammar, or a request that already finished (SG#28986: a finished request must not be masked again) ->
      unconstrained, costs nothing;
    * SGLang's ``XGrammarGrammar`` (exact class, not a wrapper such as the reasoning wrapper) -> native matcher;
    * anything else (llguidance, outlines, reasoning wrapper) -> the generic walk through the grammar object API.
    """
    grammar = getattr(req, "grammar", None)
    rid = str(getattr(req, "rid", ""))
    if grammar is None:
        return MaskRequest(request_id=rid)
    finished = getattr(req, "finished", None)
    if callable(finished) and finished():
        return MaskRequest(request_id=rid)
    if type(grammar).__name__ == "XGrammarGrammar" and hasattr(grammar, "matcher"):
        return MaskRequest(matcher=grammar.matcher, request_id=rid)
    return MaskRequest(grammar=grammar, request_id=rid)


def importable_callers(hooks: Tuple[Hook, ...]) -> Tuple[Hook, ...]:
    """Drop caller modules that cannot be imported in this process (e.g. CUDA-only kernels on a CPU host).

    A module that cannot be imported cannot call the target; one imported later does ``from X import Y`` against the
    already patched ``X`` and so gets the hook. Only an imported module with a stale binding is a miss.
    """
    import dataclasses
    import importlib

    out = []
    for h in hooks:
        keep = []
        for mod_name, attr in h.callers:
            try:
                importlib.import_module(mod_name)
            except Exception as exc:  # ImportError, or a kernel registration failing on this host
                logger.debug("sglang-eagle-overlap: caller %s not importable here (%s); not checked", mod_name, exc)
                continue
            keep.append((mod_name, attr))
        out.append(dataclasses.replace(h, callers=tuple(keep)))
    return tuple(out)


class BandAdapter:
    """The adapter contract (see ``adapters/__init__.py``) shared by every SGLang band; a band sets name + hooks."""

    name: str = ""
    hooks: Tuple[Hook, ...] = ()

    def register(self, registry: Any) -> None:
        register_hooks(registry, self.hooks)

    def verify(self) -> List[str]:
        return verify_hooks(importable_callers(self.hooks))

    def activate(self) -> None:
        STATE.active = True

    def deactivate(self) -> None:
        """For tests: back to pass-through."""
        STATE.active = False


# -- what every band does inside one verify step -------------------------------------------------------------------
def advance(req: Any, start: int, tokens: Sequence[int]) -> AdvanceOutcome:
    """Feed ``tokens`` (committed at output position ``start``) to ``req.grammar`` exactly once, via the ledger.

    If the ledger and SGLang disagree about the position (gap or conflict: the host rolled or rebuilt the matcher
    behind the ledger's back), the entry is re-anchored at SGLang's position and a warning is logged, instead of
    raising into the scheduler loop.
    """
    ledger = STATE.ledger
    rid = str(req.rid)
    try:
        return ledger.advance(rid, req.grammar, start, tokens)
    except (LedgerGapError, LedgerConflictError) as exc:
        logger.warning("sglang-eagle-overlap: re-anchoring grammar ledger of request %s at position %d: %s",
                       rid, start, exc)
        STATE.stats.count("ledger_resets")
        ledger.reset(rid, start)
        return ledger.advance(rid, req.grammar, start, tokens)


def _finish_with_error(req: Any, message: str) -> bool:
    """Finish ``req`` alone with ``message`` (HTTP 500 for that request); False if it was already being finished (its
    first, clearer reason is kept)."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if getattr(req, "to_finish", None) is not None:
        return False
    req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    return True


def abort_rejected(req: Any, tokens: Sequence[int], error: str) -> None:
    """Finish ``req`` with a clear error for that request alone: the grammar rejected a token the model committed."""
    if _finish_with_error(req, f"Grammar accept_token failed: request {req.rid}: {error}"):
        logger.error("Grammar accept_token failed for req %s with tokens %s: %s", req.rid, list(tokens), error)
        STATE.stats.count("aborts")


def advance_or_abort(req: Any, start: int, tokens: Sequence[int]) -> AdvanceOutcome:
    """:func:`advance`, then abort ``req`` alone if its grammar rejected one of ``tokens`` (post-processing's ask)."""
    outcome = advance(req, start, tokens)
    if outcome.error is not None:
        abort_rejected(req, tokens, outcome.error)
    return outcome


def abort_mask_failed(req: Any, error: str) -> None:
    """Finish ``req`` with a clear error for that request alone: its grammar raised during the tree mask build."""
    logger.error("sglang-eagle-overlap: aborting request %s: its grammar failed during the tree mask build: %s",
                 req.rid, error)
    STATE.stats.count("mask_failures")
    _finish_with_error(req, f"Grammar mask build failed: request {req.rid}: {error}")


def prune_ledger(live: Collection[str], finished: Sequence[str] = ()) -> None:
    """Keep the ledger bounded: drop finished requests, and all not ``live`` once it outgrows the batch."""
    ledger = STATE.ledger
    for rid in finished:
        ledger.forget(rid)
    if len(ledger) > max(64, 4 * len(live)):
        STATE.stats.count("ledger_forgets", ledger.retain(live))


def mark_verify_launch(device: Any = None) -> None:
    """Call where the verify tree's host copy starts, just before the target-verify launch (timeline + probe)."""
    STATE.probe.on_launch(device)
    timeline().point("tree_copy")


def mask_step(
    *,
    reqs: Sequence[Any],
    tree: PendingTree,
    vocab_size: int,
    device: Any,
    barrier: Optional[Callable[[], Any]],
    draft_device: Any,
) -> Tuple[Any, TreeMask]:
    """The plugin's grammar work of one verify step. Call after the target-verify launch, before sampling.

    Order: ``barrier()`` (the previous batch's accepted tokens into the matchers, via the ledger) -> wait for the
    verify tree's host copy -> wait until the previous step's upload left the reused host buffer -> build the tree
    mask -> non-blocking upload (fenced by an event) -> neutralise the drafts of requests whose build timed out.
    ``draft_device`` is the device draft-token tensor the sampler will read; None means the caller cannot neutralise,
    so the build runs without a time limit. Returns ``(device mask or None, TreeMask)``.

    On a CPU device the returned mask aliases the builder's buffer: it is consumed by this step's sampling, before
    the next build.
    """
    t0 = time.perf_counter()
    STATE.probe.on_mask_start(device, t0)
    if barrier is not None:
        barrier()
    t1 = time.perf_counter()
    nxt, sib, draft = tree.resolve()
    t2 = time.perf_counter()
    if STATE.upload_event is not None:
        STATE.upload_event.synchronize()  # normally long done
        STATE.upload_event = None
    bs, n = nxt.shape[0], nxt.shape[-1]
    result = STATE.builder.build(
        [mask_request_for(r) for r in reqs], nxt.reshape(bs, n), sib.reshape(bs, n), draft.reshape(bs, n),
        vocab_size, allow_timeout=draft_device is not None,
    )
    t_built = time.perf_counter()
    device_mask = None
    if result.bitmask is not None:
        device_mask = result.bitmask.to(device, non_blocking=True)
        if device_mask.device.type != "cpu":
            import torch

            STATE.upload_event = torch.get_device_module(device_mask.device).Event()
            STATE.upload_event.record()
    # Timed-out requests and failed ones (aborted alone below) must not accept unmasked drafts in this step.
    unmasked = result.timed_out + [i for i, _ in result.failed]
    if unmasked and draft_device is not None:
        neutralize_timed_out_drafts(draft_device, unmasked, n)
    for i, error in result.failed:
        abort_mask_failed(reqs[i], error)
    t3 = time.perf_counter()
    unhidden = STATE.probe.on_mask_ready(t3)
    STATE.stats.record_step(t1 - t0, t2 - t1, t3 - t2, len(result.timed_out), bs, unhidden)
    STATE.prometheus.observe_step(t3 - t0, unhidden, len(result.timed_out))
    tl = timeline()
    if tl.enabled:
        tl.span("advance", t0, t1, bs)
        tl.span("tree_wait", t1, t2, bs)
        tl.span("mask_build", t2, t_built, bs)
        tl.span("mask_upload", t_built, t3, bs)
        tl.point("sample", t3, bs)
    report()
    return device_mask, result


_last_log = [0.0]


def report() -> None:
    """An INFO line on the first step and then every ``SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S`` (30) seconds; the JSON
    stats file every step when ``SGLANG_EAGLE_OVERLAP_STATS_FILE`` is set (tests, debugging).

    The line's operator numbers (means per grammar verify step since start): ``grammar`` ms (advance + tree wait +
    mask), ``not hidden`` ms (part of it after the verify forward was ready), and the mask time-limit hits."""
    s = STATE.stats
    now = time.monotonic()
    if s.steps == 1 or now - _last_log[0] >= STATE.log_interval_s:
        _last_log[0] = now
        m = s.per_step_ms()
        logger.info(
            "sglang-eagle-overlap: %d grammar verify steps; per step: grammar %.3f ms (advance %.3f, tree wait %.3f, "
            "mask %.3f), not hidden by the forward %.3f ms; %d mask time-limit hits; ledger %d requests; %s",
            s.steps, m["grammar_ms"], m["advance_ms"], m["tree_wait_ms"], m["mask_ms"], m["unhidden_ms"],
            s.mask_timeouts, len(STATE.ledger), s.counters,
        )
    write_stats()


def write_stats() -> None:
    """Write :meth:`PluginState.snapshot` to ``SGLANG_EAGLE_OVERLAP_STATS_FILE`` when it is set (best effort)."""
    path = STATE.stats_path
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(STATE.snapshot(), f)
            os.replace(tmp, path)
        except OSError as exc:  # stats are best effort, never fail a step for them
            logger.debug("sglang-eagle-overlap: cannot write stats file %s: %s", path, exc)
