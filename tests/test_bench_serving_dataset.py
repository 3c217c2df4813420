"""The serving benchmark's prompt + JSON-schema dataset (benchmarks/schemas.py) and its bench_serving rows.

Non-engine: every schema compiles with xgrammar the way SGLang compiles it, the dataset is a pure function of the
seed (also across interpreter processes), and it has the variety the benchmark claims.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import xgrammar as xgr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_serving_constrained as bench  # noqa: E402
from benchmarks.schemas import FAMILIES, FEATURES, make_dataset, schema_features  # noqa: E402
from sglang_eo_dev.helpers.tokenizers import tokenizer_info  # noqa: E402

N = 32  # four cases per family


def _fingerprint(cases) -> list:
    return [(c.family, c.prompt, c.schema_json) for c in cases]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_schema_compiles_with_xgrammar(seed):
    compiler = xgr.GrammarCompiler(tokenizer_info(32000))
    for case in make_dataset(N, seed):
        # SGLang's xgrammar backend compiles json_schema requests like this (the CPU server disables any-whitespace).
        for any_ws in (False, True):
            compiled = compiler.compile_json_schema(case.schema_json, any_whitespace=any_ws)
            assert compiled.memory_size_bytes > 0, case.family


def test_schemas_constrain_output():
    """A compiled schema rejects an empty object (every schema has required fields) and unknown keys, and accepts
    the start of a document naming its first required field."""
    compiler = xgr.GrammarCompiler(tokenizer_info(32000))
    for case in make_dataset(8, 0):
        compiled = compiler.compile_json_schema(case.schema_json, any_whitespace=False)
        required = case.schema["required"]
        assert required, case.family
        assert not _accepts(compiled, "{}", whole=True), case.family
        assert _accepts(compiled, '{"' + required[0] + '":'), (case.family, required[0])
        assert not _accepts(compiled, '{"not_a_field":'), case.family


def _accepts(compiled, text: str, whole: bool = False) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and (matcher.is_terminated() or not whole)


def test_deterministic_for_a_seed():
    a, b = make_dataset(N, 7), make_dataset(N, 7)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(make_dataset(8, 7)) == _fingerprint(a)[:8]  # case i does not depend on n
    other = make_dataset(N, 8)
    assert sum(x != y for x, y in zip(_fingerprint(a), _fingerprint(other))) >= N // 2


def test_deterministic_across_processes():
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from benchmarks.schemas import make_dataset;"
        f"print(json.dumps([[c.family, c.prompt, c.schema_json] for c in make_dataset({N}, 3)]))"
    )
    outs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, env=env,
                             check=True).stdout
        outs.append(json.loads(out))
    assert outs[0] == outs[1] == [list(t) for t in _fingerprint(make_dataset(N, 3))]


def test_variety():
    cases = make_dataset(N, 0)
    assert {c.family for c in cases} == set(FAMILIES)
    assert len({c.schema_json for c in cases}) == N
    assert len({c.prompt for c in cases}) == N
    for feature in FEATURES:
        share = sum(feature in c.features for c in cases) / N
        assert share >= 0.25, (feature, share)
    # Every case has optional fields and at least three of the five features.
    assert all("optional" in c.features and len(c.features) >= 3 for c in cases)


def test_schema_features_detects_each_feature_and_only_those():
    flat = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert schema_features(flat) == frozenset()
    full = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "kind": {"type": "string", "enum": ["x", "y"]},
            "child": {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
            "list": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["id", "kind", "child"],
    }
    assert schema_features(full) == frozenset(FEATURES)
    # Features inside array items count too.
    deep = {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "string", "enum": ["a"]}}},
            "required": ["l"]}
    assert schema_features(deep) == {"array", "enum"}


def test_rows_constrained_and_free_differ_only_by_schema():
    cases = make_dataset(8, 0)
    fake = SimpleNamespace(DatasetRow=lambda **kw: kw)
    tok = SimpleNamespace(encode=lambda s: s.split())
    on = bench._rows(fake, cases, True, 64, tok)
    off = bench._rows(fake, cases, False, 64, tok)
    for case, r_on, r_off in zip(cases, on, off):
        assert r_on["prompt"] == r_off["prompt"] == case.prompt
        assert r_on["prompt_len"] == len(case.prompt.split())
        s_on, s_off = r_on["extra_request_body"]["sampling_params"], r_off["extra_request_body"]["sampling_params"]
        assert json.loads(s_on["json_schema"]) == case.schema
        assert "json_schema" not in s_off
        assert s_on["max_new_tokens"] == s_off["max_new_tokens"] == 64
        assert s_on["temperature"] == s_off["temperature"] == 0.0
        assert s_on["ignore_eos"] is False and s_off["ignore_eos"] is True
