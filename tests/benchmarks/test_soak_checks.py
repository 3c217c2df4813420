"""``benchmarks/soak.py``'s own verdicts, without a server: the engine test (``tests/e2e/test_soak.py``) requires the
soak to pass, so these show that the soak's counter checks and its ``/metrics`` and ``/v1/loads`` readers can say
"fail" at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]

# /metrics of a server whose scheduler wrote the plugin's counters (multiprocess mode: a label set per process)
METRICS = """\
# HELP sglang_eagle_overlap:grammar_steps_total Grammar-constrained EAGLE verify steps whose grammar work the plugin did
# TYPE sglang_eagle_overlap:grammar_steps_total counter
sglang_eagle_overlap:grammar_steps_total{pid="11"} 7.0
sglang_eagle_overlap:grammar_steps_total{pid="12"} 3.0
sglang_eagle_overlap:grammar_steps_created{pid="11"} 1.7e+09
sglang_eagle_overlap:grammar_seconds_total 0.5
sglang_eagle_overlap:grammar_unhidden_seconds_total 0.25
sglang_eagle_overlap:mask_timeouts_total 1.0
sglang_eagle_overlap:forced_drafts_proposed_total 4.0
sglang_eagle_overlap:forced_drafts_accepted_total 2.0
sglang:num_running_reqs{model_name="default"} 3.0
"""
# the stats file of the same run
STATS = {"steps": 10, "tokens_advanced": 40, "overlap_kept": 10, "ledger_resets": 0, "aborts": 0,
         "mask_failures": 0, "fallback_steps": 0, "mask_timeouts": 1, "forced_proposed": 4, "forced_changed": 3,
         "forced_accepted": 2, "forced_changed_accepted": 1, "sched_s": 0.75, "unhidden_s": 0.25, "thread_steps": 8,
         "small_batch_inline_steps": 2}


@pytest.fixture(scope="module")
def soak():
    yield from loaded_script(ROOT / "benchmarks" / "soak.py", "soak_checks")


def test_metrics_reader_sums_processes_and_drops_suffixes_and_other_metrics(soak):
    assert soak.prom_metrics(METRICS) == {"grammar_steps": 10.0, "grammar_seconds": 0.5,
                                          "grammar_unhidden_seconds": 0.25, "mask_timeouts": 1.0,
                                          "forced_drafts_proposed": 4.0, "forced_drafts_accepted": 2.0}


def test_consistent_counters_pass_on_both_bands(soak):
    prom = soak.prom_metrics(METRICS)
    assert soak.check_counters(STATS, prom, "0.5.16") == []
    assert soak.check_counters(dict(STATS, overlap_kept=0), prom, "0.5.23") == []


@pytest.mark.parametrize("change, words", [
    ({"steps": 0}, "no grammar verify step"),
    ({"tokens_advanced": 0}, "no token fed"),
    ({"overlap_kept": 0}, "kept in the overlap"),
    ({"ledger_resets": 1}, "ledger_resets = 1"),
    ({"aborts": 2}, "aborts = 2"),
    ({"mask_failures": 1}, "mask_failures = 1"),
    ({"fallback_steps": 1}, "fallback_steps = 1"),
    ({"steps": 11}, "grammar_steps 10.0 != stats steps 11"),
    ({"mask_timeouts": 0}, "mask_timeouts"),
    ({"forced_proposed": 5}, "forced_drafts_proposed"),
    ({"forced_accepted": 1}, "forced_drafts_accepted"),
    ({"sched_s": 0.4}, "> stats scheduler-thread time"),
    ({"unhidden_s": 0.3}, "stats unhidden_s 0.3 != Prometheus"),
    ({"forced_changed": 5, "forced_proposed": 4}, "do not nest"),
    ({"forced_changed_accepted": 3}, "do not nest"),
    ({"thread_steps": 9}, "> steps 10"),
])
def test_each_broken_counter_is_reported(soak, change, words):
    bad = soak.check_counters(dict(STATS, **change), soak.prom_metrics(METRICS), "0.5.16")
    assert any(words in b for b in bad), bad


def test_unhidden_time_above_grammar_time_is_reported(soak):
    prom = dict(soak.prom_metrics(METRICS), grammar_unhidden_seconds=0.6)
    bad = soak.check_counters(dict(STATS, unhidden_s=0.6), prom, "0.5.16")
    assert any("un-hidden" in b for b in bad), bad


def test_runtime_check_reports_errors_forced_syncs_and_missing_stats(soak):
    ok = {"runtime_errors": [], "overlap_disabled_grammar_decode_batches": 0, "grammar_decode_batches": 10}
    assert soak.check_runtime(ok, STATS) == []
    assert soak.check_runtime({}, STATS) == ["no CPU-runtime stats file written"]
    assert "runtime errors" in soak.check_runtime(dict(ok, runtime_errors=["boom"]), STATS)[0]
    assert "left the overlap" in soak.check_runtime(dict(ok, overlap_disabled_grammar_decode_batches=2), STATS)[0]
    assert "> grammar decode batches" in soak.check_runtime(dict(ok, grammar_decode_batches=9), STATS)[0]


def test_busy_requests_counts_running_and_waiting_of_every_rank(soak):
    loads = {"version": "0.5.23", "num_accelerators": 1,
             "loads": [{"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_total_tokens": 900},
                       {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 3}]}
    assert soak.busy_requests(loads) == 6
    assert soak.busy_requests({"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]}) == 0
