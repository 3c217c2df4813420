"""``--grammar-backend llguidance`` with the product plugin: greedy EAGLE3 (topk 1 chain and topk 4 tree) under the
overlap scheduler writes exactly what non-speculative greedy decoding writes with the same backend, every output is
valid, and no grammar decode batch leaves the overlap, on both SGLang bands (0.5.16 forces every grammar batch out
of overlap without the plugin).

The pair is the JSON follower (its draft is mostly accepted: multi-token runs reach the grammars through the
exactly-once ledger every step). The plugin's stats prove its path ran in the scheduler process: the llguidance rows
took the batched walk (``guidance_steps``), nothing was aborted or re-anchored. One request per engine is marked for
the fault injector (``sglang_eo_dev.cpu_runtime.faults``): its rows break the batched llguidance fill and its grammar
raises when asked for a row, so it must fail alone, with ``Grammar mask build failed``, while its neighbours are
exact. The topk 4 engine runs with grammar-forced drafts on, the topk 1 engine with them off: llguidance's
fast-forward tokens replace top-path drafts, and the outputs stay the same. Engine starts: 3 (non-spec, topk 1,
topk 4).
"""

from __future__ import annotations

import asyncio
import json
import os
import re

import jsonschema
import pytest

from sglang_eo_dev.cpu_runtime import faults
from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_SCHEMA

from .common import GREEDY, PROMPTS, REGEX, generate_cases, output_ids, schema_str

pytestmark = pytest.mark.engine

PARAMS = dict(GREEDY, max_new_tokens=40)
# A maxLength string: llguidance's lexer handles it natively (no rewrite applies to this backend).
MAX_LENGTH_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 1, "maxLength": 40}}, "required": ["title"],
    "additionalProperties": False}
SCHEMAS = [FOLLOWER_SCHEMA, FOLLOWER_SCHEMA, FOLLOWER_SCHEMA, MAX_LENGTH_SCHEMA]
CASES = {
    "json_schema": (PROMPTS[:4], [dict(PARAMS, json_schema=schema_str(s)) for s in SCHEMAS]),
    "regex": (PROMPTS[:2], [dict(PARAMS, regex=REGEX)] * 2),
    "mixed_batch": ([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                    [dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA)), PARAMS, dict(PARAMS, regex=REGEX)]),
}
# No flexible whitespace in JSON (SGLang's --constrained-json-disable-any-whitespace): keys and punctuation are
# grammar-forced, which the topk 4 engine's forced drafts take from llguidance's fast-forward tokens.
LLGUIDANCE = (("grammar_backend", "llguidance"), ("constrained_json_disable_any_whitespace", True))
FAULT_RID = f"llg-{faults.GUIDANCE_RAISE_MARKER}-1"


def _run_all(engine):
    return generate_cases(engine, CASES)


async def _faulty_batch(engine):
    """Three JSON requests sent together (one generate each: a non-streamed request that fails raises in its own
    call), the middle one marked for the injector: (text, ids, finish reason) per request, or the exception."""
    rids = ["llg-plain-0", FAULT_RID, "llg-plain-2"]
    params = dict(PARAMS, json_schema=schema_str(FOLLOWER_SCHEMA))
    outs = await asyncio.gather(*(engine.async_generate(prompt=PROMPTS[j], sampling_params=params, rid=rid)
                                  for j, rid in enumerate(rids)), return_exceptions=True)
    return [o if isinstance(o, BaseException) else (o["text"], output_ids(o), o["meta_info"]["finish_reason"])
            for o in outs]


def _run(engine_pool, cfg: EngineConfig, faulty: bool):
    key = ("llguidance", cfg)
    if key not in engine_pool.cache:
        engine, read_plugin_stats = engine_pool.get_with_plugin_stats(cfg, "llguidance")
        results = _run_all(engine)
        if faulty:
            results["faulty"] = engine.loop.run_until_complete(_faulty_batch(engine))
        engine_pool.cache[key] = (results, read_plugin_stats(), engine_pool.stats())
    return engine_pool.cache[key]


@pytest.fixture(scope="module")
def baseline(engine_pool):
    return _run(engine_pool, EngineConfig(pair="follower", spec=None, overlap=True, product_plugin=False,
                                          extra=LLGUIDANCE), faulty=False)[0]


def _valid(case: str, i: int, text: str) -> None:
    if case == "regex" or (case == "mixed_batch" and i == 2):
        assert re.fullmatch(REGEX, text), (case, i, text)
    elif case == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    elif case == "mixed_batch" and i == 0:
        jsonschema.validate(json.loads(text), FOLLOWER_SCHEMA)


@pytest.mark.parametrize("spec", ["topk1", "topk4"])
def test_llguidance_with_the_plugin_is_token_identical_valid_and_overlapped(engine_pool, baseline, spec,
                                                                              monkeypatch):
    monkeypatch.setenv(faults.ENV_FLAG, "1")  # read by the engine's scheduler at start
    forced = spec == "topk4"
    cfg = EngineConfig(pair="follower", spec=spec, overlap=True, product_plugin=True, extra=LLGUIDANCE,
                       forced_drafts=forced)
    got, stats, runtime = _run(engine_pool, cfg, faulty=True)
    for case in CASES:
        for i, (on, want) in enumerate(zip(got[case], baseline[case], strict=True)):
            assert on[1] == want[1], (spec, case, i, "plugin on != non-spec", on[0], want[0])
            assert on[0] == want[0] and on[2] == want[2]
            if on[2]["type"] != "length":
                _valid(case, i, on[0])
    finished = [on for case in ("json_schema", "regex") for on in got[case] if on[2]["type"] != "length"]
    assert len(finished) >= 4, ("too few outputs finished to show validity", got)
    # The plugin's path ran in the scheduler process, with llguidance's batched walk, and kept the overlap.
    assert stats is not None and stats["active"] is True and stats["pid"] != os.getpid(), stats
    assert stats["steps"] > 0 and stats["tokens_advanced"] > 0, stats
    assert stats["guidance_steps"] > 0, stats
    assert stats["ledger_resets"] == 0 and stats["aborts"] == 0, stats
    if forced:  # llguidance's fast-forward tokens were recorded and proposed as drafts (the same outputs above)
        assert stats["forced_nodes"] > 0 and stats["forced_proposed"] > 0, stats
    else:
        assert stats["forced_proposed"] == 0, stats
    assert runtime.get("runtime_errors") == [], runtime
    assert runtime.get("grammar_decode_batches", 0) > 0
    assert runtime.get("overlap_disabled_grammar_decode_batches") == 0, runtime
    # The marked request failed alone; its neighbours are exact (their non-spec outputs: json_schema rows 0 and 2).
    faulty = got["faulty"]
    assert isinstance(faulty[1], BaseException) and "Grammar mask build failed" in str(faulty[1]), faulty[1]
    assert stats["mask_failures"] >= 1, stats
    assert runtime.get("faults_raised", 0) >= 1, runtime  # the per-request walk asked the marked grammar
    for j in (0, 2):
        assert not isinstance(faulty[j], BaseException), (j, faulty[j])
        assert faulty[j][1] == baseline["json_schema"][j][1], (spec, j, faulty[j][0], baseline["json_schema"][j][0])
