"""scripts/demo.py without an engine: its switches, its run plan and what it prints from results."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("sglang_eo_demo", ROOT / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_sh_help_lists_every_switch_without_building_anything():
    demo = _demo()
    env = dict(os.environ, SGLANG_EO_VENV_DIR="/nonexistent/sglang-eo-venvs")  # a build attempt would fail
    res = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--help"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    switches = [opt for action in demo.build_parser()._actions if action.help != "==SUPPRESS=="
                for opt in action.option_strings if opt.startswith("--")]
    assert "--sglang-version" in switches and "--plugin" in switches and "--model-path" in switches
    missing = [s for s in switches if s not in res.stdout]
    assert missing == [], f"demo.sh --help does not list {missing}"
    assert "SGLANG_VERSION" in res.stdout  # the environment spelling of --sglang-version


def test_default_run_plan_is_0_5_16_off_and_on_then_0_5_23_on():
    demo = _demo()
    assert demo.runs_for(demo.SUPPORTED, "auto") == [("0.5.16", "off"), ("0.5.16", "on"), ("0.5.23", "on")]
    assert demo.runs_for(["0.5.23"], "both") == [("0.5.23", "off"), ("0.5.23", "on")]
    assert demo.runs_for(["0.5.16"], "on") == [("0.5.16", "on")]


def _result(version, state, total, off, **kw):
    r = {"version": version, "plugin_state": state, "grammar_decode_batches": total,
         "overlap_disabled_grammar_decode_batches": off, "grammar_ms": 1.25, "step_ms": 20.5, "tok_s": 101.0,
         "accept_len": 3.9, "valid": 4, "outputs": 4, "plugin_active": state == "on"}
    r.update(kw)
    return r


def test_table_and_explanation_show_the_overlap_difference():
    demo = _demo()
    results = [_result("0.5.16", "off", 12, 12), _result("0.5.16", "on", 12, 0), _result("0.5.23", "on", 11, 0),
               {"version": "0.5.23", "plugin_state": "off", "error": "engine run exited with 1"}]
    text = demo.table(results)
    rows = text.splitlines()
    assert "forced OFF 12/12" in rows[2] and "0.5.16" in rows[2] and "off" in rows[2]
    assert "kept (0/12 off)" in rows[3]
    assert "kept (0/11 off)" in rows[4]
    assert "FAILED" in rows[5]
    assert all("4/4" in r for r in rows[2:5])
    words = "\n".join(demo.explanation(results, gpu=False))
    assert "0.5.16 ran 12 of 12 " in words and "0 of 12 with the plugin" in words
    assert "follower" in words and demo.GPU_BENCHMARK in words


def _real(version, state, constrained, ids, free=()):
    r = _result(version, state, 10, 0)
    r.update(labels=["extraction: a", "tool call: b"], constrained=constrained, ids=ids, free=list(free))
    return r


def test_side_by_side_shows_free_and_constrained_answers_and_token_identity():
    demo = _demo()
    same = [[1, 2, 3], [4, 5]]
    results = [_real("0.5.16", "off", ['{"a": 1}', '{"b": 2}'], same, free=["```json\n{\"a\": 1", "{\"b\": 2}"]),
               _real("0.5.16", "on", ['{"a": 1}', '{"b": 2}'], same)]
    lines = demo.side_by_side(results)
    assert lines[0] == "[1] extraction: a"
    assert "does NOT parse" in lines[1] and "0.5.16 plugin off" in lines[2] and "0.5.16 plugin on" in lines[3]
    assert "-> parses" in lines[5]
    assert demo.token_changes(results) == []
    results[1]["ids"] = [[1, 2, 3], [4, 6]]
    assert demo.token_changes(results) == ["SGLang 0.5.16: prompt 2 differs between plugin off and on"]
