"""One grammar-constrained verify step, engine-agnostic: the object every SGLang integration drives.

:class:`GrammarStep` owns the verify tree's host copier, the exactly-once accept ledger and the tree-mask builder; it
is given its :class:`StepConfig` and its parts: the instrumentation (:class:`StepTelemetry`: stats, timeline,
forward-ready probe, Prometheus, stats file), the forced drafts and the native module's loader. One lives in each
worker process; the host integration (hooks or a patched SGLang) only translates its objects into these calls.

Call order of one verify step (the host's scheduler thread)::

    pending = step.copy_tree(next_token, next_sibling, draft)     # 1. before the target-verify launch
    job = step.start_build(requests, pending, vocab_size=..., barrier=..., allow_timeout=...)
        # grammar thread (the default): 2. barrier() here -- the previous batch's runs go through the ledger's checks
        #   and are queued by row (step.feed_later), their tokens unread --; the build is prepared; then 3a. the
        #   step's one native call (those runs fed, the tree walked) starts on the grammar thread
    ... the host launches the target-verify forward ...
    mask = step.finish_build(job, device=..., draft_device=...)
        # grammar thread: the one join; inline (grammar thread off): 2. and 3a. run here, after the launch
        # 3b. (scheduler thread) the feeds recorded in the ledger and the barrier's callers told (feed_later's
        #     on_done), Python walks of what the native call could not take, the mask uploaded non-blocking,
        #     unmasked drafts neutralised
    ... the host samples with mask.device_mask; it aborts mask.failed requests alone ...
    step.replay_whole(...) / step.feed(...)                       # 4. post-processing: replays what 2 fed

``build_mask`` is ``start_build`` + ``finish_build`` in one call, after the launch, always inline (callers that cannot
start before it). With the grammar thread, only 3a -- the device-event waits (the previous result's host copy, the
tree's, the previous upload) and the native call, all GIL-free -- runs on the helper, between ``start_build`` and the
join in ``finish_build``; it reads the build's plan and the tensors, and touches no Python object of the host or the
ledger. The scheduler thread must not feed the batch's matchers or use the ledger in between (in both bands it only
launches the target-verify forward there); every ledger entry point settles an open job first. The join is a
happens-before edge: the scheduler thread records the native call's outcomes after it, so 4 sees the ledger as if 2
had fed inline. A job whose ``finish_build`` never came (the verify raised) is joined and recorded by the next use of
the step (its mask is dropped): every run the barrier queued is fed once and recorded once, whatever happens.

Invariants: a run of accepted tokens reaches ``grammar.accept_token`` exactly once per (request id, output position),
whichever of 2 and 4 asks first; the host bitmask buffer is reused only after the previous upload left it; every
request whose rows are not exact this step (time limit, failed build) has its drafts neutralised before sampling; a
process that is one rank of several (tensor parallelism) builds without the time limit, so that every rank's mask
is the same function of the same grammar states.

Devices: the grammar thread runs each job on the CUDA device that was current on the thread that started it (a new
thread starts on device 0: ``CudaDevices``, ``docs/multi-gpu.md``). A device error met by the job fails the step with
:class:`DeviceFaultError`; only grammar and native failures fall back to the Python rebuild.
"""

from __future__ import annotations

import logging
import time
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.ledger import (AcceptLedger, FeedOutcome, LedgerError, LedgerPlan, ResultRuns, RowRun,
                                              Run)
from sglang_eagle_overlap.core.mask import BuildPlan, MaskRequest, TreeMask, TreeMaskBuilder, neutralize_timed_out_drafts
from sglang_eagle_overlap.core.native import NativeGrammar, StepResult
from sglang_eagle_overlap.core.protocols import DeviceEvent
from sglang_eagle_overlap.core.stats import distributed_rank
from sglang_eagle_overlap.core.telemetry import ForcedCounts, StepState, StepTelemetry
from sglang_eagle_overlap.core.tree_copy import HostTreeCopier, MaskUploader, PendingTree

if TYPE_CHECKING:
    from torch.types import Device

__all__ = ["CudaDevices", "DeviceFaultError", "GrammarStep", "MaskJob", "StepConfig", "StepMask", "Waiting",
           "is_device_fault"]

logger = logging.getLogger("sglang_eagle_overlap")


@dataclass(frozen=True, slots=True)
class StepConfig:
    """How a :class:`GrammarStep` builds masks (``Settings`` has the same fields, documented there).

    ``mask_threads``: the lockstep walk's fill threads (None: 1); ``mask_time_limit_s``: a request's build budget
    (None: no limit); ``pin_memory``: pin the host mask buffer (None: when CUDA is available); ``grammar_thread``:
    run the step's native call on the grammar thread; ``grammar_thread_min_batch``: smaller batches run inline even
    with it on (at least 1); ``upload_stream``: upload the mask on a side stream of its own."""

    mask_threads: Optional[int] = None
    mask_time_limit_s: Optional[float] = 0.05
    pin_memory: Optional[bool] = None
    grammar_thread: bool = False
    grammar_thread_min_batch: int = 1
    upload_stream: bool = False


class Waiting(NamedTuple):
    """A caller of :meth:`GrammarStep.feed_later` inside a build's barrier: its runs' slots in the build's ledger plan
    and the callback that gets their outcomes when the build is joined."""

    slots: List[int]
    on_done: Callable[[List[FeedOutcome]], None]


@dataclass(slots=True)
class StepMask:
    """What :meth:`GrammarStep.build_mask` hands back: the device mask for sampling (None: nothing constrained) and
    the host build's result (``failed`` rows the host must abort alone; ``timed_out`` rows already neutralised)."""

    device_mask: Optional[torch.Tensor]
    tree: TreeMask


@dataclass(slots=True)
class MaskJob:
    """One verify step's grammar work between :meth:`GrammarStep.start_build` and :meth:`GrammarStep.finish_build`.

    ``marks`` are the ``perf_counter`` readings of whichever thread ran the work: start, barrier done, tree resolved,
    mask built (``advance_s`` / ``tree_wait_s`` / ``build_s`` are their differences); ``gil_s`` is that thread's CPU
    time outside GIL-free native fills (grammar thread only; inline it is simply scheduler-thread work). ``submit_s``
    is what ``start_build`` cost the scheduler thread."""

    requests: Sequence[MaskRequest]
    tree: PendingTree
    vocab_size: int
    barrier: Optional[Callable[[], Any]] = None
    allow_timeout: bool = True
    future: Optional[_GrammarThread] = None  # the grammar thread, running this job's part (start_build)
    marks: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    gil_s: float = 0.0
    handoff_s: float = 0.0  # grammar thread: from the hand-off until it ran its first bytecode (its wake-up + GIL)
    submit_s: float = 0.0
    tree_nodes: int = 0
    forced: bool = False  # record grammar-forced continuations (an EAGLE tree whose next step can use them)
    # Set once the barrier ran (grammar thread: in start_build): its runs in the ledger plan, the callers waiting for
    # their outcomes, and the build prepared for them.
    ledger_plan: Optional[LedgerPlan] = None
    waiting: List[Waiting] = field(default_factory=list)
    build: Optional[BuildPlan] = None
    upload_event: Optional[DeviceEvent] = None  # the previous upload the grammar thread waits for
    tree_views: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # the tree copy, links as [bs, n]
    failed_callbacks: int = 0  # waiting callers whose on_done raised (_complete: every one is still called)

    @property
    def advance_s(self) -> float:
        return self.marks[1] - self.marks[0]

    @property
    def tree_wait_s(self) -> float:
        return self.marks[2] - self.marks[1]

    @property
    def build_s(self) -> float:
        return self.marks[3] - self.marks[2]


def _run_of(row: RowRun, result: ResultRuns) -> Run:
    """``row``'s run with its tokens read from ``result`` (waiting for its host copy)."""
    return Run(key=row.key, grammar=row.grammar, matcher=row.matcher, start=row.start, tokens=result.run(row.row))


def _fed(plan: LedgerPlan, slots: Sequence[int]) -> List[FeedOutcome]:
    """The outcomes at ``slots`` of a fed plan (re-anchored by ``GrammarStep._plan``: no ledger error is left)."""
    out: List[FeedOutcome] = []
    for i in slots:
        result = plan.out[i]
        if isinstance(result, LedgerError):
            raise result
        out.append(result)
    return out


class DeviceFaultError(RuntimeError):
    """The device failed under the step's grammar work (a CUDA error met by the grammar thread's event waits): the
    step fails here instead of rebuilding its masks in Python. A device fault lasts (a device-side assert poisons the
    CUDA context), so falling back would only turn it into a slow server logging warnings."""


# Exception types and message parts that mean the device, not the grammar, failed. Messages count because the CUDA
# runtime's errors reach Python as plain RuntimeError from many call sites (event waits among them).
_DEVICE_ERROR_TYPES = tuple(t for t in (getattr(torch, "AcceleratorError", None),
                                        getattr(torch.cuda, "CudaError", None),
                                        getattr(torch.cuda, "OutOfMemoryError", None)) if isinstance(t, type))
_DEVICE_ERROR_TEXT = ("CUDA", "cuda runtime", "device-side assert", "AcceleratorError", "cudaError", "HIP error")


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a device error rather than a grammar failure."""
    seen: Optional[BaseException] = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            return False
        if isinstance(seen, _DEVICE_ERROR_TYPES) or isinstance(seen, DeviceFaultError):
            return True
        if isinstance(seen, RuntimeError) and any(part in str(seen) for part in _DEVICE_ERROR_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _raise_if_device_fault(exc: Exception) -> None:
    """Raise :class:`DeviceFaultError` from ``exc`` when it is a device error (:func:`is_device_fault`)."""
    if isinstance(exc, DeviceFaultError):
        raise exc
    if is_device_fault(exc):
        raise DeviceFaultError(
            f"sglang-eagle-overlap: the device failed during the grammar step ({type(exc).__name__}: {exc}); the step "
            "fails instead of rebuilding its masks in Python, which would hide a lasting device fault. Check the GPU "
            "(CUDA_LAUNCH_BLOCKING=1 locates the failing kernel)") from exc


class CudaDevices:
    """The current CUDA device of the calling thread, read and set through ``torch.cuda``. ``current`` is None while
    CUDA is not initialised in this process (a CPU run never initialises it, and then nothing is set). A new thread's
    current device is 0 whatever its parent's is (pytorch#58626), so the grammar thread sets the scheduler thread's
    device before its first CUDA call; otherwise a rank on GPU k opens a CUDA context on GPU 0. Tests pass a stand-in
    with the same two methods."""

    def current(self) -> Optional[int]:
        initialized = bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
        return int(torch.cuda.current_device()) if initialized else None

    def set(self, index: int) -> None:
        torch.cuda.set_device(index)


class _GrammarThread:
    """The grammar thread: one daemon thread that runs one handed-off job at a time. A hand-off is a lock release and
    the join a lock acquire (no executor, future or queue, nothing allocated per job): the thread's own Python around
    a job is a few bytecodes, so it takes the GIL from the scheduler thread only while its job is outside a GIL-free
    call. :meth:`result` must be called once per :meth:`submit`, before the next one (``GrammarStep`` joins or settles
    a job before it starts another).

    Each job carries the CUDA device of the thread that submitted it (None: CUDA not in use); the thread makes it its
    current device before running the job, so its event waits and anything they initialise stay on that device."""

    def __init__(self, devices: Optional[CudaDevices] = None) -> None:
        self._devices = devices if devices is not None else CudaDevices()
        self._device: Optional[int] = None  # the job's device
        self._bound: Optional[int] = None  # the device this thread last made current
        self._ready = threading.Lock()
        self._ready.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._fn: Optional[Callable[..., Any]] = None
        self._args: Tuple[Any, ...] = ()
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.cpu_s = 0.0  # the thread's CPU time for the last job
        # ``perf_counter`` at the last hand-off and when the thread then ran its first bytecode: the difference is the
        # hand-off's latency (the OS wake-up and winning the GIL from a scheduler thread that may be running Python)
        self.submitted = 0.0
        self.woke = 0.0
        self._thread = threading.Thread(target=self._loop, name="sglang-eo-grammar", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, device: Optional[int] = None) -> _GrammarThread:
        """Start ``fn(*args)`` on the thread, ``device`` (a CUDA device index, None: CUDA not in use) made its current
        device first; returns this thread, whose :meth:`result` joins it."""
        self._fn, self._args, self._device = fn, args, device
        self.submitted = time.perf_counter()
        self._ready.release()
        return self

    def result(self) -> Any:
        """Wait for the job (the GIL is released while waiting) and return its value or raise its exception."""
        self._done.acquire()
        value, error, self._value, self._error, self._args = self._value, self._error, None, None, ()
        if error is not None:
            raise error
        return value

    def stop(self) -> None:
        """End the thread (tests; a worker process simply exits). No job may be running."""
        self._fn = None
        self._ready.release()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self._ready.acquire()
            self.woke = time.perf_counter()
            fn = self._fn
            if fn is None:
                return
            c0 = time.thread_time()
            try:
                device = self._device
                if device is not None and device != self._bound:
                    self._devices.set(device)
                    self._bound = device
                self._value = fn(*self._args)
            except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
                self._error = exc
            finally:
                self.cpu_s = time.thread_time() - c0
                self._done.release()


def _rows(nxt: torch.Tensor, sib: torch.Tensor, draft: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify tree's host tensors with the links as ``[bs, n]`` (``bs``, ``n``: the next-token tensor's first and
    last dimension): as they are when both links are 2-D already (no torch call per step; the draft tokens keep their
    shape, flat ``[bs * n]`` or ``[bs, n]``, which the builder and the native call both take), else as reshaped views
    (the draft tokens too)."""
    if nxt.dim() == 2 and sib.dim() == 2:
        return nxt, sib, draft
    bs, n = nxt.shape[0], nxt.shape[-1]
    return nxt.reshape(bs, n), sib.reshape(bs, n), draft.reshape(bs, n)


def _native_job(results: Sequence[ResultRuns], tree: PendingTree, upload_event: Optional[DeviceEvent],
                call: Callable[[], Any]) -> Tuple[Any, float, float, float]:
    """The grammar thread's part of a step (``GrammarStep.start_build``): GIL-free device-event waits for the previous
    results' host copies, the verify tree's and the previous upload, then the one native call (GIL-free). Touches no
    Python object of the host, the ledger or the build (the scheduler thread holds them) and reads nothing of the
    result: the scheduler thread reads it after the join. Returns the raw result, when the waits ended and when the
    call did, and this thread's CPU time in the call (the rest of its CPU time, ``_GrammarThread.cpu_s`` minus this,
    is what it can have taken from the GIL)."""
    for result in results:
        result.wait()
    tree.resolve()
    if upload_event is not None:
        upload_event.synchronize()
    t2 = time.perf_counter()
    c1 = time.thread_time()
    raw = call()
    c2 = time.thread_time()
    return raw, t2, time.perf_counter(), c2 - c1


class GrammarStep:
    """Copier + ledger + mask builder of one worker process, instrumented by its :class:`StepTelemetry` (see the
    module docstring). ``config`` says how masks are built; the parts it is given: ``telemetry`` (None: a bare one),
    ``forced`` (grammar-forced drafts, None: off), ``native`` (a loader of the native batch calls, called at the first
    mask build; None: Python only) and ``devices`` (the calling thread's CUDA device; tests: a stand-in)."""

    def __init__(
        self,
        config: Optional[StepConfig] = None,
        *,
        telemetry: Optional[StepTelemetry] = None,
        forced: Optional[ForcedDrafts] = None,
        native: Optional[Callable[[], Optional[NativeGrammar]]] = None,
        devices: Optional[CudaDevices] = None,
    ) -> None:
        self.config = config if config is not None else StepConfig()
        self.telemetry = telemetry if telemetry is not None else StepTelemetry()
        self.telemetry.attach(self._state)
        self.copier = HostTreeCopier()
        self.ledger = AcceptLedger()
        self._builder: Optional[TreeMaskBuilder] = None
        self._time_limit_ok: Optional[bool] = None  # see _may_time_out
        # the mask's upload and its fence (the builder's host buffer is reused by the next build); with
        # ``upload_stream`` on a side stream of its own, off the verify's stream (MaskUploader)
        self.uploader = MaskUploader(side_stream=self.config.upload_stream)
        # The grammar thread (takes the step's native call off the scheduler thread): one worker, jobs in submission
        # order, created on the first job.
        self._thread: Optional[_GrammarThread] = None
        # Grammar-forced drafts (fewer verify steps where the grammar decides the tokens): filled during the build,
        # uploaded with the mask; None = off.
        self.forced = forced
        self._forced_seen = (0, 0)  # (proposed, accepted) already reported to the exporter
        # The native batch calls (core/native.py): loaded when the first mask build creates the builder (a build may
        # compile it, once per environment; SGLang processes that never verify never load it), then shared by the
        # builder and the ledger. None: Python only.
        self._native_loader = native
        self.native: Optional[NativeGrammar] = None
        # feed_later inside a build's barrier: the build's ledger plan and the callers waiting for its outcomes
        # (set and cleared by _run around the barrier, on whichever thread runs it).
        self._collecting: Optional[LedgerPlan] = None
        self._waiting: List[Waiting] = []
        self._open: Optional[MaskJob] = None  # the grammar-thread job started and not yet joined
        # the calling thread's CUDA device, read per job and made the grammar thread's (CudaDevices; tests: a stand-in)
        self.devices = devices if devices is not None else CudaDevices()

    @property
    def builder(self) -> TreeMaskBuilder:
        if self._builder is None:
            config = self.config
            pin = config.pin_memory
            if pin is None:
                import torch

                pin = bool(torch.cuda.is_available())
            if self._native_loader is not None:
                self.native = self._native_loader()
                self.ledger.native = self.native
            self._builder = TreeMaskBuilder(threads=config.mask_threads, time_limit_s=config.mask_time_limit_s,
                                            pin_memory=pin, native=self.native)
        return self._builder

    def _state(self) -> StepState:
        """What the telemetry reports about this step (its source, attached at construction)."""
        return StepState(grammar_thread=self.config.grammar_thread, forced=self._forced_counts(),
                         native=self.native is not None, tokens_fed=self.ledger.tokens_fed,
                         ledger_requests=len(self.ledger), pinned_allocations=self.copier.pinned_allocations)

    # -- 1. before the verify launch ---------------------------------------------------------------------------
    def copy_tree(self, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                  draft_tokens: torch.Tensor) -> PendingTree:
        """Start the verify tree's host copy (reused pinned buffers, one event). Call just before the target-verify
        launch, on the stream that produced the tree."""
        self.telemetry.probe.on_launch(retrieve_next_token.device)
        self.telemetry.timeline.point("tree_copy")
        return self.copier.start(retrieve_next_token, retrieve_next_sibling, draft_tokens)

    def copy_host_tree(self, retrieve_next_token: Any, retrieve_next_sibling: Any, draft_tokens: Any) -> PendingTree:
        """A tree the caller already holds on the host (chain algorithms, host-built trees): copied into the reused
        buffers, without the launch probe (nothing is launched around it)."""
        return self.copier.start(retrieve_next_token, retrieve_next_sibling, draft_tokens)

    # -- counters the integrations report (names: ``core.stats.COUNTERS``) ------------------------------------------
    def count(self, name: str, k: int = 1) -> None:
        self.telemetry.stats.count(name, k)

    def ledger_outgrows(self, batch_size: int) -> bool:
        """Whether the ledger holds more requests than a few times a batch of ``batch_size`` (at least 64): then
        :meth:`prune` forgets every request not live. A caller that has to gather the live keys asks this first."""
        return len(self.ledger) > max(64, 4 * batch_size)

    @property
    def tokens_fed(self) -> int:
        """Tokens fed to grammars through the ledger since start (replays feed nothing)."""
        return self.ledger.tokens_fed

    # -- 2./4. the exactly-once feed, and its replays -------------------------------------------------------------
    def replay(self, key: Hashable, start: int, tokens: Sequence[int]) -> Optional[FeedOutcome]:
        """The recorded outcome of ``key``'s run at ``start`` if it was fed with these same ``tokens`` (counted as a
        replay), else None: then :meth:`feed` decides (a fresh run, or a conflict it re-anchors)."""
        if self._open is not None:
            self._settle_open()
        past = self.ledger.outcome(key, start)
        if past is None or past.tokens != tuple(tokens):  # tuple equality: numpy / torch integers compare as ints
            return None
        self.telemetry.stats.count("replays")
        return past

    def replay_whole(self, key: Hashable, start: int, tokens: Sequence[int]) -> Optional[List[int]]:
        """Post-processing's common case in one call: the whole run, when ``key``'s run at ``start`` was fed with these
        ``tokens``, kept them all and raised nothing (``AcceptLedger.replay_whole``; counted as a replay); else None,
        and the caller asks :meth:`replay` / :meth:`feed` (a cut run, a rejection, a fresh run or a conflict)."""
        if self._open is not None:
            self._settle_open()
        kept = self.ledger.replay_whole(key, start, tokens)
        if kept is None:
            return None
        self.telemetry.stats.counters["replays"] += 1  # every counter is present from the start (StepStats)
        return list(kept)

    def feed(self, runs: Sequence[Run], on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None,
             *, count_replays: bool = False) -> List[FeedOutcome]:
        """Feed every :class:`~sglang_eagle_overlap.core.ledger.Run` of a batch (its ``tokens``, committed at output
        position ``start``) to its grammar exactly once, in one call (``AcceptLedger.feed``: through ``matcher``, the
        native matcher inside the grammar, when given; ``on_feed(grammar, outcome)`` after a fresh feed, "Native
        feed"), one outcome per run in order. A run already fed is replayed from the ledger; ``count_replays``: count
        those as ``replays`` (post-processing asks; a barrier's second ask is not one).

        If the ledger and the host disagree about a run's position (the host rolled or rebuilt the matcher behind the
        ledger's back), that entry is re-anchored at the host's position, counted and logged, instead of raising into
        the host's scheduler loop; the other runs are not affected."""
        self._settle_open()
        plan = self.ledger.plan()
        replays = self.ledger.replays
        slots = list(plan.add(runs, on_feed))
        if plan.errors:
            self._reanchor(plan, slots, runs.__getitem__, on_feed)
        self._count_replays(count_replays, replays)
        plan.feed()
        return _fed(plan, slots)

    def feed_later(self, rows: Sequence[RowRun], result: ResultRuns,
                   on_done: Optional[Callable[[List[FeedOutcome]], None]],
                   on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None, *,
                   count_replays: bool = False) -> None:
        """:meth:`feed` of :class:`~sglang_eagle_overlap.core.ledger.RowRun` records: the runs of those rows of
        ``result``, their outcomes handed to ``on_done`` (None: nobody waits for them; they are in the ledger, where a
        later ask finds them, and no list of them is made). Called from a mask build's barrier (``start_build`` /
        ``build_mask``'s ``barrier``), the runs are checked by the ledger at once and fed by that build, with its tree
        walk, in one native call, which reads their tokens from ``result`` itself once its host copy is done (so a
        barrier run before the verify launch never waits for the copy); called elsewhere, at once. Either way every
        run is fed exactly once and ``on_done``, if given, is called once -- for a barrier, when the build is joined
        (``finish_build``), also when it failed. Until then the caller must not read the runs' effects (SGLang's loop
        reads them only after sampling)."""
        plan = self._collecting
        if plan is None:
            outcomes = self.feed([_run_of(r, result) for r in rows], on_feed, count_replays=count_replays)
            if on_done is not None:
                on_done(outcomes)
            return
        replays, errors = self.ledger.replays, plan.errors
        slots = list(plan.add_rows(rows, result, on_feed))
        if plan.errors != errors:
            self._reanchor(plan, slots, lambda j: _run_of(rows[j], result), on_feed)
        self._count_replays(count_replays, replays)
        if on_done is not None:
            self._waiting.append(Waiting(slots, on_done))

    def _reanchor(self, plan: LedgerPlan, slots: List[int], run_of: Callable[[int], Run],
                  on_feed: Optional[Callable[[Any, FeedOutcome], None]]) -> List[int]:
        """Re-anchor every run of ``slots`` (the j-th is ``run_of(j)``) that the ledger disagreed with (see
        :meth:`feed`) and add it again; returns the slots with the new ones."""
        out = plan.out
        for j, slot in enumerate(slots):
            result = out[slot]
            if isinstance(result, LedgerError):
                run = run_of(j)
                logger.warning("sglang-eagle-overlap: re-anchoring grammar ledger of request %s at position %d: %s",
                               run.key, run.start, result)
                self.telemetry.stats.count("ledger_resets")
                plan.feed()  # a run of this key may wait: the re-anchor must not drop its entry under it
                self.ledger.reset(run.key, run.start)
                slots[j] = plan.add((run,), on_feed)[0]
        return slots

    def _count_replays(self, count: bool, before: int) -> None:
        if count and self.ledger.replays != before:
            self.telemetry.stats.count("replays", self.ledger.replays - before)

    def prune(self, live: Optional[Collection[Hashable]], finished: Sequence[Hashable] = ()) -> None:
        """Keep the ledger bounded: drop ``finished`` requests, and all not ``live`` once it outgrows the batch
        (``live`` None: the caller cannot tell which requests are live, only the finished are dropped)."""
        self._settle_open()
        for key in finished:
            self.ledger.forget(key)
        if live is not None and self.ledger_outgrows(len(live)):
            self.telemetry.stats.count("ledger_forgets", self.ledger.retain(live))

    # -- 2./3. the mask build: started before (grammar thread) or after (inline) the verify launch --------------------
    def start_build(
        self,
        requests: Sequence[MaskRequest],
        tree: PendingTree,
        *,
        vocab_size: int,
        barrier: Optional[Callable[[], Any]] = None,
        allow_timeout: bool = True,
    ) -> MaskJob:
        """Start the step's grammar work, or, inline (grammar thread off), just record it for :meth:`finish_build`.
        Call after :meth:`copy_tree`, before the target-verify launch (grammar thread) or anywhere before
        :meth:`finish_build` (inline). ``allow_timeout=False`` builds without the time limit (callers that cannot
        neutralise drafts). With forced drafts on, the build records each valid node's grammar-forced continuation and
        :meth:`finish_build` uploads the table (EAGLE trees: their next step takes them).

        With the grammar thread, here on the scheduler thread: ``barrier()`` (its runs are checked by the ledger and
        queued by row: their tokens are not read, so nothing waits for the previous result's host copy) and the
        build's preparation (rows sorted, buffer taken); then the grammar thread waits for the previous result, the
        tree and the previous upload (GIL-free device-event waits) and makes the step's one native call (feeds and
        walk, GIL-free; with forced drafts it also asks each filled node's forced text); :meth:`finish_build` joins
        it. Where the native walk does not apply (no native module, a matcher subclass), or the batch has fewer
        requests than ``grammar_thread_min_batch`` (counted as ``small_batch_inline_steps``), the work runs inline in
        :meth:`finish_build`."""
        t0 = time.perf_counter()
        if self._open is not None:
            self._settle_open()
        job = MaskJob(requests=requests, tree=tree, vocab_size=vocab_size, barrier=barrier,
                      allow_timeout=allow_timeout and self._may_time_out(), forced=self.forced is not None)
        builder = self.builder
        threaded = self.config.grammar_thread and builder.native is not None
        if threaded and len(requests) < max(1, self.config.grammar_thread_min_batch):
            threaded = False  # a hand-off costs more than this batch's native call: inline at finish_build
            self.telemetry.stats.count("small_batch_inline_steps")
        if threaded:
            self._collect(job)
            plan = job.ledger_plan
            assert plan is not None
            # The tree copy's host buffers as [bs, n]: valid now, filled once the copy is done (the grammar thread
            # waits)
            job.tree_views = _rows(*tree.host)
            n = job.tree_nodes = job.tree_views[0].shape[1]
            job.build = builder.prepare(requests, n, vocab_size, allow_timeout=job.allow_timeout,
                                        forced=self.forced if job.forced else None, feeds=plan)
            if job.build.handles is not None:
                call = builder.native_call(job.build, *job.tree_views)
                if self._thread is None:
                    self._thread = _GrammarThread(self.devices)
                job.upload_event = self.uploader.take_fence()
                job.future = self._thread.submit(_native_job, plan.sources(), tree, job.upload_event, call,
                                                 device=self.devices.current())
                self._open = job
                self.telemetry.stats.counters["thread_steps"] += 1  # every counter is present from the start
        job.submit_s = time.perf_counter() - t0
        return job

    def finish_build(self, job: MaskJob, *, device: Any, draft_device: Any = None) -> StepMask:
        """Join the step's grammar work (inline: run it now), then, on the scheduler thread, record the feeds, walk
        what only Python can, upload the mask non-blocking (fenced by an event) and neutralise the drafts of requests
        whose rows are not exact (time limit or a failed build). Call after the target-verify launch, before sampling.
        ``draft_device`` is the device draft-token tensor the sampler will read. On a CPU device the returned mask
        aliases the builder's buffer: this step's sampling consumes it before the next build. An exception of the
        work is raised here."""
        t0 = time.perf_counter()
        self.telemetry.probe.on_mask_start(device, t0)
        threaded = job.future is not None
        if job.future is not None:
            result, t_join = self._join(job)
        else:
            if job.ledger_plan is None:  # the barrier, here rather than in _run: one frame less under the feed
                self._collect(job)
            result = self._run(job)
            t_join = time.perf_counter()
        if result.guidance_walked:
            self.telemetry.stats.counters["guidance_steps"] += 1
        device_mask = None
        if job.forced and self.forced is not None:
            self.forced.upload(device)
        if result.bitmask is not None:
            device_mask = self.uploader.upload(result.bitmask, device)
        n = job.tree_nodes
        unmasked = result.timed_out + [i for i, _ in result.failed]
        if unmasked and draft_device is not None:
            neutralize_timed_out_drafts(draft_device, unmasked, n)
        t3 = time.perf_counter()
        telemetry = self.telemetry
        unhidden = telemetry.probe.on_mask_ready(t3)
        upload_s = t3 - t_join
        bs = len(job.requests)
        # inline: the whole work ran here, gil_s stays 0 and there is no join to wait for
        telemetry.stats.record_step(job.advance_s, job.tree_wait_s, job.build_s + upload_s, len(result.timed_out),
                                    bs, unhidden, sched_s=job.submit_s + (t3 - t0),
                                    join_wait_s=(t_join - t0) if threaded else 0.0, helper_gil_s=job.gil_s,
                                    handoff_s=job.handoff_s)
        if result.failed:
            telemetry.stats.count("mask_failures", len(result.failed))
        if telemetry.exporting:
            fp, fa = self._forced_delta()
            telemetry.exporter.observe_step(t3 - t0, unhidden, len(result.timed_out), forced_proposed=fp,
                                            forced_accepted=fa)
        tl = telemetry.timeline
        if tl.enabled:
            m0, m1, m2, m3 = job.marks
            tl.span("advance", m0, m1, bs)
            tl.span("tree_wait", m1, m2, bs)
            tl.span("mask_build", m2, m3, bs)
            if threaded:  # the native work ran on the grammar thread; the scheduler thread waited t0 .. t_join
                tl.span("grammar_join", t0, t_join, bs)
            tl.span("mask_upload", t_join if threaded else m3, t3, bs)
            tl.point("sample", t3, bs)
        telemetry.report()
        return StepMask(device_mask, result)

    def build_mask(
        self,
        requests: Sequence[MaskRequest],
        tree: PendingTree,
        *,
        vocab_size: int,
        device: Device,
        barrier: Optional[Callable[[], object]] = None,
        draft_device: Optional[torch.Tensor] = None,
    ) -> StepMask:
        """:meth:`start_build` + :meth:`finish_build` in one call, after the target-verify launch, always inline:
        ``barrier()`` -> tree wait -> build -> upload -> neutralise. ``draft_device`` None means the caller cannot
        neutralise, so the build runs without a time limit. Records no grammar-forced continuations: its callers' trees
        (chain algorithms, host-built trees) never take forced drafts."""
        self._settle_open()
        job = MaskJob(requests=requests, tree=tree, vocab_size=vocab_size, barrier=barrier,
                      allow_timeout=draft_device is not None and self._may_time_out())
        return self.finish_build(job, device=device, draft_device=draft_device)

    def _collect(self, job: MaskJob) -> None:
        """Run ``job``'s barrier: the runs it hands to :meth:`feed_later` go into a fresh ledger plan of the job
        (``job.ledger_plan``, callers in ``job.waiting``). Marks the barrier's start and end."""
        plan = job.ledger_plan = self.ledger.plan()
        t0 = time.perf_counter()
        if job.barrier is not None:
            self._collecting, self._waiting = plan, job.waiting
            try:
                job.barrier()
            finally:
                self._collecting, self._waiting = None, []
        job.marks = (t0, time.perf_counter(), 0.0, 0.0)

    def _run(self, job: MaskJob) -> TreeMask:
        """The inline work, on the scheduler thread, after the barrier (:meth:`_collect`, run by the caller): tree
        wait -> wait until the previous upload left the reused host buffer -> build. The runs the barrier handed to
        :meth:`feed_later` were checked by the ledger at once and are fed by the build, in the same native call as the
        tree walk where it can; whatever happens, every one is fed, and its caller told, before this returns."""
        plan = job.ledger_plan
        assert plan is not None
        try:
            nxt, sib, draft = job.tree.resolve()
            t2 = time.perf_counter()
            self.uploader.fence()  # normally long done
            tree = _rows(nxt, sib, draft)
            n = job.tree_nodes = tree[0].shape[1]
            builder = self.builder
            build = job.build
            if build is None:
                build = builder.prepare(job.requests, n, job.vocab_size, allow_timeout=job.allow_timeout,
                                        forced=self.forced if job.forced else None, feeds=plan)
            res = None
            if build.handles is not None:
                try:
                    res = builder.walk_native(build, *tree)
                except Exception as exc:  # a refused call (it touched nothing): the Python walk, request by request
                    _raise_if_device_fault(exc)
                    builder.abandon_native(build, exc)
            result = builder.finish(build, res, *tree)
            job.marks = (job.marks[0], job.marks[1], t2, time.perf_counter())
        finally:
            self._complete(job)
        return result

    def _join(self, job: MaskJob) -> Tuple[TreeMask, float]:
        """Wait for the grammar thread's part of ``job``, then finish the build on this thread (feeds recorded, Python
        walks, every waiting caller told). Returns the mask and when the wait ended."""
        assert job.future is not None and job.build is not None and job.tree_views is not None
        builder = self.builder
        fault = False
        try:
            res: Optional[StepResult] = None
            try:
                raw, t2, t3, native_cpu_s = job.future.result()
                t_join = time.perf_counter()
                res = builder.native_result(job.build, raw, native_cpu_s)
                job.marks = (job.marks[0], job.marks[1], t2, t3)
                job.gil_s = max(0.0, job.future.cpu_s - native_cpu_s)
                job.handoff_s = max(0.0, job.future.woke - job.future.submitted)
            except Exception as exc:  # the native call was refused or never made: everything here, in Python
                t_join = time.perf_counter()
                _raise_if_device_fault(exc)  # but not past a device fault: it fails the step
                builder.abandon_native(job.build, exc)
                job.tree.resolve()
                if job.upload_event is not None:
                    job.upload_event.synchronize()
            finally:
                if self._open is job:
                    self._open = None
            return builder.finish(job.build, res, *job.tree_views), t_join
        except Exception as exc:
            fault = is_device_fault(exc)
            _raise_if_device_fault(exc)
            raise
        finally:
            try:
                self._complete(job)
            except Exception as exc:
                if not fault:
                    raise
                # the fault is what the caller must see; the feeds that need the device's results fail with it
                logger.error("sglang-eagle-overlap: after the device fault, the runs queued for the step could not "
                             "all be fed: %s: %s", type(exc).__name__, exc)

    def _complete(self, job: MaskJob) -> None:
        """Feed whatever of ``job``'s ledger plan still waits (nothing, unless the build failed before its native
        call) and hand every waiting caller its outcomes: each exactly once. A caller whose ``on_done`` raises does not
        keep the later ones from theirs; the first such error is raised after all were called (counted in
        ``job.failed_callbacks``)."""
        plan = job.ledger_plan
        if plan is None:
            return
        waiting, job.waiting = job.waiting, []
        plan.feed()
        first: Optional[Exception] = None
        for w in waiting:
            try:
                w.on_done(_fed(plan, w.slots))
            except Exception as exc:  # noqa: BLE001 - raised below, once every caller was told
                job.failed_callbacks += 1
                if first is None:
                    first = exc
        if first is not None:
            raise first

    def _settle_open(self) -> None:
        """Finish a grammar-thread job whose :meth:`finish_build` never came (its verify raised): its runs were handed
        to the ledger by its barrier and must be recorded before the ledger is used again. Its mask is dropped, so a
        failure to build it is logged and the step goes on; every waiting caller is told whatever fails (:meth:`_join`
        feeds and tells them in its ``finally``). Raised here, after that: a device fault, and an error of a caller's
        ``on_done`` (the host's own bookkeeping of those runs failed)."""
        job = self._open
        if job is None:
            return
        self._open = None
        try:
            self._join(job)
        except Exception as exc:  # noqa: BLE001 - the step it belonged to is gone; its runs were recorded above
            if job.failed_callbacks or is_device_fault(exc):
                raise
            logger.warning("sglang-eagle-overlap: an abandoned grammar step failed: %s: %s", type(exc).__name__, exc)

    def _forced_counts(self) -> Optional[ForcedCounts]:
        """Forced drafts proposed, changed, accepted, accepted of the changed ones, and nodes with a continuation, since
        start (None when off)."""
        f = self.forced
        return None if f is None else ForcedCounts(f.proposed, f.changed, f.accepted, f.changed_accepted,
                                                   f.recorded_nodes, f.recorded_keyed)

    def _forced_delta(self) -> Tuple[int, int]:
        """Forced drafts proposed / accepted since the last call (for the exporter's counters)."""
        counts = self._forced_counts() or ForcedCounts()
        proposed, accepted = counts.proposed, counts.accepted
        seen, self._forced_seen = self._forced_seen, (proposed, accepted)
        return proposed - seen[0], accepted - seen[1]

    def close(self) -> None:
        """Join the grammar thread (tests; a worker process simply exits)."""
        self._settle_open()
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def _may_time_out(self) -> bool:
        """Whether this process may apply the mask time limit: not when it is one of several ranks of a
        ``torch.distributed`` group (TP > 1). The limit is wall-clock time, so two ranks building the same mask could
        disagree on which requests keep their drafts, accept different tokens and silently diverge (the next
        collectives then mix different sequences); without it every rank builds the same exact mask, the ranks stay
        in step and a slow grammar costs time only, as in stock SGLang. Decided once, at the first verify step
        (the process group exists by then), and logged once."""
        if self._time_limit_ok is None:
            rank = distributed_rank()
            self._time_limit_ok = rank is None or rank[1] <= 1
            if rank is not None and not self._time_limit_ok and self.config.mask_time_limit_s:
                logger.info("sglang-eagle-overlap: mask time limit off in this process (rank %d of %d): tensor-"
                            "parallel ranks must build identical masks", rank[0], rank[1])
        return self._time_limit_ok
