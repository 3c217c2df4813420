"""Per-decode-step wall time and grammar time, measured inside the scheduler process (TEST / BENCHMARK ONLY).

Active only when ``SGLANG_EO_STEP_TIMES_FILE`` names a file; :func:`install` runs right after ``Scheduler.__init__``
(when every class-level hook of every plugin is in place), called by the CPU-runtime plugin on CPU, or by this
module's own SGLang plugin entry :func:`load` anywhere else (a GPU host: :func:`write_probe_distribution` makes SGLang
discover it without installing anything; both may run, the second install is a no-op). It wraps:

* the scheduler instance's ``run_batch`` (outermost): a *decode step* is the interval between the launch of a
  speculative decode batch (with or without grammar requests) and the next ``run_batch`` launch, when that next batch
  is one too. Both overlap loops (0.5.16, 0.5.23) do one ``run_batch`` and one ``process_batch_result`` per iteration,
  whether or not overlap was disabled for the batch, so the interval is one whole loop iteration: schedule +
  launch/forward + verify grammar mask + post-processing of the previous result; in the overlapped steady state on a
  GPU it is the step period. Intervals ending at a prefill, an idle wait or a non-speculative batch are not recorded
  (they are not a decode step).
* *grammar regions*: SGLang's own grammar entry points as its callers reach them (so whatever a plugin hooked into
  them is included) and the product plugin's mask step. Time is counted while at least one region is open, so nested
  regions (0.5.23: ``build_grammar_vocab_mask`` -> barrier -> ``advance_grammar_fsm``) count once.

  - 0.5.16: ``eagle_worker_common.generate_token_bitmask`` (upstream mask, Python DFS),
    ``SchedulerBatchResultProcessor._accept_grammar_tokens`` (post-processing advance);
  - 0.5.23: ``eagle_worker_common.build_grammar_vocab_mask`` (barrier + tree wait + mask),
    ``SchedulerBatchResultProcessor.advance_grammar_fsm`` (post-processing advance, idempotent);
  - product plugin (when importable): ``GrammarStep.build_mask`` (advance barrier + tree wait + mask),
    ``GrammarStep.start_build`` / ``finish_build`` (inline: the whole job in ``finish_build``; grammar thread: the
    barrier's ledger checks and the build's preparation, then the join wait, the feeds' record and the upload), and
    its band's other per-step grammar entry points: 0.5.16 ``keeps_overlap`` (the overlap decision) and
    ``Band016.verify_step`` + ``Band.start`` (tree copy launch, mask requests, start), 0.5.23
    ``Band023.verify_step`` and ``start_grammar_job`` (mask requests, start). Its forced-draft points
    (``before_verify``, ``after_sample``) are not regions: with forced drafts on they hold device ops, which would
    count as scheduler-thread CPU here.

  0.5.16's blocking ``.cpu()`` of the verify tree is inline in ``run_eagle_verify`` and cannot be wrapped; on CPU it
  returns the tensor itself (no copy, no sync), so it costs nothing here anyway.

* the model forward (``ModelRunner.forward``, draft and target alike): on a CPU engine it is the "GPU work" of the
  step, run synchronously on the scheduler thread;
* on a CPU engine, every other tensor operation the scheduler thread runs outside the forward and outside the grammar
  regions (:class:`TensorOpTimer`, a torch function mode on the scheduler thread only; a GPU engine's ops are
  asynchronous launches, CPU work of the scheduler thread, and are left alone): the verify's argmax over
  ``bs x n x vocab`` logits, the draft's top-k, tree building, the ``sgl_kernel`` stand-ins. On a GPU each of them is
  a kernel launch: the scheduler thread pays its dispatch, the device its compute. So the probe counts an op's
  dispatch as CPU work -- this machine's cost of dispatching a one-element op, measured at install -- and the rest
  of its time as device work. ``step - device - probe`` is then the scheduler thread's own CPU work, what a GPU
  host's scheduler thread does per step (the scheduler budget's (a)); ``step - forward`` still holds the tensor work too.

Regions are timed on the scheduler thread only (the product plugin's grammar thread passes through untimed), and the
plugin's stats-file write inside a region is not counted (instrumentation).

Records are ``[step_ms, grammar_ms, run_batch_ms, bs, grammar, forward_ms, device_ms, tensor_ops, probe_ms,
grammar_probe_ms]`` (``grammar`` 1.0 when the step's batch held a grammar request, else 0.0; ``device_ms`` = forward +
the device share of the other tensor ops; ``tensor_ops`` how many such ops ran; ``probe_ms`` what the tensor-op timer
itself cost the scheduler thread outside the forward: a measurement artefact, taken out with the device work;
``grammar_probe_ms`` the part of it inside grammar regions, which ``grammar_ms`` includes: its torch calls pass
through the timer's mode too; older records have nine fields). The file is JSON lines,
only ever appended to (name a fresh path per engine), one flushed line per recorded step (one small write: a GPU run
records thousands of steps, and rewriting a whole file per step would cost the scheduler thread milliseconds): a
``{"pid": ...}`` header per scheduler process and
its calibration ``{"dispatch_us": ..., "probe_overhead_us": ...}``, then one record list per step and ``{"error": ...}``
objects. :func:`read_step_times` returns ``{"pid", "dispatch_us", "probe_overhead_us", "steps": [...], "errors":
[...], "breakdown": [...]}``.

Opt-in breakdown (``SGLANG_EO_STEP_BREAKDOWN=1``; ``bench_scheduler_budget.py --breakdown``): where the plugin's
scheduler-thread time goes. :class:`Breakdown` wraps the plugin's functions of ``_BREAKDOWN_0_5_16`` /
``_BREAKDOWN_0_5_23`` (the core's ``GrammarStep`` / ledger plan / mask builder steps, the band's entry points and the
integration helpers they call) and times every call whole on the scheduler thread; each ``run_batch`` writes the
previous loop iteration's calls as one ``{"breakdown": {"bs": ..., "calls": {name: [s, ...]}}}`` line, and
:func:`breakdown_summary` turns them into calls per grammar step and median and mean ms per call. The wrappers cost
every call a few microseconds: not for a run whose timings are the result.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import statistics
import sys
import threading
import time
import types
from typing import Any, Callable, Optional, Tuple

__all__ = ["BREAKDOWN_ENV", "PROBE_ENTRY_POINT", "PROFILE_ENV", "STEP_TIMES_ENV", "Breakdown", "GrammarTimer",
           "StepClock", "StepProfile", "TensorOpTimer", "breakdown_summary", "install", "load", "read_step_times",
           "write_probe_distribution"]

STEP_TIMES_ENV = "SGLANG_EO_STEP_TIMES_FILE"
# Opt-in (``bench_scheduler_budget.py --breakdown``): where the plugin's scheduler-thread time goes, per function
BREAKDOWN_ENV = "SGLANG_EO_STEP_BREAKDOWN"
# Opt-in (``bench_scheduler_budget.py --profile DIR``): a cProfile of the scheduler thread's grammar decode steps
PROFILE_ENV = "SGLANG_EO_STEP_PROFILE_DIR"
MAX_STEPS = 200000
# name = target of this module's SGLang plugin entry point (group ``sglang.srt.plugins``)
PROBE_ENTRY_POINT = ("eo_step_times", "sglang_eo_dev.cpu_runtime.step_times:load")
_INSTALLED_ATTR = "_eo_step_times_installed"


class GrammarTimer:
    """Wall time the owner thread (the scheduler's: the one that created the timer) spends inside at least one open
    region (re-entrant). Calls on other threads -- the product plugin's grammar thread -- pass through untimed: their
    cost to the scheduler thread shows as the join wait inside a timed region and in the plugin's own GIL figure."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, marker: str = "__eo_grammar_timed__") -> None:
        self._clock = clock
        self._depth = 0
        self._opened = 0.0
        self._owner = threading.get_ident()
        self._marker = marker
        self.total_s = 0.0

    def enter(self) -> None:
        if self._depth == 0:
            self._opened = self._clock()
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.total_s += self._clock() - self._opened

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        owner = self._owner

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return fn(*args, **kwargs)
            self.enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        setattr(timed, self._marker, True)
        return timed

    def wrap_excluded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` inside an open region does not count (instrumentation: the plugin's stats-file write, which a
        benchmark turns on and production does not)."""
        owner = self._owner

        @functools.wraps(fn)
        def untimed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner or self._depth == 0:
                return fn(*args, **kwargs)
            self.total_s += self._clock() - self._opened
            try:
                return fn(*args, **kwargs)
            finally:
                self._opened = self._clock()

        setattr(untimed, self._marker, True)
        return untimed


class Breakdown:
    """Inclusive wall time of every call of some functions on one thread (the scheduler's: the one that creates it),
    filed under the batch size of the last launched batch. :meth:`flush` hands over what was recorded since the last
    flush: ``{"bs": bs, "calls": {name: [seconds, ...]}}`` (None when nothing was), one flush per scheduler loop
    iteration. Call order at each launch: :meth:`flush`, then set ``bs`` to the launched batch's size, so a flush is
    filed under the size its calls ran at. Nested functions are each timed whole (a caller's time
    includes its callees'). A wrapped call costs a few microseconds more: a run with a breakdown is not a timing
    run."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, marker: str = "__eo_breakdown_timed__") -> None:
        self._clock = clock
        self._owner = threading.get_ident()
        self._marker = marker
        self.bs = 0
        self._calls: dict[str, list[float]] = {}

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed under its qualified name, without an enclosing function's (on the owner thread only)."""
        owner, clock, name = self._owner, self._clock, fn.__qualname__.rsplit("<locals>.", 1)[-1]

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return fn(*args, **kwargs)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._calls.setdefault(name, []).append(clock() - t)

        setattr(timed, self._marker, True)
        return timed

    def flush(self) -> Optional[dict[str, Any]]:
        if not self._calls:
            return None
        out = {"bs": self.bs, "calls": self._calls}
        self._calls = {}
        return out


class StepProfile:
    """cProfile of the scheduler thread over the loop iterations that launched a speculative decode batch holding a
    grammar request, one profile per batch size. Call order: :meth:`launch` at every ``run_batch`` launch, on the
    scheduler thread (it ends the iteration in progress and starts the next one's profile when that batch is a
    grammar decode batch). Every ``every`` profiled steps of a batch size it writes ``<dir>/<pid>_bs<bs>.prof``
    (pstats) and ``<dir>/<pid>_bs<bs>.json`` (``{"steps", "plugin"}``: how many iterations the profile holds and the
    file of the product plugin the engine imported, which tells a ``--before`` engine from this checkout's). Call
    counts are exact; the times carry cProfile's per-call cost, so compare them only with another profile's."""

    def __init__(self, directory: str, every: int = 20) -> None:
        import cProfile

        self._new = cProfile.Profile
        self.directory = directory
        self.every = every
        self._profiles: dict[int, Any] = {}
        self._steps: dict[int, int] = {}
        self._on: Optional[int] = None
        try:
            import sglang_eagle_overlap

            self._plugin = str(sglang_eagle_overlap.__file__)
        except ImportError:
            self._plugin = ""

    def launch(self, grammar_decode: bool, bs: int) -> None:
        if self._on is not None:
            on, self._on = self._on, None
            self._profiles[on].disable()
            self._steps[on] += 1
            if self._steps[on] % self.every == 0:
                self._write(on)
        if grammar_decode:
            if bs not in self._profiles:
                self._profiles[bs], self._steps[bs] = self._new(), 0
            self._on = bs
            self._profiles[bs].enable()

    def _write(self, bs: int) -> None:
        stem = os.path.join(self.directory, f"{os.getpid()}_bs{bs}")
        self._profiles[bs].dump_stats(stem + ".prof")
        with open(stem + ".json", "w", encoding="utf-8") as f:
            json.dump({"steps": self._steps[bs], "plugin": self._plugin}, f)


def breakdown_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """:class:`Breakdown` flushes (one per scheduler loop iteration) -> per batch size, per function: ``[calls per
    grammar step, median ms per call, mean ms per call]`` (calls x mean is the function's time per step; the median is
    the typical call, misleading for a function whose calls do different things, e.g. a barrier call that feeds and a
    post-processing call that returns at once). A grammar step is an iteration in which the core's ``GrammarStep`` was
    called; iterations of unconstrained batches (where only the band's entry points ran, to find no grammar) are left
    out."""
    by_bs: dict[str, dict[str, list[float]]] = {}
    iterations: dict[str, int] = {}
    for rec in records:
        if not any(name.startswith("GrammarStep.") for name in rec["calls"]):
            continue
        key = str(rec["bs"])
        iterations[key] = iterations.get(key, 0) + 1
        for name, times in rec["calls"].items():
            by_bs.setdefault(key, {}).setdefault(name, []).extend(times)
    return {bs: {name: [len(v) / iterations[bs], statistics.median(v) * 1e3, statistics.fmean(v) * 1e3]
                 for name, v in fns.items()} for bs, fns in by_bs.items()}


class StepClock:
    """Turns ``run_batch`` launches into decode-step records
    ``[step_ms, grammar_ms, run_batch_ms, bs, grammar, forward_ms, device_ms, tensor_ops, probe_ms,
    grammar_probe_ms]``.

    Call :meth:`launch` when a batch is launched and :meth:`launched` when its ``run_batch`` returned. A step is
    recorded at a launch when both this launch and the previous one are decode steps (``is_decode=True``); its grammar
    time is the :class:`GrammarTimer` total accumulated between the two launches; ``bs`` and ``grammar`` are those of
    the previous launch (the batch whose step ends here); ``forward_ms`` the ``forward`` timer's total in the interval
    (0 without one); ``device_ms`` that plus the ``ops`` timer's device share in the interval, ``tensor_ops`` its op
    count, ``probe_ms`` the ``ops`` timer's own cost in the interval (its calls x its per-call overhead) and
    ``grammar_probe_ms`` the part of that inside grammar regions (their calls x the same overhead).
    """

    def __init__(self, timer: GrammarTimer, clock: Callable[[], float] = time.perf_counter,
                 forward: Optional[GrammarTimer] = None, ops: Optional["TensorOpTimer"] = None) -> None:
        self.timer = timer
        self.forward = forward
        self.ops = ops
        self._fwd0 = 0.0
        self._ops0: Tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)
        self._clock = clock
        # (launch t, grammar total, run_batch s, bs, grammar flag) of the last decode launch
        self._prev: Optional[tuple[float, float, float, int, bool]] = None
        self.steps: list[list[float]] = []

    def launch(self, is_decode: bool, bs: int, grammar: bool = True) -> bool:
        """Returns True when a step was recorded (it is then ``self.steps[-1]``)."""
        now = self._clock()
        recorded = False
        fwd = self.forward.total_s if self.forward is not None else 0.0
        ops = (self.ops.device_s, self.ops.count, self.ops.calls * self.ops.overhead_s,
               self.ops.grammar_calls * self.ops.overhead_s) if self.ops is not None else (0.0, 0, 0.0, 0.0)
        if self._prev is not None and is_decode:
            t0, g0, run_s, prev_bs, prev_grammar = self._prev
            if len(self.steps) < MAX_STEPS:
                fwd_ms = (fwd - self._fwd0) * 1e3
                self.steps.append([(now - t0) * 1e3, (self.timer.total_s - g0) * 1e3, run_s * 1e3, float(prev_bs),
                                   1.0 if prev_grammar else 0.0, fwd_ms, fwd_ms + (ops[0] - self._ops0[0]) * 1e3,
                                   float(ops[1] - self._ops0[1]), (ops[2] - self._ops0[2]) * 1e3,
                                   (ops[3] - self._ops0[3]) * 1e3])
                recorded = True
        self._prev = (now, self.timer.total_s, 0.0, bs, grammar) if is_decode else None
        self._fwd0 = fwd
        self._ops0 = ops
        self._launched_at = now
        return recorded

    def launched(self) -> None:
        """``run_batch`` of the batch passed to the last :meth:`launch` returned."""
        if self._prev is not None:
            t0, g0, _, bs, grammar = self._prev
            self._prev = (t0, g0, self._clock() - self._launched_at, bs, grammar)


class TensorOpTimer:
    """Splits the scheduler thread's tensor operations outside the model forward and the grammar regions into the
    part a GPU host's scheduler thread also pays (the dispatch of a launch) and device work (module docstring).

    :meth:`enter` pushes a torch function mode on the calling thread only (torch keeps the mode stack per thread): every
    torch call of that thread reaches :meth:`_call`. Inside the forward (``in_device()``) calls pass through: the
    forward's timer has them. Elsewhere an op is timed unless ``in_grammar()`` says a grammar region is open or the call
    is host-side by nature (``tolist``, ``item``, attribute reads, ...: on a GPU they are CPU work, or a wait).
    ``device_s`` sums ``time - dispatch_s`` over the timed ops (``dispatch_s``: this machine's cost of a one-element op,
    :meth:`calibrate`), ``count`` counts them. The mode itself costs every call outside the forward ``overhead_s``
    (measured by :meth:`calibrate`); ``calls`` counts those calls, so that the probe's own cost can be taken out of the
    scheduler thread's CPU time (``probe_ms`` of a step record), and ``grammar_calls`` those inside a grammar region,
    so that it can be taken out of the grammar time too (``grammar_probe_ms``)."""

    # host-side by nature: CPU work on a GPU host too (conversions, shape and attribute reads), never timed as device
    HOST = frozenset({"__get__", "__set__", "tolist", "item", "numpy", "__iter__", "__len__", "__bool__", "__int__",
                      "__float__", "__index__", "__repr__", "__format__", "__hash__", "size", "dim", "numel",
                      "data_ptr", "is_contiguous", "stride", "element_size", "storage_offset", "untyped_storage"})

    def __init__(self, in_device: Callable[[], bool], in_grammar: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._in_device = in_device
        self._in_grammar = in_grammar
        self._clock = clock
        self.dispatch_s = 0.0
        self.overhead_s = 0.0
        self.device_s = 0.0
        self.count = 0
        self.calls = 0
        self.grammar_calls = 0  # the part of ``calls`` made inside a grammar region
        self._mode: Any = None
        self._in_kernel = False
        self._owner = threading.get_ident()

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._in_kernel or self._in_device():
            return func(*args, **kwargs)
        self.calls += 1
        if self._in_grammar():
            self.grammar_calls += 1
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") in self.HOST:
            return func(*args, **kwargs)
        return self._timed(func, args, kwargs)

    def _timed(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One device op: its time beyond a dispatch is device work."""
        t = self._clock()
        try:
            return fn(*args, **kwargs)
        finally:
            self.device_s += max(0.0, self._clock() - t - self.dispatch_s)
            self.count += 1

    def kernel(self, fn: Callable[..., Any], args: tuple, kwargs: dict, compiled: bool = False) -> Any:
        """One call of a function that is a single kernel on a GPU but a Python loop of tensor ops here (the
        ``sgl_kernel`` stand-ins, SGLang's CPU fallbacks of its Triton kernels), or a few fused ones (a
        ``torch.compile``'d function, ``compiled``: the mode is lifted while it runs, since dynamo's guards would see
        it and its graphs then run as thousands of separate calls): timed as ONE op, the ops inside it not one by one.
        On other threads, or inside a forward or grammar region, a plain call."""
        if (self._in_kernel or threading.get_ident() != self._owner or self._in_device()
                or self._in_grammar()):
            return fn(*args, **kwargs)
        mode = self._mode if compiled else None
        self._in_kernel = True
        if mode is not None:
            mode.__exit__(None, None, None)
        try:
            return self._timed(fn, args, kwargs)
        finally:
            if mode is not None:
                mode.__enter__()
            self._in_kernel = False

    def wrap_kernel(self, fn: Callable[..., Any], compiled: bool = False) -> Callable[..., Any]:
        """``fn`` with its calls going through :meth:`kernel`."""

        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            return self.kernel(fn, args, kwargs, compiled)

        setattr(op, "__eo_kernel_timed__", True)
        return op

    def enter(self) -> None:
        """Start timing the calling thread's torch calls (once; the mode stays for the thread's life)."""
        if self._mode is not None:
            return
        self._owner = threading.get_ident()
        from torch.overrides import TorchFunctionMode

        import torch

        timer = self
        compiling = torch.compiler.is_compiling

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
                if compiling():  # dynamo tracing a compiled function: trace the op alone, time the graph as CPU
                    return func(*args, **(kwargs or {}))
                return timer._call(func, args, kwargs or {})

        self._mode = _Mode()
        self._mode.__enter__()

    def calibrate(self, reps: int = 400) -> Tuple[float, float]:
        """Measure ``overhead_s`` (the mode's cost per call: a host-side call with the mode minus without) and
        ``dispatch_s`` (the timed time of a one-element ``torch.add``), medians of ``reps``; then start the mode if it
        is not on yet. Call on the thread to time, before anything is counted: the counters are reset."""
        import torch

        x = torch.ones(1)

        def per_call(fn: Callable[[], Any]) -> float:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            times.sort()
            return times[len(times) // 2]

        on = self._mode is not None
        if on:
            self._mode.__exit__(None, None, None)
            self._mode = None
        without = per_call(x.dim)
        self.enter()
        with_mode = per_call(x.dim)
        self.overhead_s = max(0.0, with_mode - without)
        self.dispatch_s = 0.0
        adds = []
        for _ in range(reps):
            before = self.device_s
            torch.add(x, 1)
            adds.append(self.device_s - before)
        adds.sort()
        self.dispatch_s = adds[len(adds) // 2]
        self.device_s, self.count, self.calls, self.grammar_calls = 0.0, 0, 0, 0
        return self.dispatch_s, self.overhead_s


# (module, attribute holding a function or class, method name or None)
_REGIONS_0_5_16 = (
    ("sglang.srt.speculative.eagle_worker_common", "generate_token_bitmask", None),
    ("sglang.srt.managers.scheduler_components.batch_result_processor", "SchedulerBatchResultProcessor",
     "_accept_grammar_tokens"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "build_mask"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "start_build"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "finish_build"),
    # the plugin's other per-step grammar entry points on the scheduler thread (reached through the band module): the
    # overlap decision and the job's start (tree copy launch, mask requests, start_build). Not its forced-draft
    # points (before_verify, after_sample): with forced drafts on they hold device ops, which a region would count
    # as scheduler-thread CPU on a CPU engine.
    ("sglang_eagle_overlap.adapters.v0_5_16.band", "keeps_overlap", None),
    ("sglang_eagle_overlap.adapters.v0_5_16.band", "Band016", "verify_step"),
    ("sglang_eagle_overlap.integration.band", "Band", "start"),
    # the same start through the band module's function (the vendored patch's entry; the hooks' entry in plugin
    # revisions before the band base, which bench_scheduler_budget's --before compares with)
    ("sglang_eagle_overlap.adapters.v0_5_16.band", "begin_verify", None),
)
_REGIONS_0_5_23 = (
    ("sglang.srt.speculative.eagle_worker_common", "build_grammar_vocab_mask", None),
    ("sglang.srt.managers.scheduler_components.batch_result_processor", "SchedulerBatchResultProcessor",
     "advance_grammar_fsm"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "build_mask"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "start_build"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "finish_build"),
    ("sglang_eagle_overlap.adapters.v0_5_23.band", "Band023", "verify_step"),
    ("sglang_eagle_overlap.adapters.v0_5_23.band", "start_grammar_job", None),
    # the hand-over through the band module's function (the patch's entry; the hooks' before the band base)
    ("sglang_eagle_overlap.adapters.v0_5_23.band", "hand_over_verify", None),
)
# Single kernels on a GPU that run as Python loops of tensor ops on a CPU engine, timed as one device op each: the
# ``sgl_kernel`` stand-ins (through their own hook) and SGLang's CPU fallbacks of its Triton kernels (module functions
# its callers reach through the module's globals).
_KERNELS = (("sglang.srt.model_executor.forward_batch_info", "compute_position_torch"),)
# Instrumentation inside a region, not counted: the plugin's stats-file write.
_EXCLUDED = (("sglang_eagle_overlap.core.telemetry", "StepTelemetry", "write_stats"),
             # where plugin revisions before the telemetry part wrote it (bench_scheduler_budget --before)
             ("sglang_eagle_overlap.core.step", "GrammarStep", "write_stats"))
# --breakdown: the plugin's functions on the scheduler thread, each timed whole (engine-agnostic core, then the band's
# entry points and the integration helpers it calls per step)
_BREAKDOWN_CORE = tuple(("sglang_eagle_overlap.core." + m, cls, fn) for m, cls, fn in (
    ("step", "GrammarStep", "copy_tree"), ("step", "GrammarStep", "start_build"),
    ("step", "GrammarStep", "finish_build"), ("step", "GrammarStep", "_collect"),
    ("step", "GrammarStep", "_join"), ("step", "GrammarStep", "_complete"),
    ("telemetry", "StepTelemetry", "report"), ("telemetry", "StepTelemetry", "write_stats"),
    ("step", "_GrammarThread", "submit"), ("step", "_GrammarThread", "result"),
    ("ledger", "LedgerPlan", "add_rows"), ("ledger", "LedgerPlan", "fill"), ("mask", "TreeMaskBuilder", "prepare"),
    ("mask", "TreeMaskBuilder", "finish"), ("mask", "TreeMaskBuilder", "native_result")))
# the shared band flow (integration.band): its methods, and the request helpers it calls by its own module's names
_BREAKDOWN_BAND = tuple(("sglang_eagle_overlap.integration.band", "Band", fn) for fn in (
    "start", "finish", "feed_results")) + tuple(("sglang_eagle_overlap.integration.band", fn, None) for fn in (
    "mask_requests", "settle_mask"))
_BREAKDOWN_0_5_16 = _BREAKDOWN_CORE + _BREAKDOWN_BAND + tuple(
    ("sglang_eagle_overlap.adapters.v0_5_16.band", fn, None) for fn in (
        "keeps_overlap", "can_mask", "begin_verify", "build_vocab_mask", "feed_tokens", "result_rows"))
_BREAKDOWN_0_5_23 = _BREAKDOWN_CORE + _BREAKDOWN_BAND + tuple(
    ("sglang_eagle_overlap.adapters.v0_5_23.band", fn, None) for fn in (
        "start_grammar_job", "build_grammar_vocab_mask", "advance_grammar_fsm", "result_rows", "kept_tokens"))
# The model forward ("GPU work" on a CPU engine: it runs synchronously on the scheduler thread there).
_FORWARD = ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward")
_OPTIONAL_MODULE_PREFIX = "sglang_eagle_overlap."  # the product plugin may be absent


def _exclude_region(timer: GrammarTimer, module: str, attr: str, method: str) -> None:
    """Make ``module.attr.method`` not count inside ``timer``'s regions (absent: nothing to do)."""
    try:
        owner = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return
    fn = owner.__dict__.get(method)
    if fn is not None and not getattr(fn, timer._marker, False):
        setattr(owner, method, timer.wrap_excluded(fn))


def _wrap_region(timer: GrammarTimer | Breakdown, module: str, attr: str, method: Optional[str]) -> Optional[str]:
    """Wrap one region (or one function of a breakdown) in place; returns an error text when a required one is
    missing."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        return None if module.startswith(_OPTIONAL_MODULE_PREFIX) else f"{module}: {exc}"
    owner = getattr(mod, attr, None)
    if owner is None:
        return f"{module}.{attr} not found"
    if method is None:
        if not getattr(owner, timer._marker, False):
            setattr(mod, attr, timer.wrap(owner))
        return None
    fn = owner.__dict__.get(method) or getattr(owner, method, None)
    if fn is None:
        return f"{module}.{attr}.{method} not found"
    if not getattr(fn, timer._marker, False):
        setattr(owner, method, timer.wrap(fn))
    return None


def spec_decode_kind(batch: Any) -> Optional[bool]:
    """None when ``batch`` is not a speculative decode batch, else whether it holds a grammar request."""
    try:
        if batch is None or batch.spec_algorithm.is_none() or not batch.forward_mode.is_decode():
            return None
        return bool(batch.has_grammar)
    except AttributeError:
        return None


class _Recorder:
    """Appends the header, step records and errors to the JSON-lines file, one flushed line each."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.timer = GrammarTimer()
        self.forward = GrammarTimer(marker="__eo_forward_timed__")
        self.ops = TensorOpTimer(lambda: self.forward._depth > 0, lambda: self.timer._depth > 0)
        self.clock = StepClock(self.timer, forward=self.forward, ops=self.ops)
        self.breakdown: Optional[Breakdown] = None  # opt-in (BREAKDOWN_ENV): install wraps its functions
        self.profile: Optional[StepProfile] = None  # opt-in (PROFILE_ENV)
        # append: several scheduler processes (tensor parallel ranks) may share the file, each line is one write
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the scheduler's lifetime
        self._line({"pid": os.getpid()})

    def _line(self, obj: Any) -> None:
        self._f.write(json.dumps(obj) + "\n")
        self._f.flush()

    def error(self, text: str) -> None:
        self._line({"error": text})

    def step(self, record: list[float]) -> None:
        self._line(record)


def install(scheduler: Any, sglang_version: tuple[int, ...]) -> None:
    """Wrap the scheduler's ``run_batch`` and the grammar regions (no-op without ``SGLANG_EO_STEP_TIMES_FILE``, and
    for a scheduler already wrapped)."""
    path = os.environ.get(STEP_TIMES_ENV)
    if not path or getattr(scheduler, _INSTALLED_ATTR, False):
        return
    setattr(scheduler, _INSTALLED_ATTR, True)
    rec = _Recorder(path)
    regions = _REGIONS_0_5_16 if sglang_version < (0, 5, 17) else _REGIONS_0_5_23
    for module, attr, method in regions:
        err = _wrap_region(rec.timer, module, attr, method)
        if err:
            rec.error(f"grammar region not timed: {err}")
    for where in _EXCLUDED:
        _exclude_region(rec.timer, *where)
    if os.environ.get(BREAKDOWN_ENV):
        rec.breakdown = Breakdown()
        for module, attr, method in _BREAKDOWN_0_5_16 if sglang_version < (0, 5, 17) else _BREAKDOWN_0_5_23:
            err = _wrap_region(rec.breakdown, module, attr, method)
            if err:
                rec.error(f"breakdown function not timed: {err}")
    if os.environ.get(PROFILE_ENV):
        os.makedirs(os.environ[PROFILE_ENV], exist_ok=True)
        rec.profile = StepProfile(os.environ[PROFILE_ENV])
    err = _wrap_region(rec.forward, *_FORWARD)
    if err:
        rec.error(f"forward not timed: {err}")
    if _on_cpu(scheduler):  # a GPU engine's ops are asynchronous launches: the forward timer is its whole story
        _time_tensor_ops(rec)

    run_batch = scheduler.run_batch

    def timed_run_batch(batch: Any, *args: Any, **kwargs: Any) -> Any:
        with rec.lock:
            bs = len(getattr(batch, "reqs", None) or [])
            kind = spec_decode_kind(batch)
            if rec.clock.launch(kind is not None, bs, bool(kind)):
                rec.step(rec.clock.steps[-1])
            if rec.breakdown is not None:  # the last loop iteration's calls, then this batch's size for the next
                flushed = rec.breakdown.flush()
                if flushed is not None:
                    rec._line({"breakdown": flushed})
                rec.breakdown.bs = bs
            if rec.profile is not None:
                rec.profile.launch(bool(kind), bs)
        try:
            return run_batch(batch, *args, **kwargs)
        finally:
            rec.clock.launched()

    scheduler.run_batch = timed_run_batch


def _on_cpu(scheduler: Any) -> bool:
    """Whether the scheduler's engine runs on the CPU (the CPU runtime), where tensor ops run synchronously."""
    device = getattr(getattr(scheduler, "server_args", None), "device", None)
    return device == "cpu" if device is not None else os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def _time_tensor_ops(rec: _Recorder) -> None:
    """Start the tensor-op timer on the calling thread -- the scheduler's: ``Scheduler.__init__`` ran here and its event
    loop runs here --, route the single-kernel functions through it, and record its per-op dispatch cost."""
    dispatch_s, overhead_s = rec.ops.calibrate()  # starts the mode
    _hook_kernels(rec)
    rec._line({"dispatch_us": dispatch_s * 1e6, "probe_overhead_us": overhead_s * 1e6})


def _hook_kernels(rec: _Recorder) -> None:
    """Time the single-kernel functions (``_KERNELS``, the ``sgl_kernel`` stand-ins, SGLang's ``torch.compile``'d
    functions) as one device op each."""
    try:
        from sgl_kernel import _spec_ops  # the CPU runtime's stand-in
    except ImportError:  # a CPU engine without it cannot run EAGLE; nothing to route
        _spec_ops = None
    if _spec_ops is not None:
        _spec_ops.KERNEL_HOOK[0] = rec.ops.kernel
    for module, attr in _KERNELS:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        fn = getattr(mod, attr, None)
        if fn is None:
            rec.error(f"kernel not timed as one op: {module}.{attr} not found")
        elif not getattr(fn, "__eo_kernel_timed__", False):
            setattr(mod, attr, rec.ops.wrap_kernel(fn))
    _wrap_compiled(rec, list(sys.modules.items()))


def _wrap_compiled(rec: _Recorder, modules: list[tuple[str, Any]]) -> None:
    """SGLang's ``torch.compile``'d helpers (``_select_top_k_tokens_later``, ...) as one device op each, the torch
    function mode lifted while they run (:meth:`TensorOpTimer.kernel`), wherever one of ``modules`` (``(name,
    module)``; only ``sglang.*`` ones are looked at) holds one."""
    wrapped: dict[int, Callable[..., Any]] = {}
    for name, mod in modules:
        if not name.startswith("sglang.") or mod is None:
            continue
        for attr, fn in list(vars(mod).items()):
            # a plain function that dynamo wrapped (not any object answering every attribute, such as a stand-in)
            if isinstance(fn, types.FunctionType) and "_torchdynamo_orig_callable" in vars(fn):
                if id(fn) not in wrapped:
                    wrapped[id(fn)] = rec.ops.wrap_kernel(fn, compiled=True)
                setattr(mod, attr, wrapped[id(fn)])


def _installed_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version("sglang").split(".")[:3])


def _after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    install(scheduler, _installed_version())
    return None


def load() -> None:
    """SGLang plugin entry (``PROBE_ENTRY_POINT``): install the probe after ``Scheduler.__init__`` (no-op without
    ``SGLANG_EO_STEP_TIMES_FILE``). Needs nothing of the CPU runtime, so it runs on a GPU host as well."""
    if not os.environ.get(STEP_TIMES_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.__init__", _after_scheduler_init, HookType.AFTER)


def write_probe_distribution(directory: str | os.PathLike[str]) -> str:
    """Make ``directory`` a path entry that gives SGLang's plugin loader this probe and nothing else, and return it:
    a minimal distribution declaring :data:`PROBE_ENTRY_POINT` plus a symlink to this ``sglang_eo_dev`` package.
    With ``directory`` first on ``sys.path`` / ``PYTHONPATH`` of the process that starts the engine, every engine
    process finds :func:`load`, as after a ``pip install``. Only the package is linked, not the ``dev/`` folder: that
    folder also holds the CPU stand-in of ``sgl_kernel``, which must never shadow the real one on a GPU host.
    Call order: before the first engine start of the process (SGLang loads plugins once per process)."""
    name, target = PROBE_ENTRY_POINT
    os.makedirs(directory, exist_ok=True)
    info = os.path.join(directory, "sglang_eo_step_times_probe-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write("Metadata-Version: 2.1\nName: sglang-eo-step-times-probe\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w", encoding="utf-8") as f:
        f.write(f"[sglang.srt.plugins]\n{name} = {target}\n")
    link = os.path.join(directory, "sglang_eo_dev")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../sglang_eo_dev
    if not os.path.islink(link):
        os.symlink(package, link, target_is_directory=True)
    return str(directory)


def read_step_times(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The records the scheduler wrote so far (``{"pid", "dispatch_us", "steps": [], "errors": [], "breakdown": []}``:
    empty when none yet; ``dispatch_us`` the per-op dispatch cost :class:`TensorOpTimer` measured; ``breakdown`` the
    :class:`Breakdown` flushes, with ``BREAKDOWN_ENV`` set). A last line still being written is skipped."""
    out: dict[str, Any] = {"pid": None, "dispatch_us": None, "probe_overhead_us": None, "steps": [], "errors": [],
                           "breakdown": []}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return out
    for line in lines:
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, list):
            out["steps"].append(obj)
        elif "error" in obj:
            out["errors"].append(obj["error"])
        elif "breakdown" in obj:
            out["breakdown"].append(obj["breakdown"])
        elif "pid" in obj:
            out["pid"] = obj["pid"]
        elif "dispatch_us" in obj:
            out["dispatch_us"] = obj["dispatch_us"]
            out["probe_overhead_us"] = obj.get("probe_overhead_us")
    return out
