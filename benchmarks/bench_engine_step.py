"""Decode step time of the real SGLang engine on CPU, plugin on vs off, under constrained EAGLE3 load.

For each EAGLE3 variant (topk 1: 3 steps / 4 draft tokens; topk 4: 3 steps / 8 draft tokens) a fresh in-process CPU
engine (``sglang_eo_dev.cpu_runtime.engine.start_engine``, the hand-set "follower" pair whose drafts the grammar accepts,
overlap scheduler on) is started per run, alternating plugin on / plugin off (``SGLANG_EAGLE_OVERLAP=0``):
on, off, on, off. Each run warms up once, then sends batches of 8 and 16 identical-schema requests
(``FOLLOWER_SCHEMA``, greedy, ``max_new_tokens`` 64; the follower writes its 16-token document then stops:
4 verify steps of 4 tokens), several rounds each, and checks every output is the follower document.

Measured in the scheduler process (``sglang_eo_dev.cpu_runtime.step_times``): the wall time of each decode step (one
scheduler-loop iteration between two grammar decode-batch launches: schedule + forward + verify mask + processing of
the previous result) and the time inside grammar work during it (SGLang's grammar entry points and the plugin's mask
step, nested regions counted once). Also read: the runtime's overlap counters (grammar decode batches run with
overlap disabled) and, plugin on, the plugin's own per-verify-step stats (advance / tree wait / mask).

Run (one engine at a time; the lock keeps other engine runs off the 2 cores)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python benchmarks/bench_engine_step.py
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_engine_step.py

Writes benchmarks/results/engine_step_<sglang version>.{json,md}. Medians over all full-batch decode steps of both
runs of a variant; ratio = off / on. On CPU the forward runs synchronously on the scheduler thread, so overlap hides
nothing: the numbers show the CPU work per step (grammar work, the removed forced sync), not GPU overlap. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

SPECS = ("topk1", "topk4")
BATCHES = (8, 16)
ORDER = ("on", "off")  # alternated, REPEATS times per spec
REPEATS = 2
ROUNDS = 10  # generate() calls per batch size per run (the follower needs 4-5 verify steps per request)
MAX_NEW_TOKENS = 64
PLUGIN_KEYS = ("steps", "grammar_s", "advance_s", "tree_wait_s", "mask_s")
COUNTER_KEYS = ("grammar_decode_batches", "overlap_disabled_grammar_decode_batches")


# -- pure helpers (tested in tests/test_bench_engine_step.py) ------------------------------------------------------
def full_batch_steps(steps: Sequence[Sequence[float]], bs: int) -> List[Sequence[float]]:
    """Step records ``[step_ms, grammar_ms, run_batch_ms, bs]`` of decode batches that held all ``bs`` requests."""
    return [s for s in steps if int(s[3]) == bs]


def summarize_steps(steps: Sequence[Sequence[float]]) -> Dict[str, Any]:
    """Medians of step / grammar / run_batch ms, the mean step (what a request pays: a few slow steps move it, not the
    median) and the grammar share of the step (median of per-step shares, and total grammar / total step)."""
    if not steps:
        return {"n": 0}
    step = [s[0] for s in steps]
    gram = [s[1] for s in steps]
    run = [s[2] for s in steps]
    return {
        "n": len(steps),
        "step_ms": statistics.median(step),
        "step_ms_p10": _quantile(step, 0.1),
        "step_ms_p90": _quantile(step, 0.9),
        "step_ms_mean": statistics.fmean(step),
        "grammar_ms": statistics.median(gram),
        "run_batch_ms": statistics.median(run),
        "grammar_share": statistics.median(g / s for g, s in zip(gram, step) if s > 0),
        "grammar_share_total": sum(gram) / sum(step) if sum(step) > 0 else 0.0,
    }


def _quantile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def delta(after: Dict[str, Any], before: Dict[str, Any], keys: Sequence[str]) -> Dict[str, float]:
    """``after - before`` for ``keys`` (missing = 0)."""
    return {k: (after.get(k) or 0) - (before.get(k) or 0) for k in keys}


def plugin_per_step_ms(d: Dict[str, float]) -> Optional[Dict[str, float]]:
    """Plugin stats delta -> the plugin's own means per verify step (``StepStats.per_step_ms``, the numbers of its
    log line) for ``PLUGIN_KEYS``; None when the plugin ran no step."""
    if not d.get("steps"):
        return None
    from sglang_eagle_overlap.core.stats import StepStats

    per = StepStats(**{k: d[k] for k in ("steps", "advance_s", "tree_wait_s", "mask_s")}).per_step_ms()
    return {k: per[k] for k in ("grammar_ms", "advance_ms", "tree_wait_ms", "mask_ms")}


def ratio(off: Dict[str, Any], on: Dict[str, Any], key: str = "step_ms") -> Optional[float]:
    if not off.get("n") or not on.get("n") or not on.get(key):
        return None
    return off[key] / on[key]


def markdown(result: Dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Decode step time on the CPU engine: plugin on vs off (SGLang {m['sglang']})",
        "",
        f"Command: `{result['command']}`",
        "",
        f"SGLang {m['sglang']}, xgrammar {m['xgrammar']}, torch {m['torch']}, Python {m['python']}, "
        f"{m['cpus']} CPUs ({m['processor'] or m['machine']}). Follower model pair (vocab {result['vocab']}), "
        f"overlap scheduler on, `FOLLOWER_SCHEMA` json_schema, greedy, max_new_tokens {MAX_NEW_TOKENS}; runs "
        f"alternate {', '.join(result['order'])} (fresh engine each), {result['rounds']} rounds per batch size per "
        "run after one warm-up. Medians over the full-batch decode steps of all runs of a variant "
        "(steps = scheduler-loop iterations between two grammar decode-batch launches, timed in the scheduler).",
        "",
        "`grammar ms` = time inside grammar work during the step (SGLang's grammar entry points + the plugin's mask "
        "step, nested counted once); `share` = median of per-step grammar/step; `sync-disabled` = grammar decode "
        "batches the scheduler ran with overlap disabled / all grammar decode batches; `accept` = tokens per verify "
        "step; plugin `adv/tree/mask` = the plugin's own per-verify-step stats.",
        "",
        "| EAGLE3 | bs | variant | steps | step ms (p10-p90) | grammar ms | share | run_batch ms | accept "
        "| sync-disabled | plugin adv/tree/mask ms | off/on step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for variant in ("on", "off"):
            s = row[variant]
            if not s["summary"].get("n"):
                empty = " – |" * 8
                lines.append(f"| {row['spec']} | {row['bs']} | {variant} | 0 |{empty}")
                continue
            su = s["summary"]
            p = s.get("plugin_ms")
            pl = f"{p['advance_ms']:.2f}/{p['tree_wait_ms']:.2f}/{p['mask_ms']:.2f}" if p else "–"
            r = row.get("ratio_off_on")
            rs = (f"{r:.2f}×" if r else "–") if variant == "on" else ""
            lines.append(
                f"| {row['spec']} | {row['bs']} | {variant} | {su['n']} | {su['step_ms']:.1f} "
                f"({su['step_ms_p10']:.1f}-{su['step_ms_p90']:.1f}) | {su['grammar_ms']:.2f} | "
                f"{su['grammar_share'] * 100:.1f}% | {su['run_batch_ms']:.1f} | {s['accept_length']:.2f} | "
                f"{s['overlap_disabled']}/{s['grammar_decode_batches']} | {pl} | {rs} |"
            )
    per_run = ", ".join(
        f"{r['spec']} {r['variant']}#{r['rep']}: bs8 {r['median_step_ms'].get('8', 0):.1f} / bs16 "
        f"{r['median_step_ms'].get('16', 0):.1f} ms (start {r['start_s']:.0f} s)"
        for r in result["runs"]
    )
    lines += ["", f"Per-run median step ms: {per_run}.", ""]
    if result.get("problems"):
        lines += ["Problems seen:", ""] + [f"- {p}" for p in result["problems"]] + [""]
    return "\n".join(lines)


# -- engine runs ---------------------------------------------------------------------------------------------------
def _machine() -> Dict[str, Any]:
    from importlib.metadata import version

    import torch

    return {
        "sglang": version("sglang"),
        "xgrammar": version("xgrammar"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor(),
        "machine": platform.machine(),
    }


def _one_run(spec: str, variant: str, rep: int, rounds: int, tmp: str, problems: List[str]) -> Dict[str, Any]:
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, start_engine
    from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA
    from sglang_eo_dev.cpu_runtime.stats import read_stats
    from sglang_eo_dev.cpu_runtime.step_times import STEP_TIMES_ENV, read_step_times

    tag = f"{spec}-{variant}-{rep}"
    step_file = os.path.join(tmp, f"steps-{tag}.json")
    plugin_file = os.path.join(tmp, f"plugin-{tag}.json")
    stats_file = os.path.join(tmp, f"runtime-{tag}.json")
    for f in (step_file, plugin_file):
        if os.path.exists(f):
            os.remove(f)
    os.environ[STEP_TIMES_ENV] = step_file
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = plugin_file
    cfg = EngineConfig(pair="follower", spec=spec, overlap=True, product_plugin=(variant == "on"),
                       max_running_requests=max(BATCHES))
    t0 = time.monotonic()
    engine = start_engine(cfg, stats_file=stats_file)
    start_s = time.monotonic() - t0
    params = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "json_schema": json.dumps(FOLLOWER_SCHEMA)}

    def load(bs: int) -> List[Dict[str, Any]]:
        outs = engine.generate(prompt=[f"Record {i} as JSON:" for i in range(bs)], sampling_params=params)
        for o in outs:
            if json.loads(o["text"]) != FOLLOWER_DOCUMENT:
                problems.append(f"{tag} bs{bs}: output {o['text']!r} is not the follower document")
        return outs

    out: Dict[str, Any] = {"spec": spec, "variant": variant, "rep": rep, "start_s": start_s, "phases": {}}
    try:
        load(max(BATCHES))  # warm-up
        for bs in BATCHES:
            n0 = len(read_step_times(step_file)["steps"])
            c0, p0 = read_stats(stats_file), read_stats(plugin_file)
            tokens = verify = 0
            for _ in range(rounds):
                for o in load(bs):
                    tokens += o["meta_info"]["completion_tokens"]
                    verify += o["meta_info"].get("spec_verify_ct") or 0
            st = read_step_times(step_file)
            c1, p1 = read_stats(stats_file), read_stats(plugin_file)
            out["phases"][str(bs)] = {
                "steps": st["steps"][n0:],
                "counters": delta(c1, c0, COUNTER_KEYS),
                "plugin": delta(p1, p0, PLUGIN_KEYS) if p1 else None,
                "accept_length": tokens / verify if verify else 0.0,
            }
        errors = read_step_times(step_file).get("errors") or []
        problems += [f"{tag}: {e}" for e in errors]
        rt_errors = read_stats(stats_file).get("runtime_errors") or []
        problems += [f"{tag}: runtime error: {e}" for e in rt_errors]
        plugin_active = (read_stats(plugin_file) or {}).get("active")
        if (variant == "on") != bool(plugin_active):
            problems.append(f"{tag}: product plugin active={plugin_active!r}, expected {variant == 'on'}")
    finally:
        engine.shutdown()
    out["median_step_ms"] = {
        bs: summarize_steps(full_batch_steps(ph["steps"], int(bs))).get("step_ms", 0.0)
        for bs, ph in out["phases"].items()
    }
    return out


def aggregate(runs: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (spec that ran, batch size), both variants side by side."""
    rows = []
    for spec in dict.fromkeys(r["spec"] for r in runs):
        for bs in BATCHES:
            row: Dict[str, Any] = {"spec": spec, "bs": bs}
            for variant in ("on", "off"):
                phases = [r["phases"][str(bs)] for r in runs if r["spec"] == spec and r["variant"] == variant
                          and str(bs) in r["phases"]]
                steps = [s for ph in phases for s in full_batch_steps(ph["steps"], bs)]
                counters = {k: sum(ph["counters"][k] for ph in phases) for k in COUNTER_KEYS}
                plugin_tot = {k: sum((ph["plugin"] or {}).get(k, 0) for ph in phases) for k in PLUGIN_KEYS}
                row[variant] = {
                    "summary": summarize_steps(steps),
                    "all_steps": sum(len(ph["steps"]) for ph in phases),
                    "grammar_decode_batches": counters["grammar_decode_batches"],
                    "overlap_disabled": counters["overlap_disabled_grammar_decode_batches"],
                    "plugin_ms": plugin_per_step_ms(plugin_tot),
                    "accept_length": statistics.mean(ph["accept_length"] for ph in phases) if phases else 0.0,
                }
            row["ratio_off_on"] = ratio(row["off"]["summary"], row["on"]["summary"])
            rows.append(row)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    specs = [s for s in args.specs.split(",") if s]

    machine = _machine()
    problems: List[str] = []
    runs: List[Dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-engine-step-") as tmp:
        for spec in specs:
            for rep in range(args.repeats):
                for variant in ORDER:
                    r = _one_run(spec, variant, rep, args.rounds, tmp, problems)
                    runs.append(r)
                    print(f"[{time.monotonic() - t0:.0f}s] {spec} {variant}#{rep}: start {r['start_s']:.0f}s, "
                          f"median step ms {r['median_step_ms']}", flush=True)
    result = {
        "command": "flock /tmp/sglang-engine.lock " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT), "benchmarks/bench_engine_step.py",
                                     *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine,
        "vocab": __import__("sglang_eo_dev.cpu_runtime.engine", fromlist=["EngineConfig"]).EngineConfig().vocab_size,
        "order": [f"{v}#{rep}" for rep in range(args.repeats) for v in ORDER],
        "rounds": args.rounds,
        "batches": list(BATCHES),
        "wall_s": time.monotonic() - t0,
        "rows": aggregate(runs),
        "runs": [{k: v for k, v in r.items() if k != "phases"} for r in runs],
        "raw": runs,
        "problems": problems,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"engine_step_{machine['sglang']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / name}.json and .md in {result['wall_s']:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
