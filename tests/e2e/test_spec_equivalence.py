"""Greedy EAGLE3 under the overlap scheduler writes exactly what non-speculative greedy decoding writes.

Two pairs: the random-weight pair (drafts almost never accepted: every verify rewinds) and the noisy follower (drafts
often accepted while the target's choices still depend on the whole KV cache: multi-token accept bookkeeping). Each
with topk 1 (chain) and topk 4 (tree, QLEN_ONLY tree mask in the CPU verify attention), with and without a grammar,
and a batch that mixes grammar requests with a free-text one.
"""

from __future__ import annotations

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_SCHEMA

from .common import EBNF, GREEDY, PROMPTS, REGEX, accept_length, output_ids, schema_str

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


def _run_all(engine) -> dict[str, list[tuple[str, list[int], float]]]:
    results = {}
    for name, (prompts, params) in CASES.items():
        outs = engine.generate(prompt=prompts, sampling_params=params)
        results[name] = [(o["text"], output_ids(o), accept_length(o["meta_info"])) for o in outs]
    return results


def _baseline(engine_pool, pair: str):
    key = f"{pair}-nospec-greedy"
    if key not in engine_pool.cache:
        engine = engine_pool.get(EngineConfig(pair=pair, spec=None, overlap=True))
        engine_pool.cache[key] = _run_all(engine)
    return engine_pool.cache[key]


VARIANTS = [("random", "topk1"), ("random", "topk4"), ("noisy-follower", "topk1"), ("noisy-follower", "topk4")]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{p}-{s}" for p, s in VARIANTS])
def spec_results(request, engine_pool):
    pair, spec = request.param
    baseline = _baseline(engine_pool, pair)
    engine = engine_pool.get(EngineConfig(pair=pair, spec=spec, overlap=True))
    info = engine.get_server_info()
    return f"{pair}-{spec}", info, _run_all(engine), engine_pool.stats(), baseline


def test_runtime_kept_overlap_and_intel_amx(spec_results):
    variant, info, _, stats, _ = spec_results
    assert info["attention_backend"] == "intel_amx", info["attention_backend"]
    assert info["disable_overlap_schedule"] is False, "the CPU runtime should keep the overlap scheduler on"
    assert info["speculative_algorithm"] == "EAGLE3"
    assert stats.get("scheduler_started"), stats
    assert stats.get("overlap_enabled") is True, stats
    assert stats.get("runtime_errors") == [], stats["runtime_errors"]


@pytest.mark.parametrize("case", list(CASES))
def test_spec_output_token_identical_to_nonspec(spec_results, case):
    variant, _, results, _, baseline = spec_results
    got, want = results[case], baseline[case]
    assert len(got) == len(want)
    for i, ((g_text, g_ids, _), (w_text, w_ids, _)) in enumerate(zip(got, want)):
        assert g_ids == w_ids, f"{variant} {case}[{i}]: ids differ\n spec:    {g_text!r}\n nonspec: {w_text!r}"
        assert g_text == w_text


def test_noisy_follower_accepts_drafts(spec_results):
    """Guard that the noisy-follower comparison really covers multi-token acceptance."""
    variant, _, results, _, _ = spec_results
    if not variant.startswith("noisy-follower"):
        pytest.skip("only the noisy follower is expected to accept drafts")
    lengths = {f"{case}[{i}]": round(out[2], 2) for case, outs in results.items() for i, out in enumerate(outs)}
    mean = sum(lengths.values()) / len(lengths)
    assert mean >= 1.2 and max(lengths.values()) >= 2.0, f"{variant}: accept lengths {lengths}; accept paths not exercised"
