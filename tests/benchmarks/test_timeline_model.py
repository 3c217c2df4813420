"""The CPU-engine summary of ``benchmarks/timeline.py``: per-bs medians, the CPU decomposition (measured constrained
step vs measured unconstrained step + grammar phases + mask application), the merge of the committed-run JSONs and
the step the plot draws (no engine, no SGLang, no matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tl():
    yield from loaded_script(ROOT / "benchmarks" / "timeline.py", "bench_timeline")


def _events(constrained_period_s: float = 0.014, n: int = 4, bs: int = 2, t0: float = 1.0):
    """From ``t0`` s on, unconstrained: ``n`` forwards 10 ms apart; 1 s later, constrained: launches
    ``constrained_period_s`` apart, each with a 4 ms forward, 1 ms advance, 1 ms mask build, the sampling point, then
    1 ms of mask application."""
    events = [("forward", t0 + 0.010 * i, t0 + 0.004 + 0.010 * i, bs, False) for i in range(n)]
    for i in range(n):
        L = t0 + 1.0 + constrained_period_s * i
        events += [("forward", L, L + 0.004, bs, True), ("advance", L + 0.004, L + 0.005, bs, True),
                   ("mask_build", L + 0.005, L + 0.006, bs, True), ("sample", L + 0.006, L + 0.006, bs, True),
                   ("mask_apply", L + 0.006, L + 0.007, bs, True)]
    return events


def test_summary_medians_and_the_cpu_decomposition_name_the_unaccounted_time(tl):
    row = tl.summarize(_events(0.014))["by_bs"][2]
    assert row["steps"] == 4
    assert row["grammar_ms"] == pytest.approx(2.0) and row["apply_ms"] == pytest.approx(1.0)
    assert row["phase_ms"]["advance"] == pytest.approx(1.0) and row["phase_ms"]["mask_build"] == pytest.approx(1.0)
    assert row["phase_ms"]["tree_wait"] == 0 and row["forward_ms"] == pytest.approx(4.0)
    assert row["free_period_ms"] == pytest.approx(10.0) and row["period_ms"] == pytest.approx(14.0)
    # parts: 10 unconstrained + 2 grammar + 1 apply = 13 ms of the measured 14 ms: 1 ms not in any recorded phase
    assert row["parts_ms"] == pytest.approx(13.0)
    assert row["unaccounted_ms"] == pytest.approx(1.0)
    assert row["unaccounted_share"] == pytest.approx(1.0 / 14.0)


def test_decomposition_is_negative_when_the_parts_exceed_the_step_and_absent_without_a_peer(tl):
    row = tl.summarize(_events(0.012))["by_bs"][2]
    assert row["unaccounted_ms"] == pytest.approx(-1.0)  # 12 ms measured < 13 ms of parts
    only_constrained = [e for e in _events() if e[4]]
    row = tl.summarize(only_constrained)["by_bs"][2]
    assert row["free_period_ms"] is None
    assert not set(tl.DECOMPOSITION) & set(row)
    assert tl.decompose({"period_ms": 14.0, "free_period_ms": None, "grammar_ms": 1.0, "apply_ms": 0.0}) is None


def _write_run(path: Path, summary, **row_extra):
    for r in summary["by_bs"].values():
        r.update(row_extra)
    path.write_text(json.dumps({"meta": {"command": "cmd", "machine": "m", "sglang": "0.5.23", "xgrammar": "x"},
                                **summary}))


def test_load_runs_recomputes_the_decomposition_and_drops_stray_batch_sizes(tl, tmp_path):
    summary = tl.summarize(_events(0.014) + _events(0.014, n=2, bs=5, t0=5.0))
    assert set(summary["by_bs"]) == {2, 5}
    # a file from before the decomposition: its old keys go, the new ones are computed from the medians
    for r in summary["by_bs"].values():
        for k in tl.DECOMPOSITION:
            r.pop(k)
    _write_run(tmp_path / "timeline_0.5.23_plugin.json", summary, predicted_period_ms=99.0, prediction_error=0.5)
    (tmp_path / "timeline_0.5.23_stock.json").write_text(json.dumps({"meta": {}, "by_bs": {}, "steps": []}))
    (tmp_path / "unrelated.json").write_text("{}")
    runs = tl.load_runs(tmp_path)
    assert set(runs) == {"0.5.23-plugin", "0.5.23-stock"}
    rows = runs["0.5.23-plugin"]["by_bs"]
    assert set(rows) == {"2"}  # bs 5 had 2 steps
    assert "predicted_period_ms" not in rows["2"] and "prediction_error" not in rows["2"]
    assert rows["2"]["unaccounted_ms"] == pytest.approx(1.0)
    md = tl.render_md(runs)
    assert "| 0.5.23-plugin | 2 | 4 | 1.00 | 0.00 | 1.00 |" in md
    assert "| 14.00 | 10.00 | 13.00 | +1.00 (+7.1%) |" in md
    assert "TPOT" not in md and "Predicted" not in md


def test_representative_step_skips_batch_starts_and_steps_missing_phases(tl):
    def step(bs, grammar_ms, phases=("advance", "mask_build"), period=10.0):
        return {"bs": bs, "grammar_ms": grammar_ms, "period_ms": period, "phases": {p: [[0.0, 1.0]] for p in phases}}

    steps = [step(4, 0.1), step(8, 9.0), step(8, 3.0), step(8, 1.0, phases=("advance",)), step(8, 2.0),
             step(8, 4.0), step(8, 5.0, period=None)]
    # index 1 starts the bs-8 batch (previous step is bs 4); index 3 lacks a phase; the rest sorted: 2, 3, 4, 5 ->
    # the one at len // 2: 4
    assert tl.representative(steps, 8)["grammar_ms"] == 4.0
    assert tl.representative(steps, 4)["grammar_ms"] == 0.1  # no step follows another bs-4 step: all of them
    assert tl.representative(steps, 16) is None
    # the recording's first step is a batch start even when the last step has the same bs (no wrap-around to [-1])
    assert tl.representative([step(8, 1.5), step(8, 1.0), step(8, 2.0)], 8)["grammar_ms"] == 2.0
