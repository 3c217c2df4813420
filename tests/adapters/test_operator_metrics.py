"""Operator metrics of the plugin's grammar work: per-step grammar time, its un-hidden part, mask time-limit hits --
in the stats snapshot, the periodic log line, the timeline, and Prometheus (SGLang's multiprocess directory).

``GrammarStep.copy_tree`` / ``build_mask`` are called directly with unconstrained requests (no grammar: no xgrammar
work, the step still runs every phase), a recording tree and a recording barrier.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from sglang_eagle_overlap import metrics as M
from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core import timeline as T
from sglang_eagle_overlap.core.step import GrammarStep


class _Tree:
    def __init__(self, bs: int, n: int = 4, wait_s: float = 0.0):
        self.bs, self.n, self.wait_s = bs, n, wait_s

    def resolve(self):
        time.sleep(self.wait_s)
        nxt = torch.full((self.bs, self.n), -1, dtype=torch.int64)
        return nxt, nxt.clone(), torch.zeros((self.bs, self.n), dtype=torch.int64)


@pytest.fixture
def fresh_state(tmp_path):
    return GrammarStep(probe=M.ForwardReadyProbe(), exporter=M.PrometheusExporter(),
                       timeline=T.Timeline(str(tmp_path / "tl.json")))


def _step(step, bs=3, barrier_s=0.002, wait_s=0.001):
    reqs = [MaskRequest(request_id=f"r{i}") for i in range(bs)]
    launch = torch.full((bs, 4), -1, dtype=torch.int64)
    step.copy_tree(launch, launch, torch.zeros_like(launch))  # the launch stamp (CPU tensors: no copy)
    time.sleep(0.001)  # the "forward" (synchronous on CPU)
    return step.build_mask(reqs, _Tree(bs, wait_s=wait_s), vocab_size=64, device=torch.device("cpu"),
                           barrier=lambda: time.sleep(barrier_s), draft_device=None)


def test_step_stats_and_snapshot_carry_grammar_and_unhidden_time(fresh_state):
    _step(fresh_state)
    _step(fresh_state)
    s = fresh_state.stats
    assert s.steps == 2
    assert s.advance_s >= 2 * 0.002 and s.tree_wait_s >= 2 * 0.001
    # CPU: the forward ran inside the launch call, so all of the grammar time was waited for by sampling.
    assert s.unhidden_s == pytest.approx(s.grammar_s, rel=0.05, abs=2e-4)
    snap = fresh_state.snapshot()
    assert snap["unhidden_s"] == s.unhidden_s and snap["mask_timeouts"] == 0
    per = s.per_step_ms()
    assert per["grammar_ms"] == pytest.approx(s.grammar_s / 2 * 1e3)
    assert per["unhidden_ms"] == pytest.approx(s.unhidden_s / 2 * 1e3)


def test_log_line_names_the_operator_numbers(fresh_state, caplog):
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        _step(fresh_state)
    line = next(r.getMessage() for r in caplog.records if "grammar verify steps" in r.getMessage())
    assert "not hidden by the forward" in line and "mask time-limit hits" in line
    assert f"{fresh_state.stats.per_step_ms()['unhidden_ms']:.3f} ms" in line


def test_mask_step_stamps_the_timeline_in_order(fresh_state):
    _step(fresh_state, bs=3)
    evs = fresh_state.timeline.events()
    names = [e[0] for e in evs]
    assert names == ["tree_copy", "advance", "tree_wait", "mask_build", "mask_upload", "sample"]
    starts = [e[1] for e in evs]
    assert starts == sorted(starts)
    for a, b in zip(evs[1:], evs[2:]):
        assert a[2] == b[1]  # phases are contiguous: one phase ends where the next starts
    assert evs[-1][3] == 3


def test_disabled_timeline_records_nothing_but_stats_still_count():
    step = GrammarStep(probe=M.ForwardReadyProbe(), timeline=T.Timeline(None))
    _step(step)
    assert step.timeline.events() == [] and step.stats.steps == 1


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
