"""Pure parts of ``benchmarks/bench_grammar_backends.py`` (no engine): the fresh schemas of the first-token trials,
the variants per xgrammar, the per-request division of the plugin's time-limit hits, the step summaries and the
markdown writer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_grammar_backends.py", "bench_grammar_backends")


@pytest.fixture(scope="module")
def instances():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_mask_states import make_instance

    return [make_instance(64 + k, seed=k) for k in range(3)]


def test_fresh_schemas_are_new_texts_of_the_same_language(bench, instances):
    texts = [bench.fresh_schema(v, i) for v in ("xgrammar", "llguidance") for i in range(4)]
    plain = json.dumps(bench.BENCH_SCHEMA)
    assert len(set(texts)) == len(texts) and plain not in texts  # every trial misses a cache keyed on the text
    assert bench.fresh_schema("xgrammar", 2) == bench.fresh_schema("xgrammar", 2)  # deterministic per (tag, trial)
    bad = dict(instances[0], id="abc-1234")  # the id pattern still applies
    short = dict(instances[0], log=instances[0]["log"][:63])  # minItems 64 still applies
    long_m = dict(instances[0], log=[dict(instances[0]["log"][0], m="x" * 13)] * 64)  # maxLength 12 still applies
    for text in texts:
        schema = json.loads(text)
        assert {k: v for k, v in schema.items() if k != "description"} == bench.BENCH_SCHEMA
        assert isinstance(schema["description"], str)  # an annotation: it admits what BENCH_SCHEMA admits
        for doc in instances:
            jsonschema.validate(doc, schema)
        for doc in (bad, short, long_m):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(doc, schema)
    assert bench.BENCH_SCHEMA.get("description") is None  # the shared schema is left alone


def test_variants_set_the_backend_and_the_switch(bench):
    assert bench.variant_setup("xgrammar") == ("xgrammar", "0")
    assert bench.variant_setup("xgrammar-pattern") == ("xgrammar", "1")
    assert bench.variant_setup("llguidance") == ("llguidance", None)
    run, skipped = bench.runnable_variants(bench.VARIANTS, "0.2.7")
    assert run == list(bench.VARIANTS) and skipped == []
    # xgrammar 0.2.1 (SGLang 0.5.16) has no measured bound: the switch does nothing, the variant is left out, saying so
    run, skipped = bench.runnable_variants(bench.VARIANTS, "0.2.1")
    assert run == ["xgrammar", "llguidance"]
    assert len(skipped) == 1 and skipped[0].startswith("xgrammar-pattern: skipped") and "0.2.1" in skipped[0]


def test_time_limit_hits_are_divided_by_requests_and_by_steps(bench):
    # 2 json rounds of bs 8: 16 requests over 240 verify steps, 6 builds over the limit, 1.2 s of masks
    d = {"steps": 240, "mask_s": 1.2, "sched_s": 0.24, "mask_timeouts": 6, "guidance_steps": 0, "schemas_rewritten": 3}
    p = bench.plugin_summary(d, requests=16)
    assert p["timeouts_per_request"] == pytest.approx(6 / 16)
    assert p["timeouts_per_step"] == pytest.approx(6 / 240)
    assert p["mask_ms_per_step"] == pytest.approx(5.0) and p["sched_ms_per_step"] == pytest.approx(1.0)
    assert p["schemas_rewritten"] == 3 and p["guidance_steps"] == 0
    none = bench.plugin_summary({}, requests=0)
    assert none["timeouts_per_request"] is None and none["mask_ms_per_step"] is None
    assert bench.per_request(0, 8) == 0.0 and bench.per_request(3, 0) is None


def test_step_summary_takes_full_batch_steps_median_and_mean(bench):
    # [step_ms, grammar_ms, run_batch_ms, bs, grammar, forward_ms, device_ms, tensor_ops, probe_ms, grammar_probe_ms]
    rec = [[10.0, 1.0, 9.0, 8, 1.0, 5.0, 6.0, 10, 0.5, 0.1], [12.0, 1.0, 9.0, 8, 1.0, 5.0, 6.0, 10, 0.5, 0.1],
           [50.0, 30.0, 9.0, 8, 1.0, 5.0, 6.0, 10, 0.5, 0.1], [99.0, 1.0, 9.0, 3, 1.0, 5.0, 6.0, 10, 0.5, 0.1]]
    s = bench.step_summary(rec, 8)
    assert s["n"] == 3 and s["step_ms"] == 12.0 and s["step_ms_mean"] == pytest.approx(24.0)
    assert s["grammar_ms"] == pytest.approx(0.9)  # the probe's own cost inside grammar regions taken out
    assert bench.step_summary(rec, 1) == {"n": 0}
    assert bench.ratio(24.0, 12.0) == 2.0 and bench.ratio(None, 1.0) is None and bench.ratio(1.0, 0.0) is None


def test_log_reach_counts_outputs_in_the_log_and_items_begun(bench):
    texts = ['{"id": "ABC-1234", "name": "x", "address": {"city": "y", "zip": "12345"}, "tags": ["a", "b"], '
             '"log": [{"t": 1, "m": "hi"}, {"t": 2, "m": "', '{"id": "ABC-1234", "name": "xx']
    r = bench.log_reach(texts)
    assert r["n"] == 2 and r["in_log"] == 0.5 and r["m_strings"] == 1.0 and r["control"] == 0.0
    assert bench.log_reach(['{"name": "a\x07b', '{"name": "a\\u0007b'])["control"] == 0.5  # raw, not escaped
    assert bench.log_reach([]) == {"n": 0}


def test_compare_outputs_tells_a_control_character_from_another_divergence(bench):
    base = ['{"m": "ab\x00c"}', '{"m": "abc"}', '{"m": "abc"}', '{"m": "ab']
    other = ['{"m": "abXc"}', '{"m": "abc"}', '{"m": "abd"}', '{"m": "ab"}']
    assert bench.compare_outputs(base, other) == {"identical": 1, "at_control": 1, "other": 2}


def test_path_problems_name_a_variant_whose_path_did_not_run(bench):
    assert bench.path_problems("xgrammar", {"active": True, "schemas_rewritten": 0, "guidance_steps": 0}) == []
    assert bench.path_problems("xgrammar-pattern", {"active": True, "schemas_rewritten": 2}) == []
    assert bench.path_problems("llguidance", {"active": True, "guidance_steps": 40}) == []
    assert bench.path_problems("xgrammar", {"active": True, "schemas_rewritten": 1})
    assert bench.path_problems("xgrammar-pattern", {"active": True, "schemas_rewritten": 0})
    assert bench.path_problems("llguidance", {"active": True, "guidance_steps": 0})
    assert bench.path_problems("llguidance", {"active": False, "guidance_steps": 5})


def _result(bench):
    steps_j = [[300.0, 5.0, 250.0, 8, 1.0, 200.0, 210.0, 50, 2.0, 0.2]] * 3
    steps_u = [[200.0, 0.0, 180.0, 8, 0.0, 150.0, 160.0, 50, 2.0, 0.0]] * 3
    run = {"variant": "llguidance", "start_s": 30.0, "wall_s": 200.0,
           "ttft": {"first": [5000.0], "fresh": [900.0, 1100.0, 1000.0], "cached": [100.0, 120.0, 110.0],
                    "unconstrained": [90.0] * 3},
           "cells": {"8": {"json": steps_j, "unconstrained": steps_u,
                           "plugin": {"steps": 10, "mask_s": 0.02, "mask_timeouts": 4, "guidance_steps": 10},
                           "requests": 8, "texts": ['{"log": [{"t": 1, "m": "a'] * 8, "tokens": 80, "verify": 75}}}
    machine = {"sglang": "0.5.16", "xgrammar": "0.2.1", "llguidance": "1.9.1", "torch": "2", "python": "3.11",
               "cpus": 2, "processor": "", "machine": "x86_64"}
    return {"command": "flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python "
                       "benchmarks/bench_grammar_backends.py", "date": "2026-11-28T00:00:00+00:00",
            "revision": "abc", "dirty": False, "machine": machine, "allocator": "jemalloc",
            "variants": ["llguidance"], "skipped": ["xgrammar-pattern: skipped, the switch does nothing"],
            "rounds": 1, "max_new_tokens": 128, "ttft_trials": 3,
            "ttft": {"llguidance": {k: bench.ttft_summary(run["ttft"][k]) for k in run["ttft"]}},
            "rows": bench.aggregate([run], [8]), "counters": {"llguidance": {"guidance_steps": 10}},
            "pattern_outputs": None, "problems": ["llguidance: something"], "runs": [run]}


def test_markdown_has_the_command_machine_both_tables_and_the_skip_note(bench):
    md = bench.markdown(_result(bench))
    assert "Command: `flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python" in md
    assert "Date 2026-11-28T00:00:00+00:00" in md and "xgrammar 0.2.1, llguidance 1.9.1" in md
    assert "noisy" in md and "- xgrammar-pattern: skipped" in md
    # TTFT row: first 5000, fresh median 1000 (900-1100), cached 110, unconstrained 90, cold 4890, compile 890, 9.1x
    assert "| llguidance | 5000 | 1000 (900-1100) | 110 | 90 | 4890 | 890 | 9.1× |" in md
    # decode row: 3/3 steps, json 300/300, unc 200/200, 1.50x both, grammar calls 4.8 ms, mask 2 ms per step,
    # 4 hits over 8 requests / 10 steps, every output in the log with one item begun, 80/75 tokens per verify step
    assert ("| llguidance | 8 | 3 / 3 | 300.0 / 300.0 | 200.0 / 200.0 | 1.50× / 1.50× | 4.80 | 2.00 | 0.50 / 0.400 "
            "| 100% / 1.0 | 0% | 1.07 |") in md
    assert "Problems seen:" in md and "- llguidance: something" in md
    assert "against `xgrammar`'s" not in md  # no pattern engine ran
    md = bench.markdown(dict(_result(bench), pattern_outputs={"identical": 3, "at_control": 5, "other": 0}))
    assert "3 identical, 5 parting where `xgrammar` wrote a raw control character" in md and "0 parting elsewhere" in md
