"""The real model's prompt set: held-apart prompts really are held apart, schemas compile."""

from __future__ import annotations

import json

from sglang_eo_dev.real_model import prompts


def test_held_apart_prompts_never_in_training_set():
    train = {r.user for r in prompts.training_requests(8)}
    held = prompts.held_apart_requests()
    assert held and not ({r.user for r in held} & train)


def test_training_set_is_deterministic_and_mostly_constrained():
    a, b = prompts.training_requests(6, seed=0), prompts.training_requests(6, seed=0)
    assert a == b
    assert sum(1 for r in a if r.schema) > len(a) // 2
    assert {r.schema for r in a if r.schema} == set(prompts.SCHEMAS)


def test_every_schema_compiles_with_xgrammar():
    import pytest

    xgr = pytest.importorskip("xgrammar")

    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["<eos>"], stop_token_ids=[95])
    compiler = xgr.GrammarCompiler(info)
    for name, schema in prompts.SCHEMAS.items():
        assert compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) is not None, name
