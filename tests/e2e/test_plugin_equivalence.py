"""Every supported SGLang + the product plugin: greedy EAGLE3 under the overlap scheduler is token-identical with the
plugin on, with it off (``SGLANG_EAGLE_OVERLAP=0``) and without speculation, for JSON-schema / regex / EBNF / mixed
batches.

Overlap: with the plugin, no grammar decode batch runs with overlap disabled on either version (the CPU runtime counts
the scheduler's final decision). Without it, 0.5.16 forces every grammar decode batch out of overlap
(``Scheduler.is_disable_overlap_for_batch``) and 0.5.23 keeps them in (its own grammar overlap), which is what the
plugin-off assertions pin, so the counter is shown to move.

Both model pairs (random weights: drafts mostly rejected; json-follower: drafts mostly accepted), topk 1 and topk 4 on
the default path (the grammar thread: the step's native call on a helper thread), topk 4 inline
(``SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=0``), and topk 4 with the native batch calls off
(``SGLANG_EAGLE_OVERLAP_NATIVE=0``: the Python walk and feed they replace; the work then runs inline).
The plugin's scheduler-side stats (``SGLANG_EAGLE_OVERLAP_STATS_FILE``, written by the scheduler process) prove its
mask path ran there; with the plugin off no such file appears. The inline and Python variants run on the follower pair
only: its accepted multi-token runs are what those paths feed and walk differently; with the random pair's rejected
drafts they add nothing the default path does not show. Engine starts: 2 pairs x (non-spec + topk 1 / 4 plugin on +
topk 1 plugin off) + 2 (follower: topk 4 inline, topk 4 Python) = 10, one at a time (the pool keeps one engine).

One request of the JSON-schema batch has a ``maxLength`` string (:data:`MAX_LENGTH_SCHEMA`): with the plugin on (its
``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN`` default) SGLang 0.5.23 compiles it as a control-character-free pattern
(counted as ``schemas_rewritten``; 0.5.16: not, its xgrammar gains nothing). Its output must validate against the
schema as sent (``jsonschema``), equal the non-speculative baseline (plugin off: the ``maxLength`` grammar) token for
token up to a token holding a raw control character (the one difference the rewrite may make), and SGLang's grammar
cache must hold it under the schema text as sent (the CPU runtime records the cache's keys).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, List

import jsonschema
import pytest

from sglang_eagle_overlap.core.schema import rewrite_schema_text
from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_SCHEMA
from sglang_eo_dev.cpu_runtime.stats import text_sha256

from .common import EBNF, GREEDY, PROMPTS, REGEX, generate_cases, schema_str

pytestmark = pytest.mark.engine

PARAMS = dict(GREEDY, max_new_tokens=40)
# The follower's document ("Green river under bright morning light", 38 characters) fits; annotations stay.
MAX_LENGTH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 1, "maxLength": 40, "description": "a short title"}},
    "required": ["title"], "additionalProperties": False}
MAX_LENGTH_ROW = ("json_schema", 3)  # (case, request) of the maxLength request
CASES = {
    "json_schema": (PROMPTS[:4], [dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA))] * 3
                    + [dict(PARAMS, json_schema=schema_str(MAX_LENGTH_SCHEMA))]),
    "regex_ebnf": (PROMPTS[:2], [dict(PARAMS, regex=REGEX), dict(PARAMS, ebnf=EBNF)]),
    "mixed_batch": (
        [PROMPTS[0], PROMPTS[1], PROMPTS[3]],
        [dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA)), PARAMS, dict(PARAMS, regex=REGEX)],
    ),
}


def _run_all(engine):
    return generate_cases(engine, CASES)


def _run(engine_pool, cfg: EngineConfig):
    key = ("plugin-equivalence", cfg)
    if key not in engine_pool.cache:
        engine, read_plugin_stats = engine_pool.get_with_plugin_stats(cfg, "plugin-equivalence")
        results = _run_all(engine)
        plugin_stats = read_plugin_stats()
        engine_pool.cache[key] = (results, plugin_stats, engine_pool.stats())
    return engine_pool.cache[key]


@pytest.fixture(scope="module", params=["random", "follower"])
def pair(request):
    return request.param


@pytest.fixture(scope="module")
def baseline(engine_pool, pair):
    return _run(engine_pool, EngineConfig(pair=pair, spec=None, overlap=True, product_plugin=False))[0]


@pytest.mark.parametrize("spec", ["topk1", "topk4"])
def test_plugin_on_token_identical_to_nonspec(engine_pool, sglang_version, pair, baseline, spec):
    _check_plugin_on(engine_pool, sglang_version, pair, baseline, spec, None, None)


@pytest.mark.parametrize("thread, native", [(False, None), (None, False)], ids=["topk4-inline", "topk4-python"])
def test_inline_and_python_paths_token_identical_to_nonspec(engine_pool, sglang_version, thread, native):
    baseline = _run(engine_pool, EngineConfig(pair="follower", spec=None, overlap=True, product_plugin=False))[0]
    _check_plugin_on(engine_pool, sglang_version, "follower", baseline, "topk4", thread, native)


def _check_plugin_on(engine_pool, sglang_version, pair, baseline, spec, thread, native) -> None:
    cfg = EngineConfig(pair=pair, spec=spec, overlap=True, product_plugin=True, grammar_thread=thread, native=native)
    on, on_stats, on_runtime = _run(engine_pool, cfg)
    for case in CASES:
        for i, (got_on, want) in enumerate(zip(on[case], baseline[case], strict=True)):
            if (case, i) == MAX_LENGTH_ROW:
                _assert_same_up_to_a_control_character(cfg, got_on[1], want[1])
                continue
            assert got_on[1] == want[1], (pair, spec, case, i, "plugin on != non-spec", got_on[0], want[0])
            assert got_on[0] == want[0] and got_on[2] == want[2]
    _assert_max_length_compiled_as_pattern(sglang_version, on[MAX_LENGTH_ROW[0]][MAX_LENGTH_ROW[1]], on_stats,
                                           on_runtime)
    # The plugin's path ran in the scheduler process.
    assert on_stats is not None, "plugin on, but the scheduler wrote no plugin stats (mask path never ran)"
    assert on_stats["active"] is True and on_stats["steps"] > 0 and on_stats["tokens_advanced"] > 0, on_stats
    assert on_stats["pid"] != os.getpid()
    assert on_stats["grammar_thread"] is (thread is not False)  # the path this case is about is the one that ran
    # by default the steps' native calls ran on the grammar thread; inline, or without the native module, none did
    assert (on_stats["thread_steps"] > 0) is (thread is not False and native is not False), on_stats
    assert on_stats["native"] is (native is not False)  # native batch calls by default, Python when switched off
    assert on_stats["aborts"] == 0 and on_stats["ledger_resets"] == 0, on_stats
    # Overlap stayed on for grammar decode batches, and the runtime saw no errors.
    assert on_runtime.get("runtime_errors") == [], on_runtime
    assert on_runtime.get("overlap_enabled") is True
    assert on_runtime.get("grammar_decode_batches", 0) > 0
    assert on_runtime.get("overlap_disabled_grammar_decode_batches") == 0, on_runtime


# Plugin off: topk 1 only. The switch must leave SGLang exactly stock, and stock's overlap decision for a grammar batch
# does not depend on the tree shape (an engine start less per pair; the real-pair and TP tests draw the same line).
def test_plugin_off_is_stock_sglang(engine_pool, sglang_version, pair, baseline):
    off, off_stats, off_runtime = _run(engine_pool, EngineConfig(pair=pair, spec="topk1", overlap=True,
                                                                 product_plugin=False))
    for case in CASES:
        for i, (got_off, want) in enumerate(zip(off[case], baseline[case], strict=True)):
            assert got_off[1] == want[1], f"{pair} topk1 {case}[{i}] plugin off != non-spec"
    assert off_stats is None, f"plugin off (SGLANG_EAGLE_OVERLAP=0) but it wrote stats: {off_stats}"
    # ... and without the plugin the band's own behaviour shows: 0.5.16 forces grammar decode batches to sync.
    assert off_runtime.get("runtime_errors") == [], off_runtime
    assert off_runtime.get("grammar_decode_batches", 0) > 0, off_runtime
    disabled_off = off_runtime.get("overlap_disabled_grammar_decode_batches")
    if sglang_version[:3] == (0, 5, 16):
        assert disabled_off == off_runtime["grammar_decode_batches"], off_runtime
    else:
        assert disabled_off == 0, off_runtime


@functools.lru_cache(maxsize=None)
def _tokenizer(cfg: EngineConfig) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_pair(cfg).target)


def _assert_same_up_to_a_control_character(cfg: EngineConfig, got: List[int], want: List[int]) -> None:
    """``got`` (plugin on: the pattern grammar) equals ``want`` (non-speculative, plugin off: xgrammar's ``maxLength``
    grammar), or they part where ``want`` took a token holding a raw control character, which the pattern excludes."""
    if got == want:
        return
    at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert at < len(want), (cfg.describe(), "plugin on ran past the non-spec output", got, want)
    piece = _tokenizer(cfg).decode([want[at]])
    assert any(ord(ch) < 0x20 for ch in piece), (cfg.describe(), at, repr(piece), got, want)


def _assert_max_length_compiled_as_pattern(sglang_version, out, plugin_stats, runtime_stats) -> None:
    text, _, finish = out
    assert finish["type"] != "length", ("the maxLength request did not finish; nothing to validate", out)
    jsonschema.validate(json.loads(text), MAX_LENGTH_SCHEMA)  # the schema as sent
    sent = schema_str(MAX_LENGTH_SCHEMA)
    rewritten = rewrite_schema_text(sent, 128)
    assert rewritten.changed
    if sglang_version[:3] == (0, 5, 23):
        assert plugin_stats["schemas_rewritten"] >= 1, plugin_stats
    else:  # xgrammar 0.2.1: the pattern is no faster, the switch does nothing
        assert plugin_stats["schemas_rewritten"] == 0, plugin_stats
    cached = [(e["key_sha256"], e["grammar_key_sha256"]) for e in runtime_stats.get("grammar_cache", [])
              if e["key_type"] == "json"]
    assert (text_sha256(sent), text_sha256(sent)) in cached, cached  # cached and named by the schema as sent
    assert all(text_sha256(rewritten.text) not in entry for entry in cached), cached
