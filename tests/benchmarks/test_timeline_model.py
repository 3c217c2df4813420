"""The TPOT prediction model and the CPU-engine summary of ``benchmarks/timeline.py`` (no engine, no SGLang)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tl():
    yield from loaded_script(ROOT / "benchmarks" / "timeline.py", "bench_timeline")


def test_interpolate_hits_points_and_extrapolates_linearly(tl):
    pts = [(1, 1.0), (8, 8.0), (32, 16.0)]
    assert tl.interpolate(pts, 8) == pytest.approx(8.0)
    assert tl.interpolate(pts, 20) == pytest.approx(12.0)
    assert tl.interpolate(pts, 64) == pytest.approx(16.0 + 32 * 8 / 24)  # slope of the last segment
    assert tl.interpolate(pts, 0) == pytest.approx(0.0)
    assert tl.interpolate([(4, 3.0)], 100) == 3.0


def test_gpu_model_is_memory_bound_then_compute_bound(tl):
    gpu = tl.GpuModel(decode_ms=6.0, per_token_us=50.0, draft_tokens=4)
    assert gpu.verify_ms(1) == 6.0 and gpu.verify_ms(30) == 6.0  # 120 tokens x 50 us = 6 ms: still the floor
    assert gpu.verify_ms(64) == pytest.approx(64 * 4 * 0.05)


def test_default_gpu_model_matches_the_published_eagle3_throughput(tl):
    gpu = tl.GpuModel()
    tok_s = 1e3 / (tl.step_ms("overlap", gpu, 1, 0.0) / gpu.accept_len)
    assert tok_s == pytest.approx(373.25, rel=0.10)  # SGLang docs: EAGLE3, Llama-3.1-8B, 1x H100


def test_step_time_sync_adds_and_overlap_hides_up_to_the_verify(tl):
    gpu = tl.GpuModel(decode_ms=10.0, draft_steps=2, draft_step_ms=1.0)
    assert tl.step_ms("sync", gpu, 1, 4.0) == pytest.approx(2 + 10 + 4)
    assert tl.step_ms("overlap", gpu, 1, 4.0) == pytest.approx(2 + 10)
    assert tl.step_ms("overlap", gpu, 1, 13.0, serial_ms=0.5) == pytest.approx(2 + 13 + 0.5)
    with pytest.raises(ValueError, match="sync"):
        tl.step_ms("async", gpu, 1, 1.0)


def test_predict_marks_where_grammar_stops_being_hidden(tl):
    gpu = tl.GpuModel(decode_ms=10.0, per_token_us=0.0, draft_steps=0, accept_len=2.0)
    costs = {"sglang_ms": [(1, 0.5), (64, 32.0)], "lockstep1_ms": [(1, 0.1), (64, 6.4)]}  # 0.5 / 0.1 ms per request
    pred = tl.predict(costs, gpu, range(1, 65))
    stock16, stock23 = pred["paths"]["0.5.16-stock"], pred["paths"]["0.5.23-stock"]
    plugin = pred["paths"]["0.5.23-plugin"]
    assert stock23["first_unhidden_bs"] == 21  # 0.5 * bs > 10 from bs 21
    assert plugin["first_unhidden_bs"] is None  # 6.4 ms at bs 64 < 10 ms
    assert stock16["first_unhidden_bs"] is None and stock16["mode"] == "sync"
    for b in range(64):
        assert plugin["rows"][b]["tpot_ms"] == pytest.approx(pred["paths"]["0.5.16-plugin"]["rows"][b]["tpot_ms"])
        assert plugin["rows"][b]["tpot_ms"] <= stock23["rows"][b]["tpot_ms"] <= stock16["rows"][b]["tpot_ms"]
        assert plugin["rows"][b]["tpot_ms"] == pytest.approx(plugin["unconstrained_tpot_ms"][b])  # fully hidden
    assert stock16["rows"][0]["tpot_ms"] == pytest.approx((10 + 0.5) / 2)
    assert stock23["rows"][39]["tpot_ms"] == pytest.approx(20.0 / 2)  # bs 40: 20 ms grammar > 10 ms verify


def test_summary_predicts_constrained_steps_from_free_steps_plus_grammar(tl):
    events = []
    # unconstrained: 4 forwards 10 ms apart at bs 2; constrained: launches 13 ms apart with 3 ms of grammar each
    events += [("forward", 1.0 + 0.010 * i, 1.004 + 0.010 * i, 2, False) for i in range(4)]
    for i in range(4):
        L = 2.0 + 0.013 * i
        events += [("forward", L, L + 0.004, 2, True), ("advance", L + 0.004, L + 0.005, 2, True),
                   ("mask_build", L + 0.005, L + 0.006, 2, True), ("sample", L + 0.006, L + 0.006, 2, True),
                   ("mask_apply", L + 0.006, L + 0.007, 2, True)]
    row = tl.summarize(events)["by_bs"][2]
    assert row["steps"] == 4
    assert row["grammar_ms"] == pytest.approx(2.0) and row["apply_ms"] == pytest.approx(1.0)
    assert row["free_period_ms"] == pytest.approx(10.0) and row["period_ms"] == pytest.approx(13.0)
    assert row["predicted_period_ms"] == pytest.approx(13.0) and row["prediction_error"] == pytest.approx(0.0, abs=1e-9)
    assert row["phase_ms"]["advance"] == pytest.approx(1.0) and row["phase_ms"]["tree_wait"] == 0


def test_grammar_cost_points_read_the_committed_benchmark(tl):
    costs = tl.grammar_cost_points(ROOT / "benchmarks" / "results" / "grammar_step.json")
    assert [b for b, _ in costs["sglang_ms"]] == [1, 8, 32, 64]
    assert all(v > 0 for _, v in costs["sglang_ms"] + costs["lockstep1_ms"])
    with pytest.raises(ValueError, match="no rows"):
        tl.grammar_cost_points(ROOT / "benchmarks" / "results" / "grammar_step.json", vocab=7)
