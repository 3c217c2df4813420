"""Accept length and verify steps per output token on the real pair, constrained vs free (issues 18 and 19).

The workload the forced-token drafting (issue 19) is judged on: SmolLM2-135M-Instruct with its locally trained EAGLE3
draft (``scripts/build_real_model.sh``) on the real CPU engine, overlap on, plugin on, greedy, the held-apart prompts
(``sglang_eo_dev.real_model.prompts.held_apart_requests``: prompts the draft never saw in training), sent as one batch
twice per round: with each prompt's JSON schema ("json") and without a grammar ("free"). Per EAGLE3 tree (topk 1: 3
steps / 4 draft tokens; topk 4: 3 steps / 8 tokens) and mode it reports, summed over the requests of all rounds:

* accept length = output tokens / verify steps (SGLang's ``spec_verify_ct``);
* verify steps per output token (its inverse: what issue 19 must lower for "json" below "free");
* the batch's wall time per verify step of its longest request (a CPU figure: the forward runs on the scheduler
  thread; compare modes of one run, not machines);
* how many answers parse as JSON.

Run (one engine per tree, under the engine lock)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_real_pair.py [--rounds 2]

Writes benchmarks/results/real_pair_<sglang version>.{json,md}. Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))

MODES = ("json", "free")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def run_tree(spec: str, rounds: int, max_new_tokens: int) -> Dict[str, Any]:
    """One engine for ``spec``: a warm-up batch per mode, then ``rounds`` measured batches per mode, alternating."""
    from transformers import AutoTokenizer

    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair, start_engine
    from sglang_eo_dev.real_model.evaluate import chat_prompt
    from sglang_eo_dev.real_model.prompts import held_apart_requests

    cfg = EngineConfig(pair="smollm2", spec=spec, overlap=True, product_plugin=True)  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(model_pair(cfg).target)
    reqs = held_apart_requests()
    prompts = [chat_prompt(tok, r) for r in reqs]
    base = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    params = {"json": [dict(base, json_schema=r.schema_json()) for r in reqs], "free": [dict(base) for _ in reqs]}
    acc: Dict[str, Dict[str, Any]] = {m: {"tokens": 0, "verify_steps": 0, "wall_s": 0.0, "longest_verify": 0,
                                          "parses": 0, "answers": 0, "finished": 0} for m in MODES}
    t0 = time.monotonic()
    engine = start_engine(cfg)
    start_s = time.monotonic() - t0
    try:
        for mode in MODES:
            engine.generate(prompt=prompts, sampling_params=params[mode])  # warm-up
        for _ in range(rounds):
            for mode in MODES:
                t = time.monotonic()
                outs = engine.generate(prompt=prompts, sampling_params=params[mode])
                a = acc[mode]
                a["wall_s"] += time.monotonic() - t
                verify = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs]
                a["tokens"] += sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
                a["verify_steps"] += sum(verify)
                a["longest_verify"] += max(verify)
                a["parses"] += sum(_parses(o["text"]) for o in outs)
                a["finished"] += sum((o["meta_info"].get("finish_reason") or {}).get("type") == "stop" for o in outs)
                a["answers"] += len(outs)
    finally:
        engine.shutdown()
    for a in acc.values():
        a["accept_length"] = a["tokens"] / a["verify_steps"] if a["verify_steps"] else None
        a["verify_per_token"] = a["verify_steps"] / a["tokens"] if a["tokens"] else None
        a["ms_per_verify_step"] = 1e3 * a["wall_s"] / a["longest_verify"] if a["longest_verify"] else None
    return {"spec": spec, "start_s": start_s, "prompts": len(reqs), "rounds": rounds, "modes": acc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", choices=["topk1", "topk4"], help="EAGLE3 tree(s) (default: both)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from importlib.metadata import version

    results = [run_tree(s, args.rounds, args.max_new_tokens) for s in (args.spec or ["topk1", "topk4"])]
    v = version("sglang")
    cmd = "flock /tmp/sglang-engine.lock " + shlex.join([sys.executable.replace(str(ROOT) + "/", ""),
                                                          "benchmarks/bench_real_pair.py", *sys.argv[1:]])
    env = (f"SGLang {v}, xgrammar {version('xgrammar')}, Python {platform.python_version()}, CPU engine on this "
           f"machine (shared, noisy); greedy, max_new_tokens {args.max_new_tokens}, plugin on, overlap on")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"real_pair_{v}"  # not Path.with_suffix: it would cut "0.5.16" to "0.5"
    (args.out / f"{stem}.json").write_text(json.dumps({"command": cmd, "env": env, "results": results}, indent=1))
    lines = [f"# Real pair: accept length and verify steps per output token, SGLang {v} (issues 18, 19)", "",
             f"Command: `{cmd}`", "", env + ". SmolLM2-135M-Instruct + its locally trained EAGLE3 draft, held-apart "
             "prompts as one batch, each round once with its JSON schema and once free. Sums over all measured "
             "rounds.", "",
             "| EAGLE3 | mode | answers | finished | parse as JSON | output tokens | verify steps | accept length | "
             "verify steps / token | ms per verify step (CPU) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for mode in MODES:
            a = r["modes"][mode]
            lines.append(f"| {r['spec']} | {mode} | {a['answers']} | {a['finished']} | {a['parses']} | {a['tokens']} | "
                         f"{a['verify_steps']} | {a['accept_length']:.3f} | {a['verify_per_token']:.3f} | "
                         f"{a['ms_per_verify_step']:.0f} |")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
