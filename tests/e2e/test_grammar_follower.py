"""Grammar-constrained EAGLE3 + overlap with the hand-set "json-follower" pair: outputs conform, drafts are accepted.

The follower target writes FOLLOWER_DOCUMENT then eos, and its draft predicts the same chain, so under
FOLLOWER_SCHEMA most drafts are accepted. Also checks the scheduler-side overlap counters.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA, follower_text

from .common import EBNF, GREEDY, REGEX, accept_length, ebnf_matches, schema_str

pytestmark = pytest.mark.engine

FOLLOWER = EngineConfig(pair="follower", spec="topk1", overlap=True, product_plugin=False)
PARAMS = dict(GREEDY, max_new_tokens=48)


@pytest.fixture(scope="module")
def engine(engine_pool):
    return engine_pool.get(FOLLOWER)


def test_json_schema_output_is_valid_and_drafts_are_accepted(engine):
    outs = engine.generate(prompt=["Give me JSON:", "Describe it"], sampling_params=dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA)))
    for out in outs:
        doc = json.loads(out["text"])
        jsonschema.validate(doc, FOLLOWER_SCHEMA)
        assert doc == FOLLOWER_DOCUMENT
        assert out["text"] == follower_text()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        length = accept_length(out["meta_info"])
        assert length >= 2.0, f"accept length {length:.2f} (< 2) for {out['meta_info']}"


def test_regex_output_matches(engine):
    out = engine.generate(prompt="Answer:", sampling_params=dict(PARAMS, regex=REGEX))
    assert re.fullmatch(REGEX, out["text"]), out["text"]


def test_ebnf_output_matches(engine):
    out = engine.generate(prompt="Answer:", sampling_params=dict(PARAMS, ebnf=EBNF))
    assert ebnf_matches(out["text"]), out["text"]


def test_json_and_free_text_in_one_batch(engine):
    outs = engine.generate(
        prompt=["JSON please:", "Free text please:", "More JSON:"],
        sampling_params=[dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA)), PARAMS,
                         dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA))],
    )
    assert json.loads(outs[0]["text"]) == FOLLOWER_DOCUMENT
    assert json.loads(outs[2]["text"]) == FOLLOWER_DOCUMENT
    # Unconstrained, the follower writes the same chain (its argmax ignores the prompt's last token here).
    assert outs[1]["text"].startswith('{"title"'), outs[1]["text"]


def test_overlap_counters(engine, engine_pool, sglang_version):
    engine.generate(prompt="JSON:", sampling_params=dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA)))
    stats = engine_pool.stats()
    assert stats.get("runtime_errors") == [], stats
    assert stats["overlap_enabled"] is True
    assert stats["grammar_decode_batches"] > 0, stats
    if sglang_version < (0, 5, 17):
        # Stock 0.5.16 (product plugin off) syncs the overlap loop for every speculative grammar decode batch
        # that has a result in flight.
        assert stats["overlap_disabled_grammar_decode_batches"] > 0, stats
    else:
        # 0.5.17+ advances the grammar inside verify (upstream grammar overlap): no forced sync for xgrammar.
        assert stats["overlap_disabled_grammar_decode_batches"] == 0, stats
