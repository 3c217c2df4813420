"""Accept length and verify steps per output token on the real pair, constrained vs free.

The workload the forced-token drafting is judged on: SmolLM2-135M-Instruct with its locally trained EAGLE3
draft (``scripts/build_real_model.sh``) on the real CPU engine, overlap on, plugin on, greedy, the held-apart prompts
(``sglang_eo_dev.real_model.prompts.held_apart_requests``: prompts the draft never saw in training), sent as one batch
twice per round: with each prompt's JSON schema ("json") and without a grammar ("free"). Per EAGLE3 tree (topk 1: 3
steps / 4 draft tokens; topk 4: 3 steps / 8 tokens) one engine per grammar-aware drafting variant runs, one after
the other (:data:`VARIANTS`): forced drafts keyed also by the bonus token, the forced text's unstable tail drafted too
(the default; modes "json" and "free"), the same with the tail held back (``SGLANG_EAGLE_OVERLAP_FORCED_TAIL=0``), the
accepted node's own forced text only, tail held back (``SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS=0``), and forced drafts
off (``SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS=0``). The warm-up is the first prompts, short, once per mode. Per tree,
variant and mode it reports, summed over the requests of all rounds, and per schema family (tool-call arguments,
extraction, the rest):

* accept length = output tokens / verify steps (SGLang's ``spec_verify_ct``);
* verify steps per output token (its inverse: what forced drafts must lower for "json" below "free");
* the batch's wall time per verify step of its longest request (a CPU figure: the forward runs on the scheduler
  thread; compare modes of one run, not machines);
* how many answers parse as JSON;
* from the plugin's stats file: forced draft tokens proposed / accepted, and the grammar work per verify step on the
  host (advance + tree wait + mask build, which includes computing the forced continuations; ``sched ms``: what it
  cost the scheduler thread).

Run (one engine per tree, under the engine lock)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_real_pair.py [--rounds 2]

Writes benchmarks/results/real_pair_<sglang version>.{json,md}. Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))

from sglang_eagle_overlap.settings import DEFAULT_FORCED_BONUS_KEYS  # noqa: E402

MODES = ("json", "free")
# variant -> (forced drafts, bonus keys, the forced text's unstable tail drafted): the grammar-aware drafting
# variants compared, one engine each
VARIANTS = {"keyed": (True, DEFAULT_FORCED_BONUS_KEYS, True),
            "keyed, tail held": (True, DEFAULT_FORCED_BONUS_KEYS, False),
            "top path": (True, 0, False), "off": (False, 0, False)}
ROWS = (("keyed", "json"), ("keyed, tail held", "json"), ("top path", "json"), ("off", "json"), ("keyed", "free"))
VARIANTS_ON = ("top path", "keyed, tail held", "keyed")  # the grammar-aware variants, each compared with "off"
WARMUP_PROMPTS, WARMUP_TOKENS = 4, 48  # the warm-up batch per mode: the first prompts, this many tokens each
# schema family of the held-apart prompts -> the name the tables give it
FAMILIES = {"weather_args": "tool-call", "person": "extraction"}


# The plugin's forced-draft counters (stats file): replaced drafts, of those different from the draft model's own
# proposal, accepted, accepted of the different ones (what the replacement itself won), nodes with a continuation.
FORCED_KEYS = ("forced_proposed", "forced_changed", "forced_accepted", "forced_changed_accepted", "forced_nodes",
               "forced_keyed_nodes")


def _plugin_stats(path: Path) -> Dict[str, Any]:
    """The plugin's stats file; zeros when it never wrote one (NGRAM: its grammar batches are SGLang's own)."""
    if path.exists():
        return dict(json.loads(path.read_text()))
    return dict.fromkeys(("steps", *FORCED_KEYS, "advance_s", "tree_wait_s", "mask_s", "sched_s"), 0)


def run_tree(spec: str, rounds: int, max_new_tokens: int, variant: str, stats_dir: Path,
             draft: Optional[str] = None, algorithm: str = "EAGLE3") -> Dict[str, Any]:
    """One engine for ``spec``: a short warm-up batch per mode, then ``rounds`` measured batches per mode, alternating.
    ``variant`` (:data:`VARIANTS`): "keyed" runs both modes, the others the "json" mode only."""
    import os

    from transformers import AutoTokenizer

    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair, start_engine
    from sglang_eo_dev.real_model.evaluate import chat_prompt, parses_json
    from sglang_eo_dev.real_model.prompts import held_apart_requests

    forced, keys, tail = VARIANTS[variant]
    extra = (("speculative_draft_model_path", draft),) if draft else ()
    cfg = EngineConfig(pair="smollm2", spec=spec, overlap=True, product_plugin=True,  # type: ignore[arg-type]
                       algorithm=algorithm, extra=extra, forced_drafts=forced)  # type: ignore[arg-type]
    tok = AutoTokenizer.from_pretrained(model_pair(cfg).target)
    reqs = held_apart_requests()
    prompts = [chat_prompt(tok, r) for r in reqs]
    base = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    params = {"json": [dict(base, json_schema=r.schema_json()) for r in reqs], "free": [dict(base) for _ in reqs]}
    modes = MODES if variant == "keyed" else ("json",)
    acc: Dict[str, Dict[str, Any]] = {m: {"tokens": 0, "verify_steps": 0, "wall_s": 0.0, "longest_verify": 0,
                                          "parses": 0, "answers": 0, "finished": 0,
                                          "families": {}} for m in modes}
    stats = stats_dir / f"plugin-{algorithm}-{spec}-{variant.replace(' ', '_')}.json"
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = str(stats)
    os.environ["SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS"] = str(keys)
    os.environ["SGLANG_EAGLE_OVERLAP_FORCED_TAIL"] = str(int(tail))
    t0 = time.monotonic()
    engine = start_engine(cfg)
    start_s = time.monotonic() - t0
    texts: Dict[str, List[str]] = {}
    try:
        for mode in modes:  # warm-up (the engine's first batches; the first bonus keys learned)
            engine.generate(prompt=prompts[:WARMUP_PROMPTS], sampling_params=[
                dict(p, max_new_tokens=WARMUP_TOKENS) for p in params[mode][:WARMUP_PROMPTS]])
        before = _plugin_stats(stats)
        for _ in range(rounds):
            for mode in modes:
                t = time.monotonic()
                outs = engine.generate(prompt=prompts, sampling_params=params[mode])
                a = acc[mode]
                a["wall_s"] += time.monotonic() - t
                verify = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs]
                a["tokens"] += sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
                a["verify_steps"] += sum(verify)
                a["longest_verify"] += max(verify)
                a["parses"] += sum(parses_json(o["text"]) for o in outs)
                a["finished"] += sum((o["meta_info"].get("finish_reason") or {}).get("type") == "stop" for o in outs)
                a["answers"] += len(outs)
                for r, o, v in zip(reqs, outs, verify):
                    fam = a["families"].setdefault(FAMILIES.get(r.schema or "", "other"), [0, 0])
                    fam[0] += int(o["meta_info"]["completion_tokens"])
                    fam[1] += v
                texts.setdefault(mode, []).extend(o["text"] for o in outs)
        after = _plugin_stats(stats)
    finally:
        engine.shutdown()
        os.environ.pop("SGLANG_EAGLE_OVERLAP_STATS_FILE", None)
        os.environ.pop("SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS", None)
        os.environ.pop("SGLANG_EAGLE_OVERLAP_FORCED_TAIL", None)
    steps = after["steps"] - before["steps"]
    plugin = {k: after[k] - before[k] for k in FORCED_KEYS}
    plugin.update({k + "_ms": 1e3 * (after[k] - before[k]) / steps if steps else None
                   for k in ("advance_s", "tree_wait_s", "mask_s", "sched_s")})
    plugin["grammar_steps"] = steps
    for a in acc.values():
        a["accept_length"] = a["tokens"] / a["verify_steps"] if a["verify_steps"] else None
        a["verify_per_token"] = a["verify_steps"] / a["tokens"] if a["tokens"] else None
        a["ms_per_verify_step"] = 1e3 * a["wall_s"] / a["longest_verify"] if a["longest_verify"] else None
    return {"spec": spec, "algorithm": algorithm, "variant": variant, "forced": forced, "start_s": start_s, "prompts": len(reqs), "rounds": rounds, "modes": acc,
            "plugin": plugin, "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", action="append", choices=["topk1", "topk4"], help="draft tree(s) (default: both)")
    ap.add_argument("--algorithm", choices=["EAGLE3", "STANDALONE", "NGRAM"], default="EAGLE3",
                    help="EAGLE3 (the trained draft), STANDALONE (a 6-layer copy of the target), NGRAM (no draft "
                         "model; 8 draft tokens, one engine: forced drafts do not apply)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--draft", choices=["chat", "json"], default="chat",
                    help="EAGLE3 draft: chat = trained on general chat answers (default, the draft users have); "
                         "json = trained on JSON answers (the specialised draft; built and cached on first use)")
    ap.add_argument("--draft-epochs", type=int, default=None,
                    help="use the draft trained for this many epochs (built and cached on first use; default: the "
                         "recipe's)")
    ap.add_argument("--bonus-keys", type=int, default=None,
                    help="bonus keys of the keyed variant (default: the plugin's default)")
    ap.add_argument("--variant", action="append", choices=list(VARIANTS),
                    help="grammar-aware drafting variant(s) (default: all; keyed also runs the free prompts)")
    args = ap.parse_args()
    if args.bonus_keys is not None:
        VARIANTS["keyed"] = (True, args.bonus_keys, True)
        VARIANTS["keyed, tail held"] = (True, args.bonus_keys, False)
    from importlib.metadata import version

    import tempfile

    stats_dir = Path(tempfile.mkdtemp(prefix="bench-real-pair-"))
    draft = None
    if args.draft_epochs is not None or args.draft != "chat":
        from sglang_eo_dev.real_model.build import build_all

        draft = build_all(args.draft, args.draft_epochs)["eagle3"]
    algo = args.algorithm
    specs = ["topk1"] if algo == "NGRAM" else (args.spec or ["topk1", "topk4"])
    variants = args.variant or list(VARIANTS)
    results = [run_tree(s, args.rounds, args.max_new_tokens, variant, stats_dir, draft, algo)
               for s in specs for variant in (("keyed",) if algo == "NGRAM" else variants)]
    v = version("sglang")
    cmd = "flock /tmp/sglang-engine.lock " + shlex.join([sys.executable.replace(str(ROOT) + "/", ""),
                                                          "benchmarks/bench_real_pair.py", *sys.argv[1:]])
    env = (f"SGLang {v}, xgrammar {version('xgrammar')}, Python {platform.python_version()}, CPU engine on this "
           f"machine (shared, noisy); greedy, max_new_tokens {args.max_new_tokens}, plugin on, overlap on, JSON "
           f"without whitespace (constrained_json_disable_any_whitespace); {algo} draft: "
           + (f"the {args.draft}-trained one" + (f", {args.draft_epochs} epochs" if args.draft_epochs else "")
              if algo == "EAGLE3" else
              {"STANDALONE": "the target's first 6 of 30 layers, untrained",
               "NGRAM": "none (8 draft tokens)"}[algo]))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"real_pair_{v}"  # not Path.with_suffix: it would cut "0.5.16" to "0.5"
    if algo != "EAGLE3":
        stem += f"_{algo.lower()}"
    if args.draft != "chat":
        stem += f"_{args.draft}draft"
    if args.draft_epochs is not None:
        stem += f"_draft{args.draft_epochs}ep"
    if args.bonus_keys is not None:
        stem += f"_keys{args.bonus_keys}"
    if args.variant:
        stem += "_" + "_".join(re.sub(r"[^a-z0-9]+", "", v) for v in args.variant)
    (args.out / f"{stem}.json").write_text(json.dumps({"command": cmd, "env": env, "results": results}, indent=1))
    lines = [f"# Real pair: accept length and verify steps per output token, SGLang {v}", "",
             f"Command: `{cmd}`", "", env + ". SmolLM2-135M-Instruct + its draft, held-apart "
             "prompts as one batch, each round once with its JSON schema and once free; one engine per tree and "
             "grammar-aware drafting variant: forced drafts keyed also by the bonus token, the forced text's "
             "unstable tail drafted too (keyed, the default), the same with the tail held back (keyed, tail held), "
             "the accepted node's own forced text on the top path only, tail held back (top path), none (off). Sums "
             "over all measured rounds. "
             "Forced drafts and grammar ms per step: the plugin's counters over the measured rounds of that engine "
             "(both modes).", "",
             f"| {algo} | forced drafts | mode | answers | finished | parse as JSON | output tokens | verify steps | "
             "accept length | verify steps / token | ms per verify step (CPU) | forced proposed / changed / accepted / "
             "changed and accepted | "
             "grammar ms per step (sched) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    same: List[str] = []
    fam_lines = ["", "Verify steps per output token by schema family (tool-call: the get_weather arguments; "
                 "extraction: the person record; other: the rest), change against off:", "",
                 "| tree | family | free | off | " + " | ".join(VARIANTS_ON) + " |",
                 "|---|---|---|---|" + "---|" * len(VARIANTS_ON)]
    for spec in dict.fromkeys(r["spec"] for r in results):
        by = {r["variant"]: r for r in results if r["spec"] == spec}
        for onoff, mode in ROWS:
            if onoff not in by:
                continue
            r = by[onoff]
            a, p = r["modes"][mode], r["plugin"]
            label = "8 tokens" if r["algorithm"] == "NGRAM" else spec
            lines.append(f"| {label} | {onoff if r['algorithm'] != 'NGRAM' else 'n/a'} | {mode} | {a['answers']} | {a['finished']} | {a['parses']} | "
                         f"{a['tokens']} | {a['verify_steps']} | {a['accept_length']:.3f} | "
                         f"{a['verify_per_token']:.3f} | {a['ms_per_verify_step']:.0f} | "
                         f"{p['forced_proposed']} / {p['forced_changed']} / {p['forced_accepted']} / "
                         f"{p['forced_changed_accepted']} | "
                         f"{(p['advance_s_ms'] or 0) + (p['tree_wait_s_ms'] or 0) + (p['mask_s_ms'] or 0):.2f} "
                         f"({p['sched_s_ms'] or 0:.2f}) |")
        if "off" not in by:
            continue
        off = by["off"]["modes"]["json"]
        for variant in VARIANTS_ON:
            if variant not in by:
                continue
            on = by[variant]["modes"]["json"]
            same.append(f"{spec}, {variant}: json answers against forced drafts off "
                        f"{'identical' if by[variant]['texts']['json'] == by['off']['texts']['json'] else 'DIFFER'}; "
                        f"verify steps per token {off['verify_per_token']:.3f} -> {on['verify_per_token']:.3f} "
                        f"({100 * (on['verify_per_token'] / off['verify_per_token'] - 1):+.1f} %)"
                        + (f", free {by[variant]['modes']['free']['verify_per_token']:.3f}"
                           if "free" in by[variant]["modes"] else ""))
        base = off["families"]
        free = by["keyed"]["modes"]["free"]["families"] if "keyed" in by else {}
        for fam in sorted(base):
            def cell(f: Dict[str, List[int]], ref: bool = False) -> str:
                if fam not in f or not f[fam][0]:
                    return "-"
                x = f[fam][1] / f[fam][0]
                return f"{x:.3f}" if ref else f"{x:.3f} ({100 * (x / (base[fam][1] / base[fam][0]) - 1):+.1f} %)"
            fam_lines.append(f"| {spec} | {fam} | {cell(free, True)} | {cell(base, True)} | "
                             + " | ".join(cell(by[v]["modes"]["json"]["families"]) if v in by else "-"
                                          for v in VARIANTS_ON) + " |")
    lines += [""] + [f"- {x}" for x in same] + fam_lines
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
