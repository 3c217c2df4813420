"""Pure helpers of the engine step benchmark (no engine): the scheduler-side step clock and the result summaries.

``sglang_eo_dev.cpu_runtime.step_times`` turns ``run_batch`` launches into decode-step records and counts grammar time
once across nested regions; ``benchmarks/bench_engine_step.py`` reduces those records to medians and ratios.
"""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    """Import a file by path: neither the benchmark nor the (self-contained) step_times module needs SGLang or an
    installed CPU runtime, so these tests run in any environment."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step_times = _load("eo_step_times", _ROOT / "dev" / "sglang_eo_dev" / "cpu_runtime" / "step_times.py")
bench = _load("bench_engine_step", _ROOT / "benchmarks" / "bench_engine_step.py")


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_grammar_timer_counts_nested_regions_once():
    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)
    calls = []

    @timer.wrap
    def advance():
        clock.t += 0.002
        calls.append("advance")

    @timer.wrap
    def build_mask():
        clock.t += 0.001
        advance()  # the barrier inside the mask build (0.5.23)
        clock.t += 0.003
        return "mask"

    assert build_mask() == "mask"
    assert timer.total_s == pytest.approx(0.006)
    clock.t += 1.0  # outside any region: not grammar time
    advance()
    assert timer.total_s == pytest.approx(0.008)
    assert calls == ["advance", "advance"]


def test_grammar_timer_closes_region_on_exception():
    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)

    @timer.wrap
    def rejects():
        clock.t += 0.004
        raise ValueError("token rejected")

    with pytest.raises(ValueError):
        rejects()
    clock.t += 1.0
    assert timer.total_s == pytest.approx(0.004)


def test_step_clock_records_only_decode_to_decode_intervals():
    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)
    forward = step_times.GrammarTimer(clock, marker="__eo_forward_timed__")
    sc = step_times.StepClock(timer, clock, forward=forward)
    region = timer.wrap(lambda dt: setattr(clock, "t", clock.t + dt))
    fwd = forward.wrap(lambda dt: setattr(clock, "t", clock.t + dt))

    assert sc.launch(is_decode=False, bs=8) is False  # prefill
    clock.t = 1.0
    assert sc.launch(is_decode=True, bs=8, grammar=True) is False  # first decode: nothing before it to close
    clock.t = 1.010
    sc.launched()  # run_batch took 10 ms
    region(0.002)  # grammar work in this iteration
    fwd(0.005)  # the model forward in this iteration
    clock.t = 1.030
    assert sc.launch(is_decode=True, bs=8) is True
    clock.t = 1.045
    sc.launched()
    clock.t = 1.070
    assert sc.launch(is_decode=False, bs=16) is False  # decode -> prefill: not a decode step
    clock.t = 5.0  # an idle wait, then decode again, unconstrained this time
    assert sc.launch(is_decode=True, bs=16, grammar=False) is False
    clock.t = 5.040
    assert sc.launch(is_decode=True, bs=16, grammar=True) is True  # the step of the unconstrained batch ends here

    assert len(sc.steps) == 2
    # without a tensor-op timer the device work is the forward alone, and no op is counted
    assert sc.steps[0] == pytest.approx([30.0, 2.0, 10.0, 8.0, 1.0, 5.0, 5.0, 0.0, 0.0, 0.0])
    assert sc.steps[1] == pytest.approx([40.0, 0.0, 0.0, 16.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


class _Ops:
    """The op timer's side of a step record, set by hand (``StepClock`` reads ``device_s``, ``count``, ``calls``,
    ``grammar_calls`` and ``overhead_s``)."""

    device_s = 0.0
    count = 0
    calls = 0
    grammar_calls = 0
    overhead_s = 2e-6


def test_step_clock_adds_the_op_timers_device_share_to_the_forward():
    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)
    forward = step_times.GrammarTimer(clock, marker="__eo_forward_timed__")
    ops = _Ops()
    sc = step_times.StepClock(timer, clock, forward=forward, ops=ops)
    fwd = forward.wrap(lambda dt: setattr(clock, "t", clock.t + dt))
    ops.device_s, ops.count, ops.calls, ops.grammar_calls = 0.5, 100, 400, 10  # before the first decode launch
    sc.launch(is_decode=True, bs=4)
    fwd(0.004)
    # 3 ms of device work in 30 ops, 500 calls x 2 us probe, 100 of them inside grammar regions
    ops.device_s, ops.count, ops.calls, ops.grammar_calls = 0.503, 130, 900, 110
    clock.t += 0.010
    assert sc.launch(is_decode=True, bs=4) is True
    assert sc.steps[-1] == pytest.approx([14.0, 0.0, 0.0, 4.0, 1.0, 4.0, 7.0, 30.0, 1.0, 0.2])


def _op_timer():
    clock = FakeClock()
    region = {"forward": 0, "grammar": 0}
    t = step_times.TensorOpTimer(lambda: region["forward"] > 0, lambda: region["grammar"] > 0, clock)
    return t, clock, region


def test_tensor_op_timer_splits_dispatch_from_device_work():
    """An op's time beyond this machine's per-op dispatch is device work; host-side calls (conversions, attribute
    reads) and calls inside a forward or grammar region are not timed at all."""
    t, clock, region = _op_timer()
    t.dispatch_s = 0.001

    def op(dt):
        clock.t += dt
        return "out"

    op.__name__ = "argmax"
    assert t._call(op, (0.011,), {}) == "out"
    assert t.device_s == pytest.approx(0.010) and t.count == 1
    t._call(op, (0.0005,), {})  # cheaper than a dispatch: no negative device time
    assert t.device_s == pytest.approx(0.010) and t.count == 2
    host = lambda: clock.__setattr__("t", clock.t + 0.5)  # noqa: E731
    host.__name__ = "tolist"
    t._call(host, (), {})
    region["grammar"] = 1  # inside a grammar region: the grammar timer has it, the probe's call is counted
    t._call(op, (0.5,), {})
    region["grammar"], region["forward"] = 0, 1  # inside the forward: device time, the probe's call included
    t._call(op, (0.5,), {})
    assert t.device_s == pytest.approx(0.010) and t.count == 2
    assert t.calls == 4  # the calls whose probe cost lands in the scheduler thread's CPU time
    assert t.grammar_calls == 1  # ... and the one of them whose cost lands in the grammar time


def test_tensor_op_timer_counts_a_kernel_as_one_op():
    """A stand-in kernel (one launch on a GPU, a Python loop of tensor ops here) is one op, its inner ops not timed;
    on another thread it is a plain call."""
    import threading

    t, clock, _ = _op_timer()
    t.dispatch_s = 0.001
    inner = lambda: clock.__setattr__("t", clock.t + 0.002)  # noqa: E731
    inner.__name__ = "__setitem__"

    def kernel(n):
        for _ in range(n):
            t._call(inner, (), {})
        return n

    assert t.kernel(kernel, (5,), {}) == 5
    assert t.count == 1 and t.device_s == pytest.approx(0.010 - 0.001)
    wrapped = t.wrap_kernel(kernel)
    assert wrapped(2) == 2 and t.count == 2 and wrapped.__name__ == "kernel"
    before = (t.count, t.device_s)
    th = threading.Thread(target=t.kernel, args=(lambda: clock.__setattr__("t", clock.t + 1.0), (), {}))
    th.start()
    th.join()
    assert (t.count, t.device_s) == before


def test_tensor_op_timer_times_torch_calls_of_its_thread_only():
    """The real torch function mode: a tensor op on the timer's thread is counted, ``tolist`` and attribute reads are
    not, another thread's ops are not; the calibration measures a one-element op."""
    import threading

    import torch
    t = step_times.TensorOpTimer(lambda: False)
    try:
        d, overhead = t.calibrate(reps=50)  # starts the mode
        assert d > 0 and overhead > 0 and t.count == 0 and t.device_s == 0.0 and t.calls == 0
        x = torch.ones(4)
        y = torch.argmax(x + 1)
        n = t.count
        assert n == 3  # ones, add, argmax
        y.tolist()
        _ = x.shape
        assert t.count == n and t.calls == n + 2
        th = threading.Thread(target=lambda: torch.ones(3) + 1)
        th.start()
        th.join()
        assert t.count == n
    finally:
        t._mode.__exit__(None, None, None)


def test_grammar_timer_times_only_its_own_thread():
    """The product plugin's grammar thread calls wrapped regions (SGLang's barrier -> advance_grammar_fsm): they must
    not count as scheduler-thread time, nor corrupt the owner's nesting."""
    import threading

    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)
    calls = []
    region = timer.wrap(lambda dt: (calls.append(threading.get_ident()), setattr(clock, "t", clock.t + dt)))
    t = threading.Thread(target=region, args=(0.5,))
    t.start()
    t.join()
    region(0.003)
    assert len(calls) == 2 and calls[0] != calls[1]  # both ran
    assert timer.total_s == pytest.approx(0.003)


def test_excluded_instrumentation_inside_a_region_does_not_count():
    clock = FakeClock()
    timer = step_times.GrammarTimer(clock)
    write = timer.wrap_excluded(lambda dt: setattr(clock, "t", clock.t + dt))

    def region_body():
        clock.t += 0.002
        write(0.010)  # the stats-file write, inside the mask step
        clock.t += 0.001

    timer.wrap(region_body)()
    assert timer.total_s == pytest.approx(0.003)
    write(0.5)  # outside any region: nothing to subtract, nothing added
    assert timer.total_s == pytest.approx(0.003)


def test_summaries_and_ratio():
    steps = [[10.0, 1.0, 9.0, 8], [20.0, 4.0, 18.0, 8], [30.0, 3.0, 27.0, 8], [99.0, 50.0, 90.0, 7]]
    full = bench.full_batch_steps(steps, 8)
    assert [s[0] for s in full] == [10.0, 20.0, 30.0]
    su = bench.summarize_steps(full)
    assert su["n"] == 3
    assert su["step_ms"] == 20.0
    assert su["grammar_ms"] == 3.0
    assert su["run_batch_ms"] == 18.0
    assert su["grammar_share"] == pytest.approx(0.1)  # median of 0.1, 0.2, 0.1
    assert su["grammar_share_total"] == pytest.approx(8.0 / 60.0)
    assert su["step_ms_p10"] == pytest.approx(12.0)
    assert su["step_ms_p90"] == pytest.approx(28.0)
    assert su["step_ms_mean"] == pytest.approx(20.0)
    assert bench.summarize_steps([]) == {"n": 0}

    off = bench.summarize_steps([[30.0, 3.0, 27.0, 8]])
    assert bench.ratio(off, su) == pytest.approx(1.5)
    assert bench.ratio(off, {"n": 0}) is None


def test_stats_deltas_and_plugin_per_step():
    before = {"steps": 10, "grammar_s": 0.010, "advance_s": 0.004, "tree_wait_s": 0.001, "mask_s": 0.005}
    after = {"steps": 14, "grammar_s": 0.018, "advance_s": 0.006, "tree_wait_s": 0.001, "mask_s": 0.011}
    d = bench.delta(after, before, bench.PLUGIN_KEYS)
    per = bench.plugin_per_step_ms(d)
    assert per == pytest.approx({"grammar_ms": 2.0, "advance_ms": 0.5, "tree_wait_ms": 0.0, "mask_ms": 1.5})
    assert bench.plugin_per_step_ms(bench.delta({}, {}, bench.PLUGIN_KEYS)) is None
    assert bench.delta({"grammar_decode_batches": 5}, {}, bench.COUNTER_KEYS) == {
        "grammar_decode_batches": 5, "overlap_disabled_grammar_decode_batches": 0}


class _Batch:
    """The attributes of a ``ScheduleBatch`` the step probe reads."""

    def __init__(self, spec: bool, decode: bool, grammar: bool, n: int) -> None:
        self.spec_algorithm = type("Spec", (), {"is_none": lambda _self, s=spec: not s})()
        self.forward_mode = type("Mode", (), {"is_decode": lambda _self, d=decode: d})()
        self.has_grammar = grammar
        self.reqs = [object()] * n


def test_spec_decode_kind_tells_grammar_from_unconstrained_decode():
    assert step_times.spec_decode_kind(_Batch(spec=True, decode=True, grammar=True, n=2)) is True
    assert step_times.spec_decode_kind(_Batch(spec=True, decode=True, grammar=False, n=2)) is False
    assert step_times.spec_decode_kind(_Batch(spec=True, decode=False, grammar=True, n=2)) is None  # prefill
    assert step_times.spec_decode_kind(_Batch(spec=False, decode=True, grammar=True, n=2)) is None  # no speculation
    assert step_times.spec_decode_kind(None) is None and step_times.spec_decode_kind(object()) is None


def test_install_appends_one_line_per_step_and_wraps_once(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_times.STEP_TIMES_ENV, str(path))
    wrapped_regions = []  # SGLang's own modules stay untouched in this test process
    monkeypatch.setattr(step_times, "_wrap_region", lambda timer, *where: wrapped_regions.append(where) or (
        "missing" if where[1] == "generate_token_bitmask" else None))
    excluded = []
    monkeypatch.setattr(step_times, "_exclude_region", lambda timer, *where: excluded.append(where))
    op_timers = []  # the torch function mode would stay on this test thread: recorded instead
    monkeypatch.setattr(step_times, "_time_tensor_ops", lambda rec: op_timers.append(rec.ops))
    launched = []

    class Scheduler:
        server_args = types.SimpleNamespace(device="cpu")

        def run_batch(self, batch):
            launched.append(batch)
            return len(launched)

    sched = Scheduler()
    step_times.install(sched, (0, 5, 23))
    wrapped = sched.run_batch
    step_times.install(sched, (0, 5, 23))  # the CPU runtime and the probe entry point may both install
    assert sched.run_batch is wrapped
    unc, gram, prefill = (_Batch(True, True, False, 3), _Batch(True, True, True, 3), _Batch(True, False, True, 3))
    for b in (prefill, unc, unc, gram, gram, prefill):
        sched.run_batch(b)
    assert launched == [prefill, unc, unc, gram, gram, prefill]  # the original ran once per call
    got = step_times.read_step_times(path)
    assert [(s[3], s[4]) for s in got["steps"]] == [(3.0, 0.0), (3.0, 0.0), (3.0, 1.0)]  # 3 decode -> decode steps
    assert all(s[0] >= 0 for s in got["steps"]) and got["pid"] is not None
    # once, for the first install only: the grammar regions, then the forward (the stats write excluded)
    assert wrapped_regions == list(step_times._REGIONS_0_5_23) + [step_times._FORWARD]
    assert excluded == list(step_times._EXCLUDED)
    assert len(op_timers) == 1 and op_timers[0] is not None  # the op timer started once, with the first install
    assert got["errors"] == []  # 0.5.23's regions do not include the failing one
    step_times.install(Scheduler(), (0, 5, 16))  # another scheduler process appends; its region failure is reported
    assert step_times.read_step_times(path)["errors"] == ["grammar region not timed: missing"]
    with open(path, "a", encoding="utf-8") as f:
        f.write('[1.0, 2.0, 3.0, 4.0, 1.0]\n[1.0, 0.0')  # a last line still being written is skipped
    assert step_times.read_step_times(path)["steps"] == got["steps"] + [[1.0, 2.0, 3.0, 4.0, 1.0]]
    empty = {"pid": None, "dispatch_us": None, "probe_overhead_us": None, "steps": [], "errors": [], "breakdown": []}
    assert step_times.read_step_times(tmp_path / "none.jsonl") == empty


def test_the_op_timer_runs_on_a_cpu_engine_only(tmp_path, monkeypatch):
    """A GPU engine's tensor ops are asynchronous launches (scheduler-thread CPU work): no torch function mode there."""
    monkeypatch.setenv(step_times.STEP_TIMES_ENV, str(tmp_path / "steps.jsonl"))
    monkeypatch.setattr(step_times, "_wrap_region", lambda *a: None)
    monkeypatch.setattr(step_times, "_exclude_region", lambda *a: None)
    started = []
    monkeypatch.setattr(step_times, "_time_tensor_ops", lambda rec: started.append(rec))
    for device in ("cuda", "cpu"):
        sched = types.SimpleNamespace(server_args=types.SimpleNamespace(device=device), run_batch=lambda b: b)
        step_times.install(sched, (0, 5, 16))
        assert len(started) == (device == "cpu")
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # no server args: the CPU runtime's switch decides
    step_times.install(types.SimpleNamespace(run_batch=lambda b: b), (0, 5, 16))
    assert len(started) == 2


def test_breakdown_times_each_call_whole_on_its_own_thread_under_the_launched_batch_size():
    """Each wrapped function's call is timed whole (a caller includes its callees), filed under the batch size set at
    the last launch (install flushes before it sets the next one); another thread's calls are not recorded; a flush
    hands over what was recorded since the last one (None when nothing was); the summary is calls per grammar step and
    the median and mean ms per call, by batch size."""
    import threading

    clock = FakeClock()
    bd = step_times.Breakdown(clock=clock)

    def inner():
        clock.t += 0.001

    inner = bd.wrap(inner)

    def outer(k):
        clock.t += 0.002
        for _ in range(k):
            inner()
        return k

    outer = bd.wrap(outer)
    assert bd.flush() is None
    bd.bs = 8
    assert outer(2) == 2
    first = bd.flush()  # the next launch: flushed first, filed under the size the calls ran at
    bd.bs = 64
    assert first == {"bs": 8, "calls": {"inner": [pytest.approx(0.001)] * 2, "outer": [pytest.approx(0.004)]}}
    assert bd.flush() is None
    worker = threading.Thread(target=outer, args=(3,))
    worker.start()
    worker.join()
    assert bd.flush() is None  # another thread's calls are not recorded
    outer(1)
    outer(0)
    second = bd.flush()
    assert second["bs"] == 64 and len(second["calls"]["outer"]) == 2 and len(second["calls"]["inner"]) == 1
    # a grammar step is an iteration that called the core's GrammarStep (the others found no grammar): renamed so
    unconstrained = {"bs": 64, "calls": {"entry": [0.5, 0.5]}}
    steps = [{"bs": r["bs"], "calls": {("GrammarStep." + k if k == "outer" else k): v for k, v in r["calls"].items()}}
             for r in (first, second)]
    got = step_times.breakdown_summary([steps[0], unconstrained, steps[1], unconstrained])
    assert got["8"]["inner"] == [2.0, pytest.approx(1.0), pytest.approx(1.0)]
    assert got["8"]["GrammarStep.outer"] == [1.0, pytest.approx(4.0), pytest.approx(4.0)]
    assert got["64"]["GrammarStep.outer"] == [2.0, pytest.approx(2.5), pytest.approx(2.5)]
    assert got["64"]["inner"] == [1.0, pytest.approx(1.0), pytest.approx(1.0)]
    skewed = step_times.breakdown_summary([{"bs": 1, "calls": {"GrammarStep.x": [0.001, 0.001, 0.010]}}])
    assert skewed["1"]["GrammarStep.x"] == [3.0, pytest.approx(1.0), pytest.approx(4.0)]  # median vs mean
    assert "entry" not in got["64"]


def test_install_with_a_breakdown_writes_one_line_per_loop_iteration(tmp_path, monkeypatch):
    """With ``BREAKDOWN_ENV`` set, install wraps the band's breakdown functions too (0.5.16's list on 0.5.16) and
    every ``run_batch`` writes what the functions did since the previous one, under the batch size they ran at."""
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv(step_times.STEP_TIMES_ENV, str(path))
    monkeypatch.setenv(step_times.BREAKDOWN_ENV, "1")
    breakdowns, asked = [], []

    def fake_wrap(timer, *where):
        if isinstance(timer, step_times.Breakdown):
            breakdowns.append(timer)
            asked.append(where)
        return "gone" if where[1:] == ("GrammarStep", "_collect") else None

    monkeypatch.setattr(step_times, "_wrap_region", fake_wrap)
    monkeypatch.setattr(step_times, "_exclude_region", lambda *a: None)
    monkeypatch.setattr(step_times, "_time_tensor_ops", lambda rec: None)
    calls = []

    class Scheduler:
        server_args = types.SimpleNamespace(device="cpu")

        def run_batch(self, batch):
            if batch.has_grammar:
                work()
            return batch

    sched = Scheduler()
    step_times.install(sched, (0, 5, 16))
    assert asked == list(step_times._BREAKDOWN_0_5_16) and len(set(map(id, breakdowns))) == 1
    work = breakdowns[0].wrap(lambda: calls.append(1))
    for b in (_Batch(True, True, True, 4), _Batch(True, True, True, 4), _Batch(True, True, False, 2),
              _Batch(True, True, True, 3)):
        sched.run_batch(b)
    got = step_times.read_step_times(path)
    # each line is written at the next launch: the last iteration's calls are still in memory
    assert [(r["bs"], {k: len(v) for k, v in r["calls"].items()}) for r in got["breakdown"]] == [
        (4, {"<lambda>": 1}), (4, {"<lambda>": 1})]
    assert got["errors"] == ["breakdown function not timed: gone"] and len(calls) == 3


@pytest.mark.parametrize("targets", ["_BREAKDOWN_0_5_16", "_BREAKDOWN_0_5_23"])
def test_every_breakdown_function_exists_in_the_plugin(targets):
    """A renamed plugin function would drop out of the breakdown (reported as an error line at run time): every target
    names a function of this checkout's package."""
    import importlib

    for module, attr, method in getattr(step_times, targets):
        owner = getattr(importlib.import_module(module), attr)
        assert callable(owner if method is None else owner.__dict__.get(method)), (module, attr, method)


def test_install_without_the_env_variable_changes_nothing(monkeypatch):
    monkeypatch.delenv(step_times.STEP_TIMES_ENV, raising=False)

    class Scheduler:
        def run_batch(self, batch):
            return batch

    sched = Scheduler()
    original = sched.run_batch
    step_times.install(sched, (0, 5, 16))
    assert sched.run_batch == original and not hasattr(sched, "_eo_step_times_installed")


def test_probe_distribution_is_found_by_the_plugin_loader_in_a_fresh_process(tmp_path):
    """What SGLang's loader does (``entry_points(group="sglang.srt.plugins")``, then importing the target), in a fresh
    interpreter without site-packages whose path is only the written folder: the entry point is there, its module
    imports from the folder, and the dev folder's CPU ``sgl_kernel`` stand-in is not reachable (on a GPU host it
    would shadow the real kernels)."""
    import json
    import subprocess
    import sys

    d = step_times.write_probe_distribution(tmp_path / "probe")
    assert step_times.write_probe_distribution(tmp_path / "probe") == d  # a second call (second engine) is fine
    name, target = step_times.PROBE_ENTRY_POINT
    code = (
        "import importlib, importlib.util, json; from importlib.metadata import entry_points\n"
        "eps = {e.name: e for e in entry_points(group='sglang.srt.plugins')}\n"
        f"fn = eps[{name!r}].load()\n"
        "print(json.dumps({'eps': {k: e.value for k, e in eps.items()}, 'fn': fn.__module__ + ':' + fn.__name__,"
        " 'file': importlib.import_module(fn.__module__).__file__,"
        " 'sgl_kernel': importlib.util.find_spec('sgl_kernel') is not None}))"
    )
    env = {"PYTHONPATH": d, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["eps"] == {name: target} and got["fn"] == target
    assert got["file"].startswith(str(tmp_path / "probe")) and got["sgl_kernel"] is False
    assert sorted(p.name for p in (tmp_path / "probe").iterdir()) == ["sglang_eo_dev",
                                                                      "sglang_eo_step_times_probe-0.0.dist-info"]


def test_a_compiled_function_runs_without_the_mode_and_counts_as_one_op():
    """Dynamo's guards see a torch function mode, and a compiled graph run under one turned into thousands of separate
    calls (measured: ~13k per ``_select_top_k_tokens_later``): a compiled helper runs with the mode lifted, timed as one
    op, and the mode is back for the next call."""
    import torch
    from torch.overrides import _get_current_function_mode_stack

    t = step_times.TensorOpTimer(lambda: False)
    seen = []

    def helper(x):
        seen.append(len(_get_current_function_mode_stack()))
        return x * 2

    try:
        t.calibrate(reps=20)
        x = torch.ones(2)
        compiled, plain = t.wrap_kernel(helper, compiled=True), t.wrap_kernel(helper)
        c0 = t.count
        y = compiled(x)
        plain(x)
        assert seen == [0, 1] and t.count == c0 + 2  # lifted for the compiled one only; each one op
        calls = t.calls
        x + 1
        assert t.calls == calls + 1 and t.count == c0 + 3  # the mode is back
        assert y.tolist() == [2.0, 2.0]
    finally:
        t._mode.__exit__(None, None, None)


def test_compiled_sglang_functions_are_wrapped_and_nothing_else():
    """The scan of loaded SGLang modules: a ``torch.compile``'d function is wrapped (one op, mode lifted) in every
    module that holds it; a plain function, an object that answers every attribute (an import stand-in: one once
    crashed the scheduler at start) and modules outside SGLang are left alone."""
    import torch

    @torch.compile(dynamic=True)
    def compiled(x):
        return x + 1

    def plain(x):
        return x

    class AnswersEverything:
        def __getattr__(self, name):
            return self

        def __call__(self, *a, **k):
            return self

    stand_in = AnswersEverything()
    mods = []
    for name in ("sglang.eo_fake_a", "sglang.eo_fake_b", "other.eo_fake"):
        mod = types.ModuleType(name)
        mod.compiled, mod.plain, mod.stand_in = compiled, plain, stand_in
        mods.append((name, mod))
    t = step_times.TensorOpTimer(lambda: False)
    step_times._wrap_compiled(types.SimpleNamespace(ops=t), mods + [("sglang.gone", None)])
    (_, a), (_, b), (_, other) = mods
    assert a.compiled is b.compiled and getattr(a.compiled, "__eo_kernel_timed__", False)
    assert a.compiled.__wrapped__ is compiled and other.compiled is compiled
    assert a.plain is plain and a.stand_in is stand_in  # (calling the compiled one would compile: seconds)


def test_step_profile_covers_grammar_decode_iterations_only_and_compares_per_step(tmp_path):
    """The step probe's profile records only the loop iterations launched with a grammar decode batch, one profile per
    batch size, written every ``every`` steps with its step count; ``profile_compare.per_step`` turns it into calls and
    own time per step of the plugin's functions, and files a builtin's calls under its plugin caller."""
    pkg = tmp_path / "src" / "sglang_eagle_overlap"
    pkg.mkdir(parents=True)
    (pkg / "probed.py").write_text("def work(xs):\n    return len(xs)\n")
    probed = _load("eo_probed", pkg / "probed.py")
    out = tmp_path / "prof"
    out.mkdir()
    profile = step_times.StepProfile(str(out), every=2)
    profile.launch(True, 8)
    probed.work([1])
    probed.work([1, 2])
    profile.launch(False, 8)  # an unconstrained iteration: not profiled
    for _ in range(5):
        probed.work([])
    profile.launch(True, 8)
    probed.work([3])
    profile.launch(True, 64)  # the second bs-8 step ends: written
    probed.work([4])
    profile.launch(False, 64)  # one bs-64 step: not yet written (every 2)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{os.getpid()}_bs8.{ext}" for ext in ("json", "prof"))
    compare = _load("profile_compare", _ROOT / "benchmarks" / "profile_compare.py")
    sides = compare.per_step(out, 8)
    assert len(sides) == 1
    (funcs,) = sides.values()
    assert funcs[("probed.py", "work")][0] == pytest.approx(1.5)  # 3 calls over 2 steps
    assert funcs[("probed.py", "work > <built-in method builtins.len>")][0] == pytest.approx(1.5)
    assert compare.per_step(out, 64) == {}
