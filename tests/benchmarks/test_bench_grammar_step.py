"""``benchmarks/bench_grammar_step.py``'s pure parts, without running the benchmark: the llguidance table shows each
row's SGLang time and both plugin configurations with their ratio, and the backend picks its grammar objects."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_grammar_step.py", "bench_grammar_step")


def test_the_llguidance_table_has_a_line_per_row_with_times_and_ratios(bench):
    meta = dict(command="cmd", sglang="0.5.23", llguidance="1.9.1", torch="2", python="3.11", cpus=2, warmup=2,
                measured_steps=7, note="medians")
    rows = [dict(vocab=128000, grammar="nested", topk=4, steps=3, nodes=8, bs=32, sglang_ms=61.2, lockstep1_ms=29.6,
                 lockstep1_ratio=61.2 / 29.6, lockstep2_ms=21.6, lockstep2_ratio=61.2 / 21.6)]
    md = bench.render_guidance_md(meta, rows)
    assert "llguidance 1.9.1" in md and "`cmd`" in md
    assert "| 128k | nested | 4/3/8 | 32 | 61.20 | 29.60 (2.1×) | 21.60 (2.8×) |" in md.splitlines()


def test_the_backend_picks_sglangs_grammar_objects(bench):
    plan = bench.Plan(docs=[[1, 2, 3]], starts=[0], runs=[], trees=[])
    made = {type(g).__name__ for backend in ("xgrammar", "llguidance")
            for g in bench._grammars("nested", 32000, plan, 1, backend)}
    assert made == {"XGrammarGrammar", "GuidanceGrammar"}
