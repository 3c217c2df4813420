"""Operator metrics of the plugin's grammar work: per-step grammar time, its un-hidden part, mask time-limit hits --
in the stats snapshot, the periodic log line, the timeline, and Prometheus (SGLang's multiprocess directory).

``GrammarStep.copy_tree`` / ``build_mask`` are called directly with unconstrained requests (no grammar: no xgrammar
work, the step still runs every phase), a tree whose wait and a barrier whose work take known durations on a clock
only the test moves (``core.step``'s and the timeline's ``perf_counter``), so every reported number is known by hand.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_eagle_overlap import metrics as M
from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core import step as step_mod
from sglang_eagle_overlap.core import telemetry as telemetry_mod
from sglang_eagle_overlap.core import timeline as T
from sglang_eagle_overlap.core.step import GrammarStep
from sglang_eo_dev.helpers.clocks import FakeTime
from sglang_eo_dev.helpers.steps import make_step


class _Clock(FakeTime):
    """Stands in for the ``time`` module of the step and the timeline, moved only by the phases below; ``mask_s`` is
    what the next mask build takes on it."""

    mask_s = 0.0


@pytest.fixture
def clock(monkeypatch):
    """The test's clock, and a mask build that takes ``clock.mask_s`` on it (the phase after the tree wait)."""
    c = _Clock()
    monkeypatch.setattr(step_mod, "time", c)
    monkeypatch.setattr(telemetry_mod, "time", c)
    monkeypatch.setattr(T, "time", c)
    finish = TreeMaskBuilder.finish

    def timed_finish(self, *args, **kwargs):
        c.now += c.mask_s
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(TreeMaskBuilder, "finish", timed_finish)
    return c


class _Tree:
    """A pending tree copy whose wait takes ``wait_s`` on the test's clock."""

    def __init__(self, clock: _Clock, bs: int, wait_s: float, n: int = 4):
        self.clock, self.bs, self.n, self.wait_s = clock, bs, n, wait_s

    def resolve(self):
        self.clock.now += self.wait_s
        nxt = torch.full((self.bs, self.n), -1, dtype=torch.int64)
        return nxt, nxt.clone(), torch.zeros((self.bs, self.n), dtype=torch.int64)


@pytest.fixture
def fresh_state(tmp_path):
    return make_step(probe=M.ForwardReadyProbe(), exporter=M.PrometheusExporter(),
                     timeline=T.Timeline(str(tmp_path / "tl.json")))


def _step(step, clock, bs=3, barrier_s=0.5, wait_s=0.25, mask_s=0.125):
    """One verify step on the CPU: barrier, tree wait and mask build take the given seconds; 1000 s pass first (the
    forward and whatever else the scheduler did, none of it the grammar's)."""
    reqs = [MaskRequest(request_id=f"r{i}") for i in range(bs)]
    launch = torch.full((bs, 4), -1, dtype=torch.int64)
    step.copy_tree(launch, launch, torch.zeros_like(launch))  # the launch stamp (CPU tensors: no copy)
    clock.now += 1000.0  # the "forward" (synchronous on CPU)
    clock.mask_s = mask_s

    def barrier():
        clock.now += barrier_s

    return step.build_mask(reqs, _Tree(clock, bs, wait_s), vocab_size=64, device=torch.device("cpu"),
                           barrier=barrier, draft_device=None)


def test_step_stats_and_snapshot_carry_grammar_and_unhidden_time(fresh_state, clock):
    """Two steps: barrier 0.5 + 1.5 s, tree wait 0.25 + 0.75 s, mask 0.125 + 0.375 s. Per step on average: advance
    1000 ms, tree wait 500 ms, mask 250 ms, grammar 1750 ms; on a CPU the forward ran inside the launch call, so
    sampling waited for all of the grammar time (un-hidden 1750 ms), all of it on the scheduler thread (inline)."""
    _step(fresh_state, clock)
    assert fresh_state.telemetry.stats.last == {"advance_s": 0.5, "tree_wait_s": 0.25, "mask_s": 0.125, "bs": 3.0,
                                      "unhidden_s": 0.875}
    _step(fresh_state, clock, barrier_s=1.5, wait_s=0.75, mask_s=0.375)
    s = fresh_state.telemetry.stats
    assert s.steps == 2
    assert (s.advance_s, s.tree_wait_s, s.mask_s, s.grammar_s) == (2.0, 1.0, 0.5, 3.5)
    assert s.unhidden_s == 3.5 and s.sched_s == 3.5
    snap = fresh_state.telemetry.snapshot()
    assert snap["unhidden_s"] == 3.5 and snap["grammar_s"] == 3.5 and snap["mask_timeouts"] == 0
    assert s.per_step_ms() == {"grammar_ms": 1750.0, "unhidden_ms": 1750.0, "advance_ms": 1000.0,
                               "tree_wait_ms": 500.0, "mask_ms": 250.0, "sched_ms": 1750.0, "join_wait_ms": 0.0,
                               "helper_gil_ms": 0.0, "handoff_ms": 0.0}


def test_per_step_means_are_zero_before_the_first_step():
    assert set(make_step().telemetry.stats.per_step_ms().values()) == {0.0}


def test_log_line_names_the_operator_numbers(fresh_state, clock, caplog):
    """The first step's line: barrier 0.5 s, tree wait 0.25 s, mask 0.125 s, all of it un-hidden on a CPU."""
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        _step(fresh_state, clock)
    line = next(r.getMessage() for r in caplog.records if "grammar verify steps" in r.getMessage())
    assert line.startswith("sglang-eagle-overlap: 1 grammar verify steps; per step: grammar 875.000 ms (advance "
                           "500.000, tree wait 250.000, mask 125.000), on the scheduler thread 875.000 ms"), line
    assert "not hidden by the forward 875.000 ms; 0 mask time-limit hits" in line, line


def test_mask_step_stamps_the_timeline_in_order(fresh_state, clock):
    """The spans of one step, contiguous, each as long as its phase took: advance 0.5 s, tree wait 0.25 s, mask build
    0.125 s, upload 0 s (no mask on the CPU), then the sample point; the tree copy 1000 s (the forward) before."""
    t_copy = clock.now
    _step(fresh_state, clock, bs=3)
    evs = fresh_state.telemetry.timeline.events()
    names = [e[0] for e in evs]
    assert names == ["tree_copy", "advance", "tree_wait", "mask_build", "mask_upload", "sample"]
    assert [(e[1], e[2]) for e in evs] == [(t_copy, t_copy), (t_copy + 1000.0, t_copy + 1000.5),
                                           (t_copy + 1000.5, t_copy + 1000.75), (t_copy + 1000.75, t_copy + 1000.875),
                                           (t_copy + 1000.875, t_copy + 1000.875),
                                           (t_copy + 1000.875, t_copy + 1000.875)]
    assert all(e[3] == 3 for e in evs[1:])


def test_disabled_timeline_records_nothing_but_stats_still_count(clock):
    step = make_step(probe=M.ForwardReadyProbe(), timeline=T.Timeline(None))
    _step(step, clock)
    assert step.telemetry.timeline.events() == [] and step.telemetry.stats.steps == 1 and step.telemetry.stats.grammar_s == 0.875


class _FakeEvent:
    """A CUDA event stand-in: ``done`` toggled by the test, ``elapsed_time`` in ms from a fixed GPU clock."""

    def __init__(self, gpu_ms: float):
        self.gpu_ms, self.done = gpu_ms, False

    def query(self):
        return self.done

    def elapsed_time(self, other):
        return other.gpu_ms - self.gpu_ms


def test_probe_with_events_reads_the_forward_duration_lazily(monkeypatch):
    probe = M.ForwardReadyProbe()
    made = []

    def record(device):
        if device is None:
            return None
        made.append(_FakeEvent(gpu_ms=[0.0, 8.0][len(made) % 2]))  # start at 0, end at 8 ms: an 8 ms forward
        return made[-1]

    monkeypatch.setattr(M.ForwardReadyProbe, "_record", staticmethod(record))
    monkeypatch.setattr(M.time, "perf_counter", lambda: 100.0)
    probe.on_launch("cuda")  # host launch at t=100 s
    probe.on_mask_start("cuda", 100.001)
    assert probe.on_mask_ready(100.010) == 0.0  # forward not finished yet: nothing known
    made[1].done = True
    monkeypatch.setattr(M.time, "perf_counter", lambda: 100.020)
    probe.on_launch("cuda")
    probe.on_mask_start("cuda", 100.021)
    # first step: forward ready at 100 + 0.008 s, mask ready at 100.010 -> 2 ms not hidden; second still pending
    assert probe.on_mask_ready(100.025) == pytest.approx(0.002)
    made[3].done = True
    probe.on_launch("cuda")
    probe.on_mask_start("cuda", 100.030)
    # second step: ready at 100.020 + 0.008 = 100.028 < mask 100.025 -> fully hidden (0); third pending
    assert probe.on_mask_ready(100.031) == 0.0


def test_probe_does_not_guess_for_a_cuda_step_without_a_launch_stamp():
    probe = M.ForwardReadyProbe()
    probe.on_mask_start("cuda:0", 5.0)  # no on_launch: a tree the plugin did not copy before the launch
    assert probe.on_mask_ready(5.003) == 0.0


def test_probe_without_events_counts_from_the_mask_start():
    probe = M.ForwardReadyProbe()
    probe.on_launch(None)
    probe.on_mask_start(None, 5.0)
    assert probe.on_mask_ready(5.003) == pytest.approx(0.003)


def test_prometheus_counters_land_in_the_multiprocess_directory(tmp_path, monkeypatch):
    import prometheus_client  # SGLang depends on it: present wherever SGLang is
    from prometheus_client import CollectorRegistry, multiprocess
    from prometheus_client import values as pc_values

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(pc_values, "ValueClass", pc_values.get_value_class())  # pick up the multiprocess mode
    monkeypatch.setattr(prometheus_client.metrics, "values", pc_values, raising=False)
    registry = prometheus_client.REGISTRY
    before = set(registry._names_to_collectors)
    try:
        exp = M.PrometheusExporter()
        assert exp.enabled
        exp.observe_step(0.004, 0.001, 2)
        exp.observe_step(0.002, 0.0, 0)
        collected = CollectorRegistry()
        multiprocess.MultiProcessCollector(collected, path=str(tmp_path))
        values = {s.name: s.value for m in collected.collect() for s in m.samples}
    finally:
        for name in set(registry._names_to_collectors) - before:
            try:
                registry.unregister(registry._names_to_collectors[name])
            except KeyError:
                pass
    assert values["sglang_eagle_overlap:grammar_steps_total"] == 2
    assert values["sglang_eagle_overlap:grammar_seconds_total"] == pytest.approx(0.006)
    assert values["sglang_eagle_overlap:grammar_unhidden_seconds_total"] == pytest.approx(0.001)
    assert values["sglang_eagle_overlap:mask_timeouts_total"] == 2


def test_prometheus_is_inert_without_sglang_metrics(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    exp = M.PrometheusExporter()
    assert not exp.enabled
    exp.observe_step(1.0, 1.0, 1)  # no error, nothing registered
