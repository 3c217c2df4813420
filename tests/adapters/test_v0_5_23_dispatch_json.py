"""The 0.5.23 ``dispatch_json`` hook against SGLang's real ``XGrammarGrammarBackend`` (its own ``__init__``, a small
raw vocabulary through the tokenizer's ``init_xgrammar`` door) and its real grammar cache: with the switch on,
bounded ``maxLength`` strings compile as patterns (no raw control character), the cache and the grammar's
``key_string`` keep the schema as sent, and every schema the rewrite does not handle gets SGLang's own result.

The hook function is called directly (SGLang's class itself is not patched here), with a fresh runtime per test.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace
from typing import Any, Callable, List

import pytest

from sglang_eo_dev.helpers.grammars import ensure_sglang_importable

pytestmark = pytest.mark.sglang_0_5_23

VOCAB = [chr(c) for c in range(0x20, 0x7f)] + ["\x01", "\x1f", "\t", "</s>"]
STOP = len(VOCAB) - 1
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
TEXT = json.dumps(SCHEMA)
CONTROL_DOC = '{"name": "a\x01b", "n": 1}'
PLAIN_DOC = '{"name": "ab", "n": 1}'


@pytest.fixture
def backend() -> Any:
    ensure_sglang_importable()
    import xgrammar as xgr
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    tokenizer = SimpleNamespace(init_xgrammar=lambda: (xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP]), None))
    return XGrammarGrammarBackend(tokenizer, vocab_size=len(VOCAB), any_whitespace=False)


def _runtime(**switches: Any) -> Any:
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    runtime.reset()
    rt = runtime.create(Settings(**switches))
    rt.active = True
    return rt


@pytest.fixture(autouse=True)
def _fresh_runtime():
    from sglang_eagle_overlap.integration import runtime

    runtime.reset()
    yield
    runtime.reset()


def _sglang_dispatch() -> Callable[..., Any]:
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from sglang_eagle_overlap.adapters.v0_5_23.dispatch_json import dispatch_json_around
    from sglang_eagle_overlap.integration.hooks import contains_hook

    original = XGrammarGrammarBackend.dispatch_json
    assert not contains_hook(original, dispatch_json_around)  # the reference is SGLang's own method
    return original


def _recording(calls: List[str]) -> Callable[..., Any]:
    sglang = _sglang_dispatch()

    def original(self: Any, key_string: str) -> Any:
        calls.append(key_string)
        return sglang(self, key_string)

    return original


def _hooked(backend: Any, original: Callable[..., Any]) -> Any:
    from sglang_eagle_overlap.adapters.v0_5_23.dispatch_json import dispatch_json_around

    return lambda key_string: dispatch_json_around(original, backend, key_string)


def _accepts(grammar: Any, document: str) -> bool:
    matcher = grammar.copy().matcher
    return bool(matcher.accept_string(document)) and bool(matcher.accept_token(STOP)) and matcher.is_terminated()


def test_switch_on_compiles_the_pattern_and_keeps_the_schema_as_sent(backend):
    rt = _runtime()
    assert rt.max_length_pattern_bound == 128  # xgrammar 0.2.7, SGLang 0.5.23's pin
    calls: List[str] = []
    grammar = _hooked(backend, _recording(calls))(TEXT)
    assert len(calls) == 1 and calls[0] != TEXT and '"pattern"' in calls[0]  # one compile, of the rewrite
    assert grammar.key_string == TEXT
    assert _accepts(grammar, PLAIN_DOC) and not _accepts(grammar, CONTROL_DOC)
    assert not _accepts(grammar, '{"name": "abcdefghi", "n": 1}') and not _accepts(grammar, '{"name": "", "n": 1}')
    assert rt.step.telemetry.stats.counters["schemas_rewritten"] == 1


def test_switch_off_is_sglangs_own_grammar(backend):
    rt = _runtime(max_length_pattern=False)
    assert rt.max_length_pattern_bound is None
    calls: List[str] = []
    grammar = _hooked(backend, _recording(calls))(TEXT)
    assert calls == [TEXT] and grammar.key_string == TEXT
    assert _accepts(grammar, CONTROL_DOC)  # xgrammar's own maxLength class admits raw control characters
    assert rt.step.telemetry.stats.counters["schemas_rewritten"] == 0


def test_an_inactive_runtime_passes_through(backend):
    rt = _runtime()
    rt.active = False
    calls: List[str] = []
    assert _accepts(_hooked(backend, _recording(calls))(TEXT), CONTROL_DOC) and calls == [TEXT]


def test_through_sglangs_grammar_cache_the_key_is_the_schema_as_sent(backend):
    _runtime()
    backend.dispatch_json = _hooked(backend, _sglang_dispatch())
    key = ("json", TEXT)
    future, hit = backend.get_cached_or_future_value(key, False)
    assert not hit
    grammar = future.result(timeout=60)
    backend.set_cache(key, grammar.copy())  # what SGLang's grammar manager does once the compile is done
    assert list(backend.cache) == [key]
    again, hit = backend.get_cached_or_future_value(key, False)
    assert hit and again.key_string == TEXT and not _accepts(again, CONTROL_DOC) and _accepts(again, PLAIN_DOC)


@pytest.mark.parametrize("text", ["$$ANY$$", "{not json", json.dumps({"type": "object", "properties": {
    "a": {"type": "string", "maxLength": 3, "format": "email"}}})])
def test_what_the_rewrite_leaves_goes_to_sglang_as_sent(backend, text):
    _runtime()
    calls: List[str] = []
    got = _hooked(backend, _recording(calls))(text)
    want = _sglang_dispatch()(backend, text)
    assert calls == [text] and type(got) is type(want)
    assert getattr(got, "error_message", None) == getattr(want, "error_message", None)


def test_an_invalid_schema_gets_sglangs_own_error_for_the_schema_as_sent(backend, caplog):
    # rewritable strings next to a keyword SGLang 0.5.23 refuses for xgrammar: the request's error is SGLang's own
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    _runtime()
    text = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                                        "b": {"type": "integer", "multipleOf": 2}}})
    calls: List[str] = []
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
        got = _hooked(backend, _recording(calls))(text)
    want = _sglang_dispatch()(backend, text)
    assert isinstance(got, InvalidGrammarObject) and got.error_message == want.error_message
    assert len(calls) == 2 and calls[1] == text  # the rewrite first, then the schema as sent
    assert not [r for r in caplog.records if r.name == "sglang_eagle_overlap"]  # invalid either way: no warning


def test_a_rewrite_sglang_cannot_compile_falls_back_loudly_to_the_schema_as_sent(backend, caplog):
    _runtime()
    sglang = _sglang_dispatch()

    def original(self: Any, key_string: str) -> Any:
        if key_string != TEXT:
            raise RuntimeError("compiler failure on the rewritten schema")
        return sglang(self, key_string)

    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
        grammar = _hooked(backend, original)(TEXT)
    assert grammar.key_string == TEXT and _accepts(grammar, CONTROL_DOC)  # SGLang's own grammar for the schema
    assert any(r.levelname == "WARNING" and "compiler failure" in r.getMessage() for r in caplog.records)


def test_an_unmeasured_xgrammar_version_compiles_as_sent(backend, monkeypatch):
    from sglang_eagle_overlap.integration import runtime

    monkeypatch.setattr(runtime, "installed_xgrammar", lambda: "0.2.8")
    rt = _runtime()
    assert rt.max_length_pattern_bound is None
    calls: List[str] = []
    assert _accepts(_hooked(backend, _recording(calls))(TEXT), CONTROL_DOC) and calls == [TEXT]
