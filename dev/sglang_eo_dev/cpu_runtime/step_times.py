"""Per-decode-step wall time and grammar time, measured inside the scheduler process (TEST / BENCHMARK ONLY).

Active only when ``SGLANG_EO_STEP_TIMES_FILE`` names a file; :func:`install` (called by the CPU-runtime plugin right
after ``Scheduler.__init__``, when every class-level hook of every plugin is in place) then wraps:

* the scheduler instance's ``run_batch`` (outermost): a *decode step* is the interval between the launch of a
  speculative grammar decode batch and the next ``run_batch`` launch, when that next batch is one too. Both overlap
  loops (0.5.16, 0.5.23) do one ``run_batch`` and one ``process_batch_result`` per iteration, whether or not overlap
  was disabled for the batch, so the interval is one whole loop iteration: schedule + launch/forward + verify grammar
  mask + post-processing of the previous result. Intervals ending at a prefill, an idle wait or a plain batch are
  not recorded (they are not a decode step).
* *grammar regions*: SGLang's own grammar entry points as its callers reach them (so whatever a plugin hooked into
  them is included) and the product plugin's mask step. Time is counted while at least one region is open, so nested
  regions (0.5.23: ``build_grammar_vocab_mask`` -> barrier -> ``advance_grammar_fsm``) count once.

  - 0.5.16: ``eagle_worker_common.generate_token_bitmask`` (upstream mask, Python DFS),
    ``SchedulerBatchResultProcessor._accept_grammar_tokens`` (post-processing advance);
  - 0.5.23: ``eagle_worker_common.build_grammar_vocab_mask`` (barrier + tree wait + mask),
    ``SchedulerBatchResultProcessor.advance_grammar_fsm`` (post-processing advance, idempotent);
  - product plugin (when importable): ``GrammarStep.build_mask`` (advance barrier + tree wait + mask), and with its
    grammar thread ``GrammarStep.start_build`` / ``finish_build`` (hand-off; join wait + upload).

  0.5.16's blocking ``.cpu()`` of the verify tree is inline in ``run_eagle_verify`` and cannot be wrapped; on CPU it
  returns the tensor itself (no copy, no sync), so it costs nothing here anyway.

* the model forward (``ModelRunner.forward``, draft and target alike): on a CPU engine it is the "GPU work" of the
  step, run synchronously on the scheduler thread; ``step - forward`` is the scheduler thread's own CPU work.

The file holds ``{"pid", "steps": [[step_ms, grammar_ms, run_batch_ms, bs, forward_ms], ...], "errors": [...]}``,
rewritten atomically after every recorded step (a few hundred steps per benchmark run).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["STEP_TIMES_ALL_ENV", "STEP_TIMES_ENV", "GrammarTimer", "StepClock", "install", "read_step_times"]

STEP_TIMES_ENV = "SGLANG_EO_STEP_TIMES_FILE"
STEP_TIMES_ALL_ENV = "SGLANG_EO_STEP_TIMES_ALL"
MAX_STEPS = 20000


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


class StepClock:
    """Turns ``run_batch`` launches into decode-step records ``(step_ms, grammar_ms, run_batch_ms, bs)``.

    Call :meth:`launch` when a batch is launched and :meth:`launched` when its ``run_batch`` returned. A step is
    recorded at a launch when both this launch and the previous one are decode steps (``is_decode=True``); its grammar
    time is the :class:`GrammarTimer` total accumulated between the two launches.
    """

    def __init__(self, timer: GrammarTimer, clock: Callable[[], float] = time.perf_counter,
                 forward: Optional[GrammarTimer] = None) -> None:
        self.timer = timer
        self.forward = forward
        self._clock = clock
        self._prev: Optional[tuple[float, float, float, int]] = None  # (launch t, grammar total, run_batch s, bs)
        self._fwd0 = 0.0
        self._run_s = 0.0
        self.steps: list[list[float]] = []

    def launch(self, is_decode: bool, bs: int) -> bool:
        """Returns True when a step was recorded."""
        now = self._clock()
        recorded = False
        fwd = self.forward.total_s if self.forward is not None else 0.0
        if self._prev is not None and is_decode:
            t0, g0, run_s, prev_bs = self._prev
            if len(self.steps) < MAX_STEPS:
                self.steps.append(
                    [(now - t0) * 1e3, (self.timer.total_s - g0) * 1e3, run_s * 1e3, float(prev_bs),
                     (fwd - self._fwd0) * 1e3]
                )
                recorded = True
        self._prev = (now, self.timer.total_s, 0.0, bs) if is_decode else None
        self._fwd0 = fwd
        self._launched_at = now
        return recorded

    def launched(self) -> None:
        """``run_batch`` of the batch passed to the last :meth:`launch` returned."""
        if self._prev is not None:
            t0, g0, _, bs = self._prev
            self._prev = (t0, g0, self._clock() - self._launched_at, bs)


# (module, attribute holding a function or class, method name or None)
_REGIONS_0_5_16 = (
    ("sglang.srt.speculative.eagle_worker_common", "generate_token_bitmask", None),
    ("sglang.srt.managers.scheduler_components.batch_result_processor", "SchedulerBatchResultProcessor",
     "_accept_grammar_tokens"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "build_mask"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "start_build"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "finish_build"),
)
_REGIONS_0_5_23 = (
    ("sglang.srt.speculative.eagle_worker_common", "build_grammar_vocab_mask", None),
    ("sglang.srt.managers.scheduler_components.batch_result_processor", "SchedulerBatchResultProcessor",
     "advance_grammar_fsm"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "build_mask"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "start_build"),
    ("sglang_eagle_overlap.core.step", "GrammarStep", "finish_build"),
)
# The model forward ("GPU work" on a CPU engine: it runs synchronously on the scheduler thread there).
_FORWARD = ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward")
_OPTIONAL_MODULE_PREFIX = "sglang_eagle_overlap."  # the product plugin may be absent


def _wrap_region(timer: GrammarTimer, module: str, attr: str, method: Optional[str]) -> Optional[str]:
    """Wrap one region in place; returns an error text when a required one is missing."""
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


class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.timer = GrammarTimer()
        self.forward = GrammarTimer(marker="__eo_forward_timed__")
        self.clock = StepClock(self.timer, forward=self.forward)
        self.errors: list[str] = []

    def write(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "steps": self.clock.steps, "errors": self.errors}, f)
        os.replace(tmp, self.path)


def install(scheduler: Any, sglang_version: tuple[int, ...]) -> None:
    """Wrap the scheduler's ``run_batch`` and the grammar regions (no-op without ``SGLANG_EO_STEP_TIMES_FILE``)."""
    path = os.environ.get(STEP_TIMES_ENV)
    if not path:
        return
    from sglang_eo_dev.cpu_runtime.stats import is_grammar_spec_decode  # here: the timing classes stay import-free

    rec = _Recorder(path)
    regions = _REGIONS_0_5_16 if sglang_version < (0, 5, 17) else _REGIONS_0_5_23
    for module, attr, method in regions:
        err = _wrap_region(rec.timer, module, attr, method)
        if err:
            rec.errors.append(f"grammar region not timed: {err}")
    try:  # the plugin's stats file is instrumentation: its write is not grammar work
        from sglang_eagle_overlap.core.step import GrammarStep

        if not getattr(GrammarStep.write_stats, rec.timer._marker, False):
            GrammarStep.write_stats = rec.timer.wrap_excluded(GrammarStep.write_stats)  # type: ignore[method-assign]
    except ImportError:
        pass
    err = _wrap_region(rec.forward, *_FORWARD)
    if err:
        rec.errors.append(f"forward not timed: {err}")

    run_batch = scheduler.run_batch
    # SGLANG_EO_STEP_TIMES_ALL=1: every speculative decode step counts, constrained or not (the scheduler-budget
    # benchmark compares the two kinds in one engine); otherwise only grammar ones.
    every_spec = os.environ.get(STEP_TIMES_ALL_ENV) == "1"

    def is_step(batch: Any) -> bool:
        if not every_spec:
            return is_grammar_spec_decode(batch)
        try:
            return batch is not None and not batch.spec_algorithm.is_none() and batch.forward_mode.is_decode()
        except AttributeError:
            return False

    def timed_run_batch(batch: Any, *args: Any, **kwargs: Any) -> Any:
        with rec.lock:
            bs = len(getattr(batch, "reqs", None) or [])
            recorded = rec.clock.launch(is_step(batch), bs)
            if recorded:
                rec.write()
        try:
            return run_batch(batch, *args, **kwargs)
        finally:
            rec.clock.launched()

    scheduler.run_batch = timed_run_batch
    rec.write()


def read_step_times(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The last records the scheduler wrote (``{"steps": [], "errors": []}`` when none yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {"steps": [], "errors": []}
