"""Greedy EAGLE3 under the overlap scheduler writes exactly what non-speculative greedy decoding writes.

Random-weight pair (drafts mostly rejected, so every verify path that rewinds is exercised), topk 1 (chain) and
topk 4 (tree, QLEN_ONLY tree mask in the CPU verify attention), with and without a grammar, and a batch that mixes a
grammar request with a free-text one.
"""

from __future__ import annotations

import pytest

from sglang_eo_cpu_runtime.engine import EngineConfig
from sglang_eo_cpu_runtime.models import FOLLOWER_SCHEMA

from .common import EBNF, GREEDY, PROMPTS, REGEX, output_ids, schema_str

pytestmark = pytest.mark.engine

CASES: dict[str, tuple[list[str], list[dict]]] = {
    "plain": (PROMPTS, [GREEDY] * len(PROMPTS)),
    "regex": (PROMPTS[:2], [dict(GREEDY, regex=REGEX)] * 2),
    "ebnf": (PROMPTS[2:3], [dict(GREEDY, ebnf=EBNF)]),
    "json_schema": (PROMPTS[:2], [dict(GREEDY, json_schema=schema_str(FOLLOWER_SCHEMA))] * 2),
    "mixed_batch": (
        [PROMPTS[0], PROMPTS[1], PROMPTS[3]],
        [dict(GREEDY, json_schema=schema_str(FOLLOWER_SCHEMA)), GREEDY, dict(GREEDY, regex=REGEX)],
    ),
}


def _run_all(engine) -> dict[str, list[tuple[str, list[int]]]]:
    results = {}
    for name, (prompts, params) in CASES.items():
        outs = engine.generate(prompt=prompts, sampling_params=params)
        results[name] = [(o["text"], output_ids(o)) for o in outs]
    return results


@pytest.fixture(scope="module")
def baseline(engine_pool):
    key = "random-nospec-greedy"
    if key not in engine_pool.cache:
        engine = engine_pool.get(EngineConfig(pair="random", spec=None, overlap=True))
        engine_pool.cache[key] = _run_all(engine)
    return engine_pool.cache[key]


@pytest.fixture(scope="module", params=["topk1", "topk4"])
def spec_results(request, engine_pool, baseline):
    engine = engine_pool.get(EngineConfig(pair="random", spec=request.param, overlap=True))
    info = engine.get_server_info()
    return request.param, info, _run_all(engine), engine_pool.stats()


def test_runtime_kept_overlap_and_intel_amx(spec_results):
    variant, info, _, stats = spec_results
    assert info["attention_backend"] == "intel_amx", info["attention_backend"]
    assert info["disable_overlap_schedule"] is False, "the CPU runtime should keep the overlap scheduler on"
    assert info["speculative_algorithm"] == "EAGLE3"
    assert stats.get("scheduler_started"), stats
    assert stats.get("overlap_enabled") is True, stats
    assert stats.get("runtime_errors") == [], stats["runtime_errors"]


@pytest.mark.parametrize("case", list(CASES))
def test_spec_output_token_identical_to_nonspec(spec_results, baseline, case):
    variant, _, results, _ = spec_results
    got, want = results[case], baseline[case]
    for i, ((g_text, g_ids), (w_text, w_ids)) in enumerate(zip(got, want)):
        assert g_ids == w_ids, f"{variant} {case}[{i}]: ids differ\n spec:    {g_text!r}\n nonspec: {w_text!r}"
        assert g_text == w_text
