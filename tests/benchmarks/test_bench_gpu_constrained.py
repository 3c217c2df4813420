"""``benchmarks/bench_gpu_constrained.py``: its pure helpers (no engine) and its CPU mode end to end on the real SGLang
engine with the tiny random pair (``@pytest.mark.engine``; the same code path a GPU run takes, minus the device)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_gpu_constrained.py"


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(BENCH, "bench_gpu_constrained")


def _out(tokens: int, verify: int) -> dict:
    return {"meta_info": {"completion_tokens": tokens, "spec_verify_ct": verify}}


def test_round_result_takes_the_scheduler_steps_of_the_full_batch_and_its_kind(bench):
    # [step_ms, grammar_ms, run_batch_ms, bs, grammar]: full-batch grammar steps 10/30/20, a shrunk batch, an
    # unconstrained step (another variant's batch), a 4-field record of an older probe (no kind: ignored)
    records = [[10.0, 1.0, 5.0, 2, 1.0], [30.0, 3.0, 5.0, 2, 1.0], [99.0, 9.0, 5.0, 1, 1.0], [7.0, 0.0, 5.0, 2, 0.0],
               [20.0, 2.0, 5.0, 2, 1.0], [50.0, 0.0, 5.0, 2]]
    outs = [_out(40, 20), _out(40, 19)]  # 78 tokens after the prefill's two, in 39 verify steps
    r = bench.round_result(records, outs, bs=2, grammar=True, max_new_tokens=40)
    assert r["ms_step"] == 20.0 and r["n_steps"] == 3
    assert [s[0] for s in r["steps"]] == [10.0, 30.0, 20.0]
    assert r["accept_len"] == pytest.approx(78 / 39)
    assert r["full_batch"] is True and r["requests"] == 2
    unc = bench.round_result(records, outs, bs=2, grammar=False, max_new_tokens=40)
    assert unc["ms_step"] == 7.0 and unc["n_steps"] == 1
    short = bench.round_result(records, [_out(40, 20), _out(12, 6)], bs=2, grammar=True, max_new_tokens=40)
    assert short["full_batch"] is False and short["tokens_min"] == 12
    none = bench.round_result([], outs, bs=2, grammar=True, max_new_tokens=40)
    assert none["ms_step"] is None and none["n_steps"] == 0


def test_gpu_engine_kwargs_are_the_measured_setup(bench):
    args = bench.parse_args(["--device", "cuda", "--shapes", "topk4", "--attention-backend", "triton",
                             "--sampling-backend", "pytorch"])
    assert args.batch_sizes == [1, 8, 32, 64] and args.max_new_tokens == 160 and args.rounds == 2
    assert args.warmup_tokens == 32 and args.dummy and args.workload_def.schema is bench.BENCH_SCHEMA
    kw = bench.gpu_engine_kwargs(args, args.shape_list[0], "/t", "/d")
    assert kw["constrained_json_disable_any_whitespace"] is True and kw["load_format"] == "dummy"
    assert (kw["attention_backend"], kw["sampling_backend"], kw["dtype"]) == ("triton", "pytorch", "bfloat16")
    assert kw["cuda_graph_max_bs_decode"] == 64 and kw["max_running_requests"] == 64
    assert (kw["speculative_eagle_topk"], kw["speculative_num_draft_tokens"]) == (4, 8)
    assert kw["disable_radix_cache"] is True and kw["speculative_draft_model_path"] == "/d"
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cuda", "--workload", "no-such-workload"])


def test_a_second_workload_is_one_registry_entry(bench, monkeypatch):
    """The hook ``run.sh bench-workload OUT NAME`` uses: a workload with its own schema and a real pair."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    real = bench.Workload("real-8b", "a local checkpoint", "llama-3.1-8b", "llama-3.1-8b-eagle3", schema,
                          max_new_tokens=96, model_path="/ckpt/target", draft_model_path="/ckpt/draft")
    monkeypatch.setitem(bench.WORKLOADS, "real-8b", real)
    args = bench.parse_args(["--device", "cuda", "--workload", "real-8b", "--shapes", "topk1"])
    assert (args.model_path, args.draft_model_path, args.dummy) == ("/ckpt/target", "/ckpt/draft", False)
    assert args.max_new_tokens == 96 and args.workload_def is real
    kw = bench.gpu_engine_kwargs(args, args.shape_list[0], args.model_path, args.draft_model_path)
    assert "load_format" not in kw and kw["model_path"] == "/ckpt/target"
    assert json.loads(bench._params(real, "json", 8)["json_schema"]) == schema
    assert "json_schema" not in bench._params(real, "unconstrained", 8)
    override = bench.parse_args(["--device", "cuda", "--workload", "real-8b", "--model-path", "/m",
                                 "--draft-model-path", "/d"])
    assert (override.model_path, override.draft_model_path) == ("/m", "/d")


def test_result_names_and_merge(bench):
    assert bench.result_name("cuda", "0.5.16", "dummy-8b-json", ["topk1", "topk4"]) == "gpu_constrained_cuda_0.5.16"
    assert bench.result_name("cuda", "0.5.16", "dummy-8b-json", ["topk1"]) == "gpu_constrained_cuda_0.5.16_topk1"
    assert bench.result_name("cuda", "0.5.16", "other", ["topk4"]) == "gpu_constrained_cuda_0.5.16_other_topk4"
    machine = {"device": "cuda", "device_name": "H200", "sglang": "0.5.16"}
    one = {"machine": machine, "model": "m", "workload": "w", "max_new_tokens": 160, "rounds": 2, "repeats": 1,
           "command": "c1", "rows": [{"shape": "topk1", "bs": 1}], "engines": [{"plugin": "on"}], "problems": [],
           "raw": [], "shapes": [{"name": "topk1"}], "batch_sizes": [1], "wall_s": 300.0}
    two = dict(one, command="c2", rows=[{"shape": "topk4", "bs": 1}], shapes=[{"name": "topk4"}], wall_s=200.0)
    merged = bench.merge_results([one, two])
    assert [r["shape"] for r in merged["rows"]] == ["topk1", "topk4"] and merged["commands"] == ["c1", "c2"]
    assert merged["problems"] == [] and merged["wall_s"] == 500.0 and len(merged["engines"]) == 2
    other = dict(two, machine=dict(machine, device_name="H100"))
    assert any("device_name" in p for p in bench.merge_results([one, other])["problems"])


def test_parse_shapes_defaults_and_extra_shapes(bench):
    shapes = bench.parse_shapes("topk1,topk4")
    assert [(s.steps, s.topk, s.draft_tokens) for s in shapes] == [(3, 1, 4), (3, 4, 8)]
    extra = bench.parse_shapes("topk1", ["topk8=5,8,64"])
    assert extra[-1].engine_kwargs() == {"speculative_num_steps": 5, "speculative_eagle_topk": 8,
                                         "speculative_num_draft_tokens": 64}
    with pytest.raises(ValueError, match="steps,topk,tokens"):
        bench.parse_shapes("topk1", ["bad=1,2"])
    with pytest.raises(ValueError, match="tokens = steps \\+ 1"):
        bench.parse_shapes("", ["chain=3,1,8"])
    with pytest.raises(ValueError, match="unknown shape"):
        bench.parse_shapes("topk9")


def test_summaries_rows_and_markdown(bench):
    def rnd(steps, accept=1.0):
        recs = [[x, 0.5, 1.0, 8, 1.0] for x in steps]
        return {"ms_step": bench.statistics.median(steps), "n_steps": len(steps), "steps": recs, "accept_len": accept,
                "full_batch": True, "requests": 8}

    rounds = [rnd([10.0, 10.0, 12.0]), rnd([12.0, 12.0, 11.0])]  # pooled median 11.5, round medians 10 and 12
    ph = [{"steps": 100, "advance_s": 0.2, "tree_wait_s": 0.05, "mask_s": 0.1, "unhidden_s": 0.03,
           "mask_timeouts": 8}] * 2
    on = bench.summarize_cell(rounds, ph)
    assert on["ms_step"] == pytest.approx(11.5) and on["ms_step_best"] == 10.0 and on["n_steps"] == 6
    assert on["n"] == 2 and on["grammar_ms"] == 0.5 and on["ms_step_mean"] == pytest.approx(67 / 6)
    assert on["ms_token"] == pytest.approx(67 / 6)  # what a request pays: the mean step over the accept length
    assert on["phases"]["advance_ms"] == pytest.approx(2.0) and on["phases"]["mask_ms"] == pytest.approx(1.0)
    assert on["phases"]["mask_timeouts_per_request"] == pytest.approx(1.0)
    assert on["phases"]["join_wait_ms"] == 0.0  # a stats file without the scheduler-thread keys (older plugin)
    thread = [dict(p, sched_s=0.04, join_wait_s=0.01, helper_gil_s=0.002, handoff_s=0.003) for p in ph]
    ph_t = bench.summarize_cell(rounds, thread)["phases"]
    assert (ph_t["sched_ms"], ph_t["join_wait_ms"], ph_t["helper_gil_ms"], ph_t["handoff_ms"]) == pytest.approx(
        (0.4, 0.1, 0.02, 0.03))
    unc = bench.summarize_cell([rnd([8.0], accept=2.0)], [])
    assert unc["ms_token"] == pytest.approx(4.0)
    off = bench.summarize_cell([rnd([23.0])], [])
    rows = bench.table_rows({("topk1", 8, "json"): on, ("topk1", 8, "unconstrained"): unc,
                             ("topk1", 8, "json-off"): off}, ["topk1"], [8, 32])
    assert rows[0]["overhead"] == pytest.approx(11.5 / 8 - 1) and rows[0]["off_over_on"] == pytest.approx(2.0)
    assert rows[1]["overhead"] is None  # bs 32 never ran
    result = {"machine": {"device_name": "H200", "cpus": 16, "sglang": "0.5.16", "xgrammar": "0.2.1",
                          "torch": "2.11", "python": "3.12"}, "model": "m", "max_new_tokens": 160, "rounds": 2,
              "repeats": 1, "command": "python benchmarks/bench_gpu_constrained.py", "rows": rows, "problems": []}
    md = bench.markdown(result)
    assert "| topk1 | 8 | 8.00 (8.00-8.00) | 11.50 (10.00-12.00) | 23.00 (23.00-23.00) | 8.00 / 10.00 / 23.00 |" in md
    # median / mean over unc.; phases: advance / tree / mask / unhidden / hand-off / join (an older stats file: 0)
    assert "+43.8% / +39.6%" in md and "2.00x" in md and "2.00 / 0.50 / 1.00 / 0.30 / 0.00 / 0.00" in md
    assert "| 8.00 / 11.17 / 23.00 |" in md  # the means side by side
    assert "| 1 / 6 / 1 |" in md  # steps per variant


def test_inline_path_column_and_resummarize_from_raw(bench):
    """The inline-path engine (json-inline, grammar thread off) gets its own columns, compared with unconstrained and the default path
    of the same run; a result file is re-summarized from its raw rounds (older files gain the mean), row by row."""
    def rnd(steps):
        return {"ms_step": bench.statistics.median(steps), "n_steps": len(steps),
                "steps": [[x, 0.5, 1.0, 8, 1.0] for x in steps], "accept_len": 1.0, "full_batch": True,
                "requests": 8}

    raw = [{"shape": "topk1", "bs": 8, "variant": "unconstrained", "rounds": [rnd([8.0, 8.0, 8.0])], "phases": []},
           {"shape": "topk1", "bs": 8, "variant": "json", "rounds": [rnd([9.0, 9.0, 90.0])], "phases": []},
           {"shape": "topk1", "bs": 8, "variant": "json-inline", "rounds": [rnd([8.0, 8.4, 40.0])], "phases": []}]
    old = {"machine": {"device_name": "H200", "cpus": 16, "sglang": "0.5.16", "xgrammar": "0.2.1", "torch": "2.11",
                       "python": "3.12"}, "model": "m", "max_new_tokens": 160, "rounds": 1, "repeats": 1,
           "command": "c", "shapes": [{"name": "topk1"}], "batch_sizes": [8], "raw": raw, "problems": [],
           "rows": [{"shape": "topk1", "bs": 8}]}  # rows of an older version: no mean
    new = bench.resummarize(old)
    (row,) = new["rows"]
    assert row["json"]["ms_step"] == 9.0 and row["json"]["ms_step_mean"] == pytest.approx(36.0)
    assert row["overhead"] == pytest.approx(9 / 8 - 1) and row["overhead_mean"] == pytest.approx(36 / 8 - 1)
    assert row["inline_overhead"] == pytest.approx(8.4 / 8 - 1) and row["inline_over_on"] == pytest.approx(8.4 / 9)
    assert row["inline_overhead_mean"] == pytest.approx(56.4 / 3 / 8 - 1)
    md = bench.markdown(new)
    assert "json inline ms/step" in md and "| 8.40 (8.08-33.68) | 18.80 | +5.0% / +135.0% | 0.93x |" in md
    assert bench.resummarize({"rows": [1]}) == {"rows": [1]}  # nothing raw: unchanged


@pytest.mark.engine
@pytest.mark.sglang_0_5_16  # the benchmark's band: the GPU machine runs SGLang 0.5.16 only (CI time)
def test_cpu_mode_runs_every_variant_end_to_end(tmp_path):
    """Both engines (plugin on: json + unconstrained; plugin off: json), 2 batch sizes, on the tiny random pair; step
    times come from the scheduler's step probe for every variant, with the grammar kind of each step."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_eo_dev") is None:
        pytest.skip("needs SGLang and the dev CPU runtime (scripts/setup_cpu_env.sh <version>)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "dev"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--shapes", "topk1", "--batch-sizes", "1,2",
           "--max-new-tokens", "12", "--rounds", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    (result_file,) = tmp_path.glob("gpu_constrained_cpu_*.json")
    assert result_file.name.endswith("_topk1.json")
    result = json.loads(result_file.read_text())
    assert result["problems"] == []
    assert {(e["plugin"], e["active"]) for e in result["engines"]} == {("on", True), ("off", False)}
    assert [(r["shape"], r["bs"]) for r in result["rows"]] == [("topk1", 1), ("topk1", 2)]
    for row in result["rows"]:
        for v in ("json", "unconstrained", "json-off"):
            cell = row[v]
            assert cell["n"] == 1 and cell["ms_step"] > 0 and cell["full_batch"], (v, cell)
            assert cell["accept_len"] >= 1.0
            raw = next(x for x in result["raw"] if x["shape"] == "topk1" and x["bs"] == row["bs"] and x["variant"] == v)
            steps = raw["rounds"][0]["steps"]
            # every recorded step held the whole batch and was of this variant's kind (grammar or not)
            assert steps and all(s[3] == row["bs"] and s[4] == (0.0 if v == "unconstrained" else 1.0) for s in steps)
            # at most one step per output token after the prefill's (accept length >= 1)
            assert len(steps) <= 12 - 1 and cell["n_steps"] == len(steps)
        # SGLang enters its grammar entry points for every batch and returns at once without grammar requests
        assert row["json"]["grammar_ms"] > row["unconstrained"]["grammar_ms"] >= 0.0
        ph = row["json"]["phases"]
        assert ph is not None and ph["steps"] >= row["json"]["n_steps"]  # the plugin owned every timed step
        assert row["json-off"]["phases"] is None and row["unconstrained"]["phases"] is None
    md = result_file.with_suffix(".md").read_text()
    assert "| topk1 | 2 |" in md and "MEASURED on" in md
    assert result_file.with_suffix(".png").stat().st_size > 0


def test_shipped_configs_have_the_published_llama_3_1_8b_shape():
    target = json.loads((ROOT / "benchmarks" / "configs" / "llama-3.1-8b" / "config.json").read_text())
    draft = json.loads((ROOT / "benchmarks" / "configs" / "llama-3.1-8b-eagle3" / "config.json").read_text())
    for cfg in (target, draft):
        assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"],
                cfg["vocab_size"], cfg["rope_theta"]) == (4096, 32, 8, 14336, 128256, 500000.0)
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    assert target["architectures"] == ["LlamaForCausalLM"] and target["num_hidden_layers"] == 32
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert draft["draft_vocab_size"] == target["vocab_size"] and draft["target_hidden_size"] == 4096


def test_dummy_model_dirs_pair_the_configs_with_the_local_tokenizer(bench, tmp_path, monkeypatch):
    if importlib.util.find_spec("tokenizers") is None or not (ROOT / "dev" / "sglang_eo_dev").is_dir():
        pytest.skip("needs tokenizers and the dev package (scripts/setup_cpu_env.sh <version>)")
    # the shipped configs with a 4096-token vocabulary: the same code path, a tokenizer that builds in seconds
    for name in ("llama-3.1-8b", "llama-3.1-8b-eagle3"):
        cfg = json.loads((ROOT / "benchmarks" / "configs" / name / "config.json").read_text())
        cfg.update(vocab_size=4096, **({"draft_vocab_size": 4096} if "draft_vocab_size" in cfg else {}))
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("SGLANG_EO_BENCH_CACHE", str(tmp_path / "cache"))
    target, draft = bench.dummy_model_dirs(tmp_path / "llama-3.1-8b", tmp_path / "llama-3.1-8b-eagle3")
    tok = json.loads((target / "tokenizer.json").read_text())
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
    for d, arch in ((target, "LlamaForCausalLM"), (draft, "LlamaForCausalLMEagle3")):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["eos_token_id"] == eos and cfg["bos_token_id"] is None
        assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
        assert len(json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]) + len(tok["added_tokens"]) >= 4096


def test_merge_joins_the_variants_of_one_cell_measured_in_different_runs(bench):
    """The stock column in a device call of its own: with raw rounds kept, a (shape, bs) measured by two runs is one
    row, its variants side by side and its stock / plugin ratio computed from both; rounds of one variant pool."""
    machine = {"device": "cuda", "device_name": "H200", "sglang": "0.5.16"}

    def run(command, variant_ms):
        raw = [{"shape": "topk1", "bs": 8, "variant": v,
                "rounds": [{"ms_step": ms, "steps": [[ms, 0.0, 1.0, 8, 1.0]], "accept_len": 1.0, "full_batch": True,
                            "requests": 8}], "phases": []} for v, ms in variant_ms.items()]
        return {"machine": machine, "model": "m", "workload": "w", "max_new_tokens": 160, "rounds": 1, "repeats": 1,
                "command": command, "rows": [{"shape": "topk1", "bs": 8}], "engines": [], "problems": [],
                "raw": raw, "shapes": [{"name": "topk1"}], "batch_sizes": [8], "wall_s": 1.0}

    merged = bench.merge_results([run("on", {"json": 11.0, "unconstrained": 10.0}), run("stock", {"json-off": 22.0}),
                                  run("again", {"json": 13.0})])
    (row,) = merged["rows"]
    assert (row["shape"], row["bs"]) == ("topk1", 8)
    assert row["json"]["n_steps"] == 2 and row["json"]["ms_step_best"] == 11.0
    assert row["off_over_on"] == pytest.approx(22.0 / row["json"]["ms_step"])
    assert row["overhead"] == pytest.approx(row["json"]["ms_step"] / 10.0 - 1.0)
    assert merged["commands"] == ["on", "stock", "again"] and merged["problems"] == []
    partial = bench.merge_results([run("on", {"json": 11.0}), dict(run("old", {}), raw=[])])
    assert partial["rows"] == [{"shape": "topk1", "bs": 8}, {"shape": "topk1", "bs": 8}]  # no raw: rows as they were
