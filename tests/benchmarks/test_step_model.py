"""The one-constant step model (``benchmarks/step_model.py``) and the scheduler-budget summaries
(``benchmarks/bench_scheduler_budget.py``): pure functions, no engine, no SGLang."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sm():
    yield from loaded_script(ROOT / "benchmarks" / "step_model.py", "bench_step_model")


@pytest.fixture(scope="module")
def sb():
    yield from loaded_script(ROOT / "benchmarks" / "bench_scheduler_budget.py", "bench_scheduler_budget")


# Two synthetic worlds, every number written out: per cell (spec, bs) the H200's medians G (unconstrained step),
# R (unconstrained run_batch CPU ms) and the measured revision's step, and this machine's CPU terms a, r, b_before,
# b_inline. The H200 numbers were worked out by hand from a GPU host k times slower than this one:
#   R = k r,  measured step = max(G, k (a + b_before)).
# k = 0.5 (every cell GPU-bound):
#   topk1 1: R 0.5 x 2 = 1.0, step max(6, 0.5 x (4 + 1) = 2.5) = 6;  topk1 8: R 1.25, step max(7, 0.5 x 8 = 4) = 7
#   topk1 64: R 1.5, step max(15, 0.5 x 22 = 11) = 15;               topk4 64: R 2.0, step max(24, 0.5 x 44 = 22) = 24
# k = 2 (every cell CPU-bound for the measured revision):
#   topk1 1: R 4, step 2 x 5 = 10;  topk1 8: R 5, step 2 x 8 = 16;  topk1 64: R 6, step 2 x 22 = 44;
#   topk4 64: R 8, step 2 x 44 = 88
#            spec     bs   a     r    b_before b_inline
_CPU = [("topk1", 1, 4.0, 2.0, 1.0, 0.5), ("topk1", 8, 6.0, 2.5, 2.0, 1.0),
        ("topk1", 64, 10.0, 3.0, 12.0, 2.0), ("topk4", 64, 14.0, 4.0, 30.0, 3.0)]
#                 (spec, bs): (G, R, measured step)
_GPU = {0.5: {("topk1", 1): (6.0, 1.0, 6.0), ("topk1", 8): (7.0, 1.25, 7.0), ("topk1", 64): (15.0, 1.5, 15.0),
              ("topk4", 64): (24.0, 2.0, 24.0)},
        2.0: {("topk1", 1): (6.0, 4.0, 10.0), ("topk1", 8): (7.0, 5.0, 16.0), ("topk1", 64): (15.0, 6.0, 44.0),
              ("topk4", 64): (24.0, 8.0, 88.0)}}


def _world(sm, k: float):
    """The world of :data:`_GPU` ``[k]`` and :data:`_CPU` as the two result files hold it, read by the model's
    readers: per cell the H200 records of its unconstrained and inline variants (three full-batch records around
    the median, and one record of a smaller batch that must be ignored), and this machine's budget rows."""
    raw, rows = [], []
    for spec, bs, a, r, b_old, b_new in _CPU:
        g, run, inline = _GPU[k][(spec, bs)]
        for variant, step, run_ms in (("unconstrained", g, run), ("json-inline", inline, 0.0)):
            recs = [[step - 1, 0, run_ms - 0.1, bs, 1, 0], [step, 0, run_ms, bs, 1, 0],
                    [step + 5, 0, run_ms + 3, bs, 1, 0], [999.0, 0, 999.0, bs - 0.5, 1, 0]]
            raw.append({"shape": spec, "bs": bs, "variant": variant, "rounds": [{"steps": recs}]})

        def path(b):
            return {"unconstrained": {"n": 3, "cpu_ms": a, "device_ms": 50.0, "run_cpu_ms": r},
                    "budget": {"b_ms": b}}
        rows.append({"spec": spec, "bs": bs, "before": path(b_old), "inline": path(b_new)})
    return sm.gpu_cells([{"raw": raw}]), sm.cpu_cells({"rows": rows}, ["before", "inline"])


def test_model_recovers_the_constant_and_predicts_unseen_cells(sm):
    gpu, cpu = _world(sm, 0.5)
    assert gpu[("topk1", 64)] == {"G": 15.0, "R": 1.5, "inline": 15.0}  # medians of the full-batch records
    assert cpu[("topk4", 64)] == {"a": 14.0, "r": 4.0, "b_before": 30.0, "b_inline": 3.0}
    res = sm.evaluate(gpu, cpu, ("topk1", 64), new="inline", bound=None)
    assert res["k"] == pytest.approx(0.5)
    assert res["max_R_error"] == pytest.approx(0.0, abs=1e-12)
    assert res["max_step_error"] == pytest.approx(0.0, abs=1e-12)
    rows = {(r["spec"], r["bs"]): r for r in res["rows"]}
    # topk4 bs 64: 0.5 x (14 + 30) = 22 < G 24, the measured revision hid under the GPU; the new path too
    assert rows[("topk4", 64)]["pred_measured"] == 24.0
    assert rows[("topk4", 64)]["pred_new"] == 24.0 and rows[("topk4", 64)]["margin_ms"] == pytest.approx(24 - 8.5)
    assert [r["fit"] for r in res["rows"]].count(True) == 1
    assert res["max_new_over_G"] == 0.0
    # refitted on each cell in turn: the same k everywhere in this world, the smallest margin at topk1 bs 8 (7 - 3.5)
    assert [f["k"] for f in res["by_fit_cell"]] == pytest.approx([0.5] * 4)
    assert all(f["min_margin_ms"] == pytest.approx(3.5) for f in res["by_fit_cell"])


def test_a_cpu_bound_cell_is_predicted_at_k_times_its_cpu_terms(sm):
    gpu, cpu = _world(sm, 2.0)
    res = sm.evaluate(gpu, cpu, ("topk1", 1), new="inline")
    assert res["k"] == 2.0 and res["max_R_error"] == pytest.approx(0.0, abs=1e-12)
    assert res["max_step_error"] == pytest.approx(0.0, abs=1e-12)  # every measured step is k (a + b_before)
    rows = {(r["spec"], r["bs"]): r for r in res["rows"]}
    # topk4 bs 64: 2 x (14 + 30) = 88 > G 24 for the measured revision; the new path: 2 x 17 = 34 > 24
    assert rows[("topk4", 64)]["pred_measured"] == pytest.approx(88.0)
    assert rows[("topk4", 64)]["pred_new"] == pytest.approx(34.0)
    assert rows[("topk4", 64)]["pred_new_over_G"] == pytest.approx(34 / 24 - 1)
    assert rows[("topk4", 64)]["margin_ms"] == pytest.approx(-10.0)


def test_out_of_sample_error_is_reported_not_absorbed(sm):
    gpu, cpu = _world(sm, 0.5)
    gpu[("topk4", 64)]["R"] *= 1.25  # the GPU host disagrees with one constant on one unseen cell
    gpu[("topk1", 8)]["inline"] *= 1.10  # and measured a step the model does not explain
    res = sm.evaluate(gpu, cpu, ("topk1", 64), new="inline")
    assert res["k"] == pytest.approx(0.5)  # the fit cell alone sets k
    assert res["max_R_error"] == pytest.approx(1 - 1 / 1.25)  # |predicted / measured - 1|
    assert res["max_step_error"] == pytest.approx(1 - 1 / 1.10)


def test_the_new_path_is_predicted_as_a_range_up_to_no_overlap(sm):
    """The default path's (b) (``new``) and the same work made serially (``bound``): two predictions per cell, the
    second never below the first when its (b) is larger; a cell where only the serial one is CPU-bound shows it."""
    gpu, cpu = _world(sm, 2.0)
    cpu[("topk4", 64)]["b_thread"] = 1.0  # 2 x (14 + 1) = 30 > 24: CPU-bound already
    cpu[("topk1", 8)]["b_thread"] = 0.2  # 2 x (6 + 0.2) = 12.4 > 7 as well
    for c in cpu.values():
        c.setdefault("b_thread", 0.1)
    res = sm.evaluate(gpu, cpu, ("topk1", 1), new="thread", bound="inline")
    rows = {(r["spec"], r["bs"]): r for r in res["rows"]}
    r = rows[("topk4", 64)]
    assert r["pred_new"] == pytest.approx(30.0) and r["pred_bound"] == pytest.approx(34.0)
    assert r["margin_bound_ms"] == pytest.approx(-10.0) and r["b_bound"] == 3.0 and r["b_new"] == 1.0
    assert all(x["pred_bound"] >= x["pred_new"] for x in res["rows"])
    assert res["max_bound_over_G"] == max(x["pred_bound_over_G"] for x in res["rows"])
    assert "no overlap" in sm.markdown(dict(res, sources={"gpu": "g", "cpu": "c", "measured": "m", "new": "thread",
                                                          "bound": "inline"}))


def test_a_variant_without_full_batch_records_gives_no_cell(sm):
    """A cell whose unconstrained run never held the whole batch has no G: it is left out, not read as None."""
    raw = [{"shape": "topk4", "bs": 64, "variant": "unconstrained", "rounds": [{"steps": [[9.0, 0, 2.0, 63, 0, 0]]}]},
           {"shape": "topk1", "bs": 8, "variant": "unconstrained", "rounds": [{"steps": [[7.0, 0, 2.0, 8, 0, 0]]}]}]
    assert sm.gpu_cells([{"raw": raw}]) == {("topk1", 8): {"G": 7.0, "R": 2.0}}


def test_fit_cell_needs_both_machines(sm):
    gpu, cpu = _world(sm, 0.5)
    with pytest.raises(ValueError, match="fit cell"):
        sm.evaluate(gpu, cpu, ("topk8", 64))
    with pytest.raises(ValueError, match="positive"):
        sm.fit_k(1.0, 0.0)


def test_the_committed_model_reads_the_committed_results(sm, tmp_path):
    """docs/benchmarks.md's command on the committed inputs: every GPU cell has CPU terms, the fit cell is the only
    in-sample one, and the written table has a row per cell."""
    assert sm.main(["--out", str(tmp_path)]) == 0
    import json

    res = json.loads((tmp_path / "step_model.json").read_text())
    assert len(res["rows"]) == 8 and sum(r["fit"] for r in res["rows"]) == 1
    assert all("pred_new" in r and "pred_bound" in r and "step_error" in r for r in res["rows"])
    assert (tmp_path / "step_model.md").read_text().count("| topk") == 8


def test_budget_summary_of_a_cell(sb):
    steps = [[10.0, 2.0, 8.0, 8, 1.0, 6.0], [12.0, 3.0, 9.0, 8, 1.0, 7.0], [14.0, 4.0, 9.0, 8, 1.0, 7.0],
             [99.0, 9.0, 9.0, 7, 1.0, 1.0]]
    s = sb.cell_summary(steps, 8)
    assert s == {"n": 3, "step_ms": 12.0, "forward_ms": 7.0, "cpu_ms": 5.0, "grammar_ms": 3.0, "grammar_raw_ms": 3.0}
    # records with the device split: the CPU is step - device - probe, run_batch's CPU run_batch - device - probe
    dev = sb.cell_summary([[10.0, 2.0, 8.0, 8, 1.0, 4.0, 6.0, 40, 0.5], [12.0, 3.0, 9.0, 8, 1.0, 5.0, 7.0, 50, 1.0]], 8)
    assert dev == {"n": 2, "step_ms": 11.0, "forward_ms": 4.5, "cpu_ms": 3.75, "grammar_ms": 2.5,
                   "grammar_raw_ms": 2.5, "device_ms": 6.5, "tensor_ops": 45, "probe_ms": 0.75, "run_cpu_ms": 1.25}
    # records with the probe's cost inside the grammar regions: the grammar time is taken without it
    net = sb.cell_summary([[10.0, 2.0, 8.0, 8, 1.0, 4.0, 6.0, 40, 0.5, 0.25],
                           [12.0, 3.0, 9.0, 8, 1.0, 5.0, 7.0, 50, 1.0, 0.75]], 8)
    assert net["grammar_ms"] == 2.0 and net["grammar_raw_ms"] == 2.5 and net["cpu_ms"] == 3.75
    assert sb.cell_summary(steps, 64) == {"n": 0}
    unc = sb.cell_summary([[8.0, 0.0, 6.0, 8, 0.0, 6.0]], 8)  # a = 2
    b = sb.budget(unc, s, {"helper_gil_ms": 0.5, "sched_ms": 40.0})
    # (b) median from the step records, (b) mean from the plugin's stats: a slow step moves only the mean
    assert b == {"a_ms": 2.0, "b_ms": 3.5, "b_cross_ms": 3.0, "b_mean_ms": 40.5}
    assert sb.budget({"n": 0}, s, None)["a_ms"] is None
    assert sb.budget(unc, s, None)["b_mean_ms"] is None  # no plugin stats: no mean, not 0
    assert sb.budget(unc, {"n": 0}, {"sched_ms": 2.0})["b_mean_ms"] == 2.0


def test_render_rebuilds_a_saved_result_from_its_engine_records(sb, tmp_path):
    """``--render``: the rows re-aggregated from a committed result's per-engine records equal the rows it was
    saved with (the same summaries), plus the mean (b) column from each cell's plugin stats."""
    import json

    src = ROOT / "benchmarks" / "results" / "scheduler_budget_0.5.23_thread_inline.json"
    saved = json.loads(src.read_text())
    copy = tmp_path / src.name
    copy.write_text(src.read_text())
    assert sb.main(["--render", str(copy)]) == 0
    rows = json.loads(copy.read_text())["rows"]
    assert [(r["spec"], r["bs"]) for r in rows] == [(r["spec"], r["bs"]) for r in saved["rows"]]
    for new, old in zip(rows, saved["rows"]):
        for path in ("inline", "thread"):
            assert new[path]["budget"]["b_ms"] == pytest.approx(old[path]["budget"]["b_ms"])
            p = new[path]["plugin"]
            assert new[path]["budget"]["b_mean_ms"] == pytest.approx(p["sched_ms"] + p["helper_gil_ms"])
    md = tmp_path / (src.name[: -len(".json")] + ".md")
    text = md.read_text()
    assert "| (b) mean ms |" in text and text.count("| topk") == 2 * len(rows)


def test_the_criterion_reads_the_new_default_against_the_revision_before_it(sb, tmp_path):
    """With a ``before`` engine (``--before REV``) the criterion column is the default path over ``before``, printed
    on its row: ``thread`` when the run has a thread engine, else ``inline`` (this committed run's default then);
    without a ``before`` engine it is thread over inline."""
    import json

    src = ROOT / "benchmarks" / "results" / "scheduler_budget_0.5.23_inline_inline-forced_vs_baseline.json"
    copy = tmp_path / src.name
    copy.write_text(src.read_text())
    assert sb.main(["--render", str(copy)]) == 0
    result = json.loads(copy.read_text())
    assert result["before"] and {r["path"] for r in result["runs"]} == {"before", "inline", "inline-forced"}
    for row in result["rows"]:
        assert row["b_ratio_path"] == "inline"
        assert row["b_ratio"] == pytest.approx(row["inline"]["budget"]["b_ms"] / row["before"]["budget"]["b_ms"])
    lines = (tmp_path / (src.name[: -len(".json")] + ".md")).read_text().splitlines()
    marked = [ln for ln in lines if ln.startswith("| topk") and ln.rstrip().endswith("× |")]
    assert len(marked) == len(result["rows"]) and all("| inline |" in ln for ln in marked)
    rows = sb.aggregate([r for r in result["runs"] if r["path"] != "before"], [8])
    assert all(r["b_ratio_path"] == "thread" and r["b_ratio"] is None for r in rows)  # no thread engine: no ratio
    threaded = [dict(r, path="thread") for r in result["runs"] if r["path"] == "inline"]
    rows = sb.aggregate(result["runs"] + threaded, [8])
    for row in rows:
        assert row["b_ratio_path"] == "thread"
        assert row["b_ratio"] == pytest.approx(row["thread"]["budget"]["b_ms"] / row["before"]["budget"]["b_ms"])


def test_plugin_per_step_means(sb):
    d = {"steps": 4, "advance_s": 0.004, "tree_wait_s": 0.0, "mask_s": 0.008, "sched_s": 0.002, "join_wait_s": 0.001,
         "helper_gil_s": 0.0004, "mask_timeouts": 2}
    p = sb.plugin_per_step(d)
    assert p["advance_ms"] == pytest.approx(1.0) and p["mask_ms"] == pytest.approx(2.0)
    assert p["helper_gil_ms"] == pytest.approx(0.1) and p["timeouts_per_step"] == 0.5
    assert sb.plugin_per_step({"steps": 0}) is None


def test_breakdown_tables_merge_a_paths_engines_at_its_largest_batch(sb):
    """``--breakdown``: the records of all engines of one spec/path are summarised together (the median over every
    call), and the markdown lists each path's functions at its largest batch size, by time per loop iteration."""
    runs = [
        {"spec": "topk1", "path": "thread", "breakdown": [
            {"bs": 64, "calls": {"GrammarStep.finish_build": [0.002], "LedgerPlan.fill": [0.0005, 0.0003]}},
            {"bs": 8, "calls": {"GrammarStep.finish_build": [0.001]}},
            {"bs": 64, "calls": {"hand_over_verify": [0.00001]}}]},  # an unconstrained iteration: left out
        {"spec": "topk1", "path": "thread", "breakdown": [
            {"bs": 64, "calls": {"GrammarStep.finish_build": [0.004], "LedgerPlan.fill": [0.0001]}}]},
        {"spec": "topk1", "path": "before", "breakdown": []},  # an engine without records gives no table
    ]
    got = sb.breakdowns(runs)
    assert list(got) == ["topk1/thread"]
    assert got["topk1/thread"]["64"]["GrammarStep.finish_build"] == [1.0, pytest.approx(3.0), pytest.approx(3.0)]
    assert got["topk1/thread"]["64"]["LedgerPlan.fill"] == [1.5, pytest.approx(0.3), pytest.approx(0.3)]
    text = "\n".join(sb.breakdown_markdown(got))
    assert "### topk1/thread, bs 64" in text and "bs 8" not in text
    assert text.index("`GrammarStep.finish_build` | 1.00 | 3.000 | 3.000 | 3.000") < text.index(
        "`LedgerPlan.fill` | 1.50 | 0.300 | 0.300 | 0.450")
    assert "hand_over_verify" not in got["topk1/thread"]["64"]
    assert sb.breakdown_markdown(None) == [] and sb.breakdown_markdown({}) == []


def test_each_path_sets_the_switches_it_names_and_before_keeps_its_revisions_defaults(sb):
    """``before`` leaves the grammar-thread switch unset (a revision whose default is the thread was measured inline
    when the switch was set off for it), and its forced drafts too unless ``--before-forced`` says; the other paths set
    the thread switch they are named for."""
    assert sb.path_switches("before") == (None, None)
    assert sb.path_switches("before", "on") == (True, None)
    assert sb.path_switches("before", "off") == (False, None)
    assert sb.path_switches("thread") == (None, True)
    assert sb.path_switches("thread-noforced") == (False, True)
    assert sb.path_switches("inline") == (None, False)
    assert sb.path_switches("inline-forced") == (True, False)


def test_the_new_path_prediction_is_checked_against_its_own_gpu_run(sm):
    """A GPU run of the new path (its ``json`` variant, next to its own unconstrained one) checks the prediction: the
    predicted overhead over G is carried to that run's unconstrained step and compared with the measured step; only
    full-batch records count, and the run's other variants (the inline engine's) are not read as the new path."""
    gpu, cpu = _world(sm, 0.5)
    for c in cpu.values():
        c["b_thread"] = 0.1
    raw = [{"shape": "topk1", "bs": 8, "variant": "unconstrained", "rounds": [{"steps": [[7.5, 0, 2, 8], [7.5, 0, 2, 8]]}]},
           {"shape": "topk1", "bs": 8, "variant": "json", "rounds": [{"steps": [[8.25, 0, 2, 8], [40.0, 0, 2, 7]]}]},
           {"shape": "topk1", "bs": 8, "variant": "json-inline", "rounds": [{"steps": [[99.0, 0, 2, 8]]}]},
           {"shape": "topk4", "bs": 64, "variant": "json", "rounds": [{"steps": [[30.0, 0, 2, 64]]}]}]
    new_gpu = sm.new_path_cells([{"raw": raw}])
    assert new_gpu == {("topk1", 8): {"G_run": 7.5, "new": 8.25}}  # topk4 bs 64 has no unconstrained run: no cell
    res = sm.evaluate(gpu, cpu, ("topk1", 64), new="thread", new_gpu=new_gpu)
    rows = {(r["spec"], r["bs"]): r for r in res["rows"]}
    r = rows[("topk1", 8)]  # predicted at G (hidden): +0 %; measured +10 % over its run's unconstrained step
    assert r["pred_new_over_G"] == pytest.approx(0.0)
    assert r["new_measured_over_G"] == pytest.approx(0.1) and r["new_error"] == pytest.approx(1 / 1.1 - 1)
    assert res["max_new_error"] == pytest.approx(1 - 1 / 1.1)
    assert "new_error" not in rows[("topk4", 64)]
    md = sm.markdown(dict(res, sources={"gpu": "g", "cpu": "c", "measured": "m", "new": "thread", "bound": "inline",
                                        "new_gpu": "`p.json`"}))
    assert "8.25 (+10.0 %) | -9.1 % |" in md and "largest error **9.1 %**" in md
