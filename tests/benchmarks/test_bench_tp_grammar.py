"""Pure helpers of ``benchmarks/bench_tp_grammar.py`` (no engine): per-round per-rank grammar ms from cumulative
stats, the host sum over ranks, the medians, and the markdown rows (ratio vs TP 1, projection to TP 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_tp_grammar.py", "bench_tp_grammar")


def _stats(steps, adv, wait, mask):
    return {"steps": steps, "advance_s": adv, "tree_wait_s": wait, "mask_s": mask, "grammar_s": adv + wait + mask}


def test_per_round_is_per_step_per_rank_and_sums_ranks(bench):
    before = [_stats(10, 1.0, 0.0, 2.0), _stats(10, 1.5, 0.0, 2.5)]
    after = [_stats(14, 1.004, 0.0, 2.008), _stats(14, 1.508, 0.0, 2.516)]
    r = bench.per_round(before, after)
    assert [x["steps"] for x in r["ranks"]] == [4, 4]
    assert r["ranks"][0]["grammar_s"] == pytest.approx(3.0)  # (0.004 + 0.008) s / 4 steps = 3 ms
    assert r["ranks"][1]["grammar_s"] == pytest.approx(6.0)
    assert r["host_grammar_ms"] == pytest.approx(9.0)
    assert r["host_mask_ms"] == pytest.approx(2.0 + 4.0)
    assert r["host_advance_ms"] == pytest.approx(1.0 + 2.0)


def test_a_rank_without_steps_makes_the_round_unusable(bench):
    s = _stats(3, 0.1, 0.0, 0.1)
    assert bench.per_round([s, s], [_stats(5, 0.2, 0.0, 0.2), s]) is None


def test_summary_medians_and_markdown_ratio_and_projection(bench):
    def rnd(host):
        return {"ranks": [{"grammar_s": host}], "host_grammar_ms": host, "host_advance_ms": host / 4,
                "host_mask_ms": host * 3 / 4, "wall_ms_per_step": 10.0}

    runs = [{"tp": 1, "rounds": [rnd(1.0), rnd(2.0), rnd(3.0)]}, {"tp": 2, "rounds": [rnd(4.0), rnd(5.0), rnd(9.0)]}]
    rows = bench.summarize(runs)
    assert rows[1]["host_grammar_ms"] == 2.0 and rows[2]["host_grammar_ms"] == 5.0 and rows[2]["rounds"] == 3
    md = bench.markdown({"rows": rows, "machine": {"sglang": "x", "cores": 2}, "vocab": 1, "batch": 1, "rounds": 3,
                         "repeats": 1, "broadcast": [], "problems": []})
    assert "| 2 | 5.000 |" in md and "| 2.50x |" in md
    assert "| 8 (projected: 8 x TP 1) | 16.000 |" in md
