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


def test_chat_prompts_ask_for_no_json_and_hold_their_held_apart_set_apart():
    """The chat-trained draft stands for the draft users have: it must never be shown JSON, a schema or a tool call,
    and it is judged on prompts whose topics and coding tasks never occur in training."""
    from sglang_eo_dev.real_model import build, chat_prompts

    train = build.RECIPES["chat"].requests()
    held = chat_prompts.chat_held_apart_requests()
    assert len(train) == len({r.user for r in train}) >= 400
    assert len(held) == len({r.user for r in held}) >= 10
    assert not ({r.user for r in held} & {r.user for r in train})
    for r in train + held:
        assert r.schema is None, r
        assert not any(w in r.user.lower() for w in ("json", "schema", "tool", "{", "get_weather")), r.user
    for topic in chat_prompts.H_CHAT_TOPICS:
        assert not any(topic in r.user for r in train), topic
    for task in chat_prompts.H_CODE_TASKS:
        assert not any(task in r.user for r in train), task
    # code prompts are part of the mix, as in chat data
    assert sum("function" in r.user or "program" in r.user for r in train) > len(train) // 10


def test_chat_training_prompts_are_a_deterministic_prefix_of_a_larger_draw():
    from sglang_eo_dev.real_model import chat_prompts

    a = chat_prompts.chat_training_requests(50, seed=3)
    assert a == chat_prompts.chat_training_requests(50, seed=3)
    assert chat_prompts.chat_training_requests(80, seed=3)[:50] == a
    assert a != chat_prompts.chat_training_requests(50, seed=4)
