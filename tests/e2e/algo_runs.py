"""One run per engine configuration, shared by the speculative-algorithm engine tests.

``test_algorithms``, ``test_reasoning_grammar``, ``test_logprobs`` and ``test_mixed_grammar_kinds`` all read the
results of :func:`run`: each configuration (algorithm x plugin on/off, plus the non-speculative baselines) is started
once per session and sends every case below, so the four modules together cost one engine start per configuration
(10 per SGLang version), whatever order pytest runs them in.

Models: the "think-follower" set (``sglang_eo_dev.cpu_runtime.models.build_think_follower_models``). Every target
writes the chain ``I see</think>\\n{"title": ...}<eos>`` after any prompt; every draft predicts the same chain, so
drafts are accepted several tokens at a time, and grammar-forced tokens make drafts be rejected too. All engines run with
``--reasoning-parser deepseek-r1``: requests without ``require_reasoning`` are constrained from their first token
(SGLang starts the reasoning wrapper in its generation state), those with it only after ``</think>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_SCHEMA

from .common import EBNF, REGEX, output_ids

REASONING_PARSER = "deepseek-r1"
ALGORITHMS = ("EAGLE", "NEXTN", "STANDALONE", "NGRAM")
PARAMS = {"temperature": 0.0, "max_new_tokens": 48}
SCHEMA = json.dumps(FOLLOWER_SCHEMA)
TOOL_BEGIN, TOOL_END = "<tool>", "</tool>"
STRUCTURAL_TAG = json.dumps({
    "type": "structural_tag",
    "format": {"type": "tag", "begin": TOOL_BEGIN, "content": {"type": "json_schema", "json_schema": FOLLOWER_SCHEMA},
               "end": TOOL_END},
})
# The chain's thinking text has 2 tokens, so </think> is output token 2. Output 0 comes from the prefill; the first
# verify window (topk 1, 3 steps) drafts outputs 1-3, so </think> is its middle draft and output 3 (the draft after it,
# "\n", which the grammar rejects) is where the grammar must start. 4 new tokens = exactly that first window.
MID_WINDOW_TOKENS = 4


@dataclass(frozen=True)
class Case:
    prompts: Tuple[str, ...]
    params: Tuple[Dict[str, Any], ...]
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    # One generate call per prompt: SGLang 0.5.16 drops ``require_reasoning`` when it splits a batch request
    # (``GenerateReqInput.__getitem__`` does not copy it; 0.5.23 does), so reasoning requests go one by one.
    one_by_one: bool = False


CASES: Dict[str, Case] = {
    # EBNF + regex + structural tag (tool call) + JSON schema + unconstrained in one batch.
    "mixed_kinds": Case(
        ("JSON please:", "Answer:", "Grammar:", "Call the tool:", "Free text:"),
        (dict(PARAMS, json_schema=SCHEMA), dict(PARAMS, regex=REGEX), dict(PARAMS, ebnf=EBNF),
         dict(PARAMS, structural_tag=STRUCTURAL_TAG), dict(PARAMS)),
    ),
    # Reasoning then structure: the grammar starts after </think>.
    "reasoning": Case(
        ("Think, then JSON:", "Think first. Then JSON please:", "Think, then answer:", "Think freely:"),
        (dict(PARAMS, json_schema=SCHEMA), dict(PARAMS, json_schema=SCHEMA), dict(PARAMS, regex=REGEX), dict(PARAMS)),
        (("require_reasoning", True),),
        one_by_one=True,
    ),
    # The first verify window only: </think> accepted in the middle of it, the grammar applied to the draft after it.
    "mid_window": Case(
        ("Think, then JSON:",),
        (dict(PARAMS, json_schema=SCHEMA, max_new_tokens=MID_WINDOW_TOKENS),),
        (("require_reasoning", True),),
        one_by_one=True,
    ),
    # Logprobs on constrained requests (and one unconstrained next to them).
    "logprobs": Case(
        ("JSON with logprobs:", "Regex with logprobs:", "Free with logprobs:"),
        (dict(PARAMS, json_schema=SCHEMA), dict(PARAMS, regex=REGEX), dict(PARAMS)),
        (("return_logprob", True), ("top_logprobs_num", 3)),
    ),
}


@dataclass
class Output:
    text: str
    ids: List[int]
    finish_reason: Any
    completion_tokens: int
    verify_ct: int
    logprobs: Optional[List[Tuple[float, int]]] = None  # (logprob, token id) per output token
    top_logprobs: Optional[List[List[Tuple[float, int]]]] = None


@dataclass
class Run:
    outputs: Dict[str, List[Output]]
    plugin_stats: Optional[Dict[str, Any]]  # the product plugin's stats file (None: never written)
    runtime: Dict[str, Any]  # the CPU runtime's scheduler counters
    extra: Dict[str, Any] = field(default_factory=dict)


def pair_for(algorithm: str) -> str:
    return "think-follower-mtp" if algorithm == "NEXTN" else "think-follower"


def config(algorithm: str, plugin: bool) -> EngineConfig:
    """Greedy ``algorithm`` (topk 1, 3 steps, 4 draft tokens; NGRAM: its own tree) under the overlap scheduler."""
    return EngineConfig(pair=pair_for(algorithm), spec="topk1", algorithm=algorithm, overlap=True,
                        product_plugin=plugin, reasoning_parser=REASONING_PARSER)


def baseline_config(algorithm: str) -> EngineConfig:
    """Non-speculative greedy decoding of the same target model as ``algorithm``'s runs."""
    return EngineConfig(pair=pair_for(algorithm), spec=None, overlap=True, product_plugin=False,
                        reasoning_parser=REASONING_PARSER)


def _pairs(entries: Any) -> Optional[List[Tuple[float, int]]]:
    if entries is None:
        return None
    return [(float(e[0]), int(e[1])) for e in entries]


def _output(res: Dict[str, Any]) -> Output:
    meta = res["meta_info"]
    top = meta.get("output_top_logprobs")
    return Output(
        text=res["text"], ids=output_ids(res), finish_reason=meta["finish_reason"],
        completion_tokens=int(meta["completion_tokens"]), verify_ct=int(meta.get("spec_verify_ct") or 0),
        logprobs=_pairs(meta.get("output_token_logprobs")),
        top_logprobs=[_pairs(t) or [] for t in top] if top is not None else None,
    )


def run(engine_pool: Any, cfg: EngineConfig) -> Run:
    """Send every case to the engine of ``cfg`` (started, or reused, by the session's pool); cached per session."""
    key = ("algorithms", cfg)
    if key in engine_pool.cache:
        return engine_pool.cache[key]
    engine, read_plugin_stats = engine_pool.get_with_plugin_stats(cfg, "algo")
    outputs = {}
    for name, case in CASES.items():
        if case.one_by_one:
            res = [engine.generate(prompt=p, sampling_params=sp, **dict(case.kwargs))
                   for p, sp in zip(case.prompts, case.params)]
        else:
            res = engine.generate(prompt=list(case.prompts), sampling_params=list(case.params), **dict(case.kwargs))
        outputs[name] = [_output(r) for r in res]
    plugin_stats = read_plugin_stats()
    result = Run(outputs=outputs, plugin_stats=plugin_stats, runtime=engine_pool.stats())
    engine_pool.cache[key] = result
    return result


def band(sglang_version: Tuple[int, ...]) -> str:
    return ".".join(map(str, sglang_version[:3]))
