"""Pure helpers of the engine step benchmark (no engine): the scheduler-side step clock and the result summaries.

``sglang_eo_dev.cpu_runtime.step_times`` turns ``run_batch`` launches into decode-step records and counts grammar time
once across nested regions; ``benchmarks/bench_engine_step.py`` reduces those records to medians and ratios.
"""

from __future__ import annotations

import importlib.util
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
    assert sc.steps[0] == pytest.approx([30.0, 2.0, 10.0, 8.0, 1.0, 5.0])
    assert sc.steps[1] == pytest.approx([40.0, 0.0, 0.0, 16.0, 0.0, 0.0])


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
    launched = []

    class Scheduler:
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
    assert excluded == [step_times._EXCLUDED]
    assert got["errors"] == []  # 0.5.23's regions do not include the failing one
    step_times.install(Scheduler(), (0, 5, 16))  # another scheduler process appends; its region failure is reported
    assert step_times.read_step_times(path)["errors"] == ["grammar region not timed: missing"]
    with open(path, "a", encoding="utf-8") as f:
        f.write('[1.0, 2.0, 3.0, 4.0, 1.0]\n[1.0, 0.0')  # a last line still being written is skipped
    assert step_times.read_step_times(path)["steps"] == got["steps"] + [[1.0, 2.0, 3.0, 4.0, 1.0]]
    assert step_times.read_step_times(tmp_path / "none.jsonl") == {"pid": None, "steps": [], "errors": []}


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
