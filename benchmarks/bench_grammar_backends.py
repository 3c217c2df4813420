"""Grammar backends on the real SGLang engine on CPU: what a new schema costs its first token, and the decode step.

Variants, each in its own in-process CPU engine (``sglang_eo_dev.cpu_runtime.engine.start_engine``) set up as
``bench_scheduler_budget.py`` sets up its default path: the product plugin on with its defaults (grammar thread),
EAGLE3 topk 1 (3 steps / 4 draft tokens), the random model pair (accept ~1: every step pays the full tree mask), the
128k-vocabulary tokenizer, ``constrained_json_disable_any_whitespace``, jemalloc, and the GPU table's schema
``BENCH_SCHEMA`` (``bench_gpu_constrained.py``):

* ``xgrammar``: ``--grammar-backend xgrammar`` with ``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN=0``, the schema compiled
  as sent;
* ``xgrammar-pattern``: the same with the switch on (``=1``): ``maxLength`` strings compiled as patterns. Only where
  the installed xgrammar has a measured bound (``settings.MAX_LENGTH_PATTERN_BOUNDS``: xgrammar 0.2.7, SGLang 0.5.23);
  with any other xgrammar the switch changes nothing, so the variant is skipped and the results say so;
* ``llguidance``: ``--grammar-backend llguidance`` (the switch does not apply to it).

In each engine, after a warm-up of every batch size (``--warmup-tokens``; ``BENCH_SCHEMA``'s after ``first`` below):

1. time to first token: the wall time of one ``max_new_tokens=1`` generate, one request at a time. ``first``: the
   engine's first ``BENCH_SCHEMA`` request (one per engine; the warm-up before it sent unconstrained requests and a
   small other schema, ``WARMUP_SCHEMA``), a cold compile; ``fresh``: a schema text the engine has never seen
   (``BENCH_SCHEMA`` with its own top-level ``description`` per trial, :func:`fresh_schema`: the same language, a new
   text, so SGLang's grammar cache misses and the backend compiles it; a backend may still reuse what it compiled
   for an equal grammar, which xgrammar's compiler does: ``first`` against ``fresh`` shows it); ``cached``: the
   ``BENCH_SCHEMA`` text again (SGLang's grammar cache hits); an unconstrained request. ``--ttft-trials`` of the last
   three, interleaved, medians (``compile`` = fresh - cached, ``cold`` = first - cached);
2. the decode step per ``--batches`` size: ``--rounds`` rounds of unconstrained (``ignore_eos``) then ``BENCH_SCHEMA``
   requests of ``--max-new-tokens`` (the schema's ``log`` needs >= 64 items, so json requests run to the limit, into
   the log items' ``maxLength`` strings; the table gives how many outputs got into the log and how many items they
   began, and how many hold a raw control character, which is not JSON; with both xgrammar variants, where their
   greedy outputs part). Step wall times from the dev step probe (``sglang_eo_dev.cpu_runtime.step_times``, read as
   ``bench_scheduler_budget.py`` reads them), full-batch steps only: median and mean, and json / unconstrained of the
   same engine;
3. from the plugin's stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``) over the json rounds: mask time-limit hits
   (``mask_timeouts``) per request and per verify step, the mean mask ms per verify step (``mask_s / steps``), and the
   counters that show which path ran (``guidance_steps``: llguidance's batched walk; ``schemas_rewritten``: the
   switch's rewrites).

Run (one engine at a time: the lock keeps other engine runs off the 2 cores)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_grammar_backends.py
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python benchmarks/bench_grammar_backends.py

Writes ``benchmarks/results/grammar_backends_<sglang>.{json,md}`` (``--out`` to change). CPU figures on a shared
machine, noisy: read medians, means and the ratios against the unconstrained peer of the same engine, not absolute
times across engines. Not a test: no timing gates anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_engine_step import _machine, delta  # noqa: E402  one harness: shared helpers
from bench_gpu_constrained import BENCH_SCHEMA  # noqa: E402  the GPU table's schema
from bench_scheduler_budget import (  # noqa: E402  the same engines, requests and step records
    PLUGIN_KEYS,
    VOCAB,
    _params,
    _prompts,
    cell_summary,
    path_switches,
    use_allocator,
)

VARIANTS = ("xgrammar", "xgrammar-pattern", "llguidance")
BATCHES = (8, 1)
PATTERN_ENV = "SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN"
PLUGIN_STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
COUNTER_KEYS = ("guidance_steps", "schemas_rewritten")
STATS_KEYS = tuple(PLUGIN_KEYS) + COUNTER_KEYS
TTFT_KINDS = ("fresh", "cached", "unconstrained")
# The warm-up's schema before the first BENCH_SCHEMA request: it takes the backend's one-off costs (its first compile,
# its first mask) out of that request's time while sharing no string, number or array rule with BENCH_SCHEMA.
WARMUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                 "additionalProperties": False}


# -- pure helpers (tests/benchmarks/test_bench_grammar_backends.py) ----------------------------------------------
def variant_setup(variant: str) -> Tuple[str, Optional[str]]:
    """``(grammar_backend, value of SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN)`` of a variant; None leaves the switch
    unset (the plugin's default; it rewrites only what xgrammar compiles)."""
    return {"xgrammar": ("xgrammar", "0"), "xgrammar-pattern": ("xgrammar", "1"),
            "llguidance": ("llguidance", None)}[variant]


def pattern_applies(xgrammar_version: Optional[str]) -> bool:
    """Whether the maxLength-pattern switch changes anything with this xgrammar (the plugin's own test: a measured
    bound in ``settings.MAX_LENGTH_PATTERN_BOUNDS``)."""
    from sglang_eagle_overlap.settings import Settings

    return Settings(max_length_pattern=True).max_length_pattern_bound(xgrammar_version) is not None


def runnable_variants(requested: Sequence[str], xgrammar_version: Optional[str]) -> Tuple[List[str], List[str]]:
    """The variants to run, and a note per variant left out (``xgrammar-pattern`` where the switch does nothing)."""
    run, skipped = [], []
    for v in requested:
        if v == "xgrammar-pattern" and not pattern_applies(xgrammar_version):
            skipped.append(f"{v}: skipped, the maxLength-pattern switch does nothing with xgrammar {xgrammar_version} "
                           "(no measured bound in MAX_LENGTH_PATTERN_BOUNDS): it would be the xgrammar variant again")
        else:
            run.append(v)
    return run, skipped


def fresh_schema(tag: str, trial: int) -> str:
    """The text of ``BENCH_SCHEMA`` with a top-level ``description`` naming ``tag`` and ``trial``: a text no earlier
    request sent (so it misses every grammar cache keyed on it) for the same set of documents (an annotation)."""
    return json.dumps(dict(BENCH_SCHEMA, description=f"bench_grammar_backends {tag} trial {trial}"))


def per_request(count: float, requests: int) -> Optional[float]:
    """``count`` events spread over ``requests`` requests (None when none ran)."""
    return count / requests if requests else None


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def difference(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def step_summary(steps: Sequence[Sequence[float]], bs: int) -> Dict[str, Any]:
    """``bench_scheduler_budget.cell_summary`` of the full-batch steps (medians: step, device, the scheduler
    thread's CPU and grammar-call time) plus the mean and p90 step: a few slow grammar states move the mean, not the
    median."""
    out = cell_summary(steps, bs)
    full = sorted(s[0] for s in steps if int(s[3]) == bs and len(s) >= 6)
    if full:
        out["step_ms_mean"] = statistics.fmean(full)
        out["step_ms_p90"] = full[min(len(full) - 1, int(0.9 * (len(full) - 1) + 0.5))]
    return out


def ttft_summary(trials: Sequence[float]) -> Dict[str, Any]:
    if not trials:
        return {"n": 0}
    return {"n": len(trials), "median_ms": statistics.median(trials), "min_ms": min(trials), "max_ms": max(trials),
            "trials_ms": list(trials)}


def log_reach(texts: Sequence[str]) -> Dict[str, Any]:
    """How far json outputs got into ``BENCH_SCHEMA``: the share that began the ``log`` array, the mean number of log
    items begun (``"m"`` keys; ``t`` comes first in an item, so an item whose ``m`` began is in its string), and the
    share holding a raw control character (U+0000-U+001F: not JSON; what the maxLength pattern leaves out)."""
    if not texts:
        return {"n": 0}
    return {"n": len(texts), "in_log": sum('"log"' in t for t in texts) / len(texts),
            "m_strings": statistics.fmean(t.count('"m"') for t in texts),
            "control": sum(any(ord(ch) < 0x20 for ch in t) for t in texts) / len(texts)}


def compare_outputs(base: Sequence[str], other: Sequence[str]) -> Dict[str, int]:
    """Pairs of greedy outputs of two engines: ``identical``, ``at_control`` (they part where ``base`` wrote a raw
    control character: the maxLength pattern does not admit one, so ``xgrammar-pattern`` may only part from ``xgrammar``
    there), ``other`` (anywhere else)."""
    out = {"identical": 0, "at_control": 0, "other": 0}
    for a, b in zip(base, other):
        if a == b:
            out["identical"] += 1
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["at_control" if i < len(a) and ord(a[i]) < 0x20 else "other"] += 1
    return out


def plugin_summary(d: Dict[str, float], requests: int) -> Dict[str, Any]:
    """The plugin's stats over the json rounds -> mask ms per verify step, time-limit hits per request and per step,
    and the path counters."""
    steps = d.get("steps") or 0
    timeouts = d.get("mask_timeouts") or 0
    return {"steps": steps, "requests": requests, "mask_timeouts": timeouts,
            "mask_ms_per_step": d.get("mask_s", 0.0) / steps * 1e3 if steps else None,
            "sched_ms_per_step": d.get("sched_s", 0.0) / steps * 1e3 if steps else None,
            "timeouts_per_request": per_request(timeouts, requests),
            "timeouts_per_step": per_request(timeouts, steps),
            **{k: d.get(k, 0) for k in COUNTER_KEYS}}


def path_problems(variant: str, totals: Dict[str, Any]) -> List[str]:
    """What the plugin's final stats say against the variant's path (the switch's rewrites, llguidance's walk)."""
    out = []
    if not totals.get("active"):
        out.append(f"{variant}: plugin active={totals.get('active')!r}")
    rewritten = totals.get("schemas_rewritten") or 0
    if variant == "xgrammar" and rewritten:
        out.append(f"{variant}: {rewritten} schemas rewritten with the switch off")
    if variant == "xgrammar-pattern" and not rewritten:
        out.append(f"{variant}: no schema rewritten with the switch on")
    if variant == "llguidance" and not totals.get("guidance_steps"):
        out.append(f"{variant}: no verify step took llguidance's batched walk")
    if variant != "llguidance" and totals.get("guidance_steps"):
        out.append(f"{variant}: {totals['guidance_steps']} llguidance steps in an xgrammar engine")
    return out


def _f(x: Optional[float], fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(result: Dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Grammar backends on the CPU engine, SGLang {m['sglang']}",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Date {result['date']}, revision {result['revision']}{' (with local changes)' if result['dirty'] else ''}. "
        f"SGLang {m['sglang']}, xgrammar {m['xgrammar']}, llguidance {m.get('llguidance')}, torch {m['torch']}, "
        f"Python {m['python']}, {m['cpus']} CPUs ({m['processor'] or m['machine']}, shared with other jobs). "
        f"Random model pair, vocab {VOCAB}, EAGLE3 topk 1 (3 steps / 4 draft tokens), overlap on, the plugin on "
        f"(grammar thread), `BENCH_SCHEMA` with `constrained_json_disable_any_whitespace`, greedy, host allocator "
        f"{result['allocator']}; one engine per variant, in the order {', '.join(result['variants'])}.",
        "",
        "CPU figures, noisy (2 shared cores): compare medians, means and each engine's ratio against its own "
        "unconstrained peer; absolute times across engines move with the machine's load.",
        "",
    ]
    lines += [f"- {s}" for s in result.get("skipped") or []]
    if result.get("skipped"):
        lines.append("")
    lines += [
        "## Time to first token",
        "",
        f"One request at a time, `max_new_tokens` 1. `first` = the engine's first `BENCH_SCHEMA` request, a cold "
        "compile (one per engine, after a warm-up on another small schema); `fresh` = a schema text the engine has "
        "never seen (`BENCH_SCHEMA` plus a distinct top-level `description`: the same language): SGLang's grammar "
        "cache misses, and what the backend's compiler reuses from an equal grammar it compiled before is not "
        "recompiled; `cached` = the `BENCH_SCHEMA` text again (SGLang's grammar cache hits). "
        f"{result['ttft_trials']} trials of fresh / cached / unconstrained, interleaved; medians. `cold` = first - "
        "cached, `compile` = fresh - cached.",
        "",
        "| variant | first ms | fresh ms (median, min-max) | cached ms | unconstrained ms | cold ms | compile ms "
        "| fresh / cached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in result["variants"]:
        t = result["ttft"].get(v) or {}
        fi = (t.get("first") or {}).get("median_ms")
        fr, ca, un = (t.get(k) or {} for k in TTFT_KINDS)
        cached = ca.get("median_ms")
        rng = f" ({_f(fr.get('min_ms'), '{:.0f}')}-{_f(fr.get('max_ms'), '{:.0f}')})" if fr.get("n") else ""
        lines.append(f"| {v} | {_f(fi, '{:.0f}')} | {_f(fr.get('median_ms'), '{:.0f}')}{rng} | "
                     f"{_f(cached, '{:.0f}')} | {_f(un.get('median_ms'), '{:.0f}')} | "
                     f"{_f(difference(fi, cached), '{:.0f}')} | "
                     f"{_f(difference(fr.get('median_ms'), cached), '{:.0f}')} | "
                     f"{_f(ratio(fr.get('median_ms'), cached), '{:.1f}×')} |")
    lines += [
        "",
        "## Decode step",
        "",
        f"{result['rounds']} round(s) per kind per batch size after the warm-up, `max_new_tokens` "
        f"{result['max_new_tokens']}; step = one scheduler-loop iteration between two decode launches (dev step "
        "probe), full-batch steps only. `json / unc` = the json step over the unconstrained step of the same engine "
        "(median over median, mean over mean). From the plugin's stats over the json rounds: `mask ms` = mask build "
        "ms per verify step (`mask_s / steps`); `limit hits` = mask time-limit hits (`mask_timeouts`) per request "
        "and per verify step. `log` = share of json outputs that began the `log` array / mean log items begun; "
        "`ctrl` = share of json outputs holding a raw control character (U+0000-U+001F, not valid JSON).",
        "",
        "| variant | bs | steps (unc / json) | json step ms (median / mean) | unc step ms (median / mean) "
        "| json / unc (median / mean) | grammar calls ms | mask ms | limit hits per request / per step | log "
        "| ctrl | accept |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        j, u, p = row["json"], row["unconstrained"], row["plugin"]
        lg = row["log"]
        lines.append(
            f"| {row['variant']} | {row['bs']} | {u.get('n', 0)} / {j.get('n', 0)} | "
            f"{_f(j.get('step_ms'))} / {_f(j.get('step_ms_mean'))} | {_f(u.get('step_ms'))} / "
            f"{_f(u.get('step_ms_mean'))} | {_f(row['ratio_median'], '{:.2f}×')} / "
            f"{_f(row['ratio_mean'], '{:.2f}×')} | "
            f"{_f(j.get('grammar_ms'), '{:.2f}')} | {_f(p.get('mask_ms_per_step'), '{:.2f}')} | "
            f"{_f(p.get('timeouts_per_request'), '{:.2f}')} / {_f(p.get('timeouts_per_step'), '{:.3f}')} | "
            f"{_f(lg.get('in_log'), '{:.0%}')} / {_f(lg.get('m_strings'), '{:.1f}')} | "
            f"{_f(lg.get('control'), '{:.0%}')} | "
            f"{_f(row.get('accept_length'), '{:.2f}')} |")
    lines += ["", "`grammar calls ms` = median scheduler-thread time inside grammar calls per json step (step probe). "
              "`accept` = tokens per verify step of the json requests.", ""]
    counters = "; ".join(f"{v}: schemas_rewritten {c.get('schemas_rewritten', 0)}, guidance_steps "
                         f"{c.get('guidance_steps', 0)}" for v, c in result["counters"].items())
    lines += [f"Plugin counters at the end of each engine: {counters}.", ""]
    po = result.get("pattern_outputs")
    if po is not None:
        lines += [f"Greedy json outputs of `xgrammar-pattern` against `xgrammar`'s, pair by pair: {po['identical']} "
                  f"identical, {po['at_control']} parting where `xgrammar` wrote a raw control character (which the "
                  f"pattern does not admit), {po['other']} parting elsewhere.", ""]
    starts = ", ".join(f"{r['variant']} {r['start_s']:.0f} s start / {r['wall_s']:.0f} s total" for r in result["runs"])
    lines += [f"Engines: {starts}.", ""]
    if result.get("problems"):
        lines += ["Problems seen:", ""] + [f"- {p}" for p in result["problems"]] + [""]
    return "\n".join(lines)


# -- engine runs ---------------------------------------------------------------------------------------------------
def _generate(engine: Any, prompts: Any, params: Dict[str, Any]) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = engine.generate(prompt=prompts, sampling_params=params)
    return (time.perf_counter() - t0) * 1e3, out


def one_engine(variant: str, args: argparse.Namespace, tmp: str, problems: List[str]) -> Dict[str, Any]:
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, start_engine
    from sglang_eo_dev.cpu_runtime.stats import read_stats
    from sglang_eo_dev.cpu_runtime.step_times import STEP_TIMES_ENV, read_step_times

    backend, pattern = variant_setup(variant)
    step_file = os.path.join(tmp, f"steps-{variant}.json")
    plugin_file = os.path.join(tmp, f"plugin-{variant}.json")
    runtime_file = os.path.join(tmp, f"runtime-{variant}.json")
    os.environ[STEP_TIMES_ENV] = step_file
    os.environ[PLUGIN_STATS_ENV] = plugin_file
    if pattern is None:
        os.environ.pop(PATTERN_ENV, None)
    else:
        os.environ[PATTERN_ENV] = pattern
    forced, threaded = path_switches("thread")  # bench_scheduler_budget's default path
    cfg = EngineConfig(pair="random", spec="topk1", overlap=True, product_plugin=True, vocab_size=VOCAB,
                       forced_drafts=forced, grammar_thread=threaded, max_running_requests=max(args.batches),
                       extra=(("constrained_json_disable_any_whitespace", True), ("disable_radix_cache", True),
                              ("grammar_backend", backend)))
    t0 = time.monotonic()
    engine = start_engine(cfg, stats_file=runtime_file)
    out: Dict[str, Any] = {"variant": variant, "backend": backend, "pattern_env": pattern,
                           "start_s": time.monotonic() - t0, "ttft": {k: [] for k in ("first",) + TTFT_KINDS},
                           "cells": {}}
    try:
        def first_token(kind: str, params: Dict[str, Any], i: int) -> None:
            ms, o = _generate(engine, f"First token {i}: write the service record as JSON.", params)
            n = o["meta_info"]["completion_tokens"]
            if n != 1 or (kind != "unconstrained" and not o["text"].startswith("{")):
                problems.append(f"{variant} ttft {kind} #{i}: {n} tokens, text {o['text']!r}")
            out["ttft"][kind].append(ms)

        for bs in args.batches:  # warm-up: buffers, then the backend's first compile on another schema
            engine.generate(prompt=_prompts(bs, 999), sampling_params=_params("unconstrained", args.warmup_tokens))
        engine.generate(prompt=_prompts(1, 998), sampling_params=dict(
            _params("json", args.warmup_tokens), json_schema=json.dumps(WARMUP_SCHEMA)))
        first_token("first", _params("json", 1), 0)  # BENCH_SCHEMA compiled for the first time in this engine
        for bs in args.batches:
            engine.generate(prompt=_prompts(bs, 999), sampling_params=_params("json", args.warmup_tokens))
        for i in range(args.ttft_trials):
            for kind in TTFT_KINDS:
                params = _params("unconstrained" if kind == "unconstrained" else "json", 1)
                if kind == "fresh":
                    params["json_schema"] = fresh_schema(variant, i)
                first_token(kind, params, i)
        for bs in args.batches:
            cell: Dict[str, Any] = {"unconstrained": [], "json": [], "plugin": dict.fromkeys(STATS_KEYS, 0.0),
                                    "requests": 0, "texts": [], "tokens": 0, "verify": 0}
            for rnd in range(args.rounds):
                for kind in ("unconstrained", "json"):
                    n0 = len(read_step_times(step_file)["steps"])
                    p0 = read_stats(plugin_file)
                    outs = engine.generate(prompt=_prompts(bs, rnd), sampling_params=_params(kind, args.max_new_tokens))
                    cell[kind] += read_step_times(step_file)["steps"][n0:]
                    if kind == "json":
                        d = delta(read_stats(plugin_file), p0, STATS_KEYS)
                        cell["plugin"] = {k: cell["plugin"][k] + d[k] for k in STATS_KEYS}
                        cell["requests"] += len(outs)
                        cell["texts"] += [o["text"] for o in outs]
                        cell["tokens"] += sum(o["meta_info"]["completion_tokens"] for o in outs)
                        cell["verify"] += sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outs)
            out["cells"][str(bs)] = cell
        probe = read_step_times(step_file)
        problems += [f"{variant}: {e}" for e in probe.get("errors") or []]
        problems += [f"{variant}: runtime error: {e}" for e in read_stats(runtime_file).get("runtime_errors") or []]
        totals = read_stats(plugin_file)
        out["counters"] = {k: totals.get(k, 0) for k in COUNTER_KEYS + ("mask_timeouts", "steps")}
        problems += path_problems(variant, totals)
    finally:
        engine.shutdown()
        os.environ.pop(PATTERN_ENV, None)
    out["wall_s"] = time.monotonic() - t0
    return out


def aggregate(runs: Sequence[Dict[str, Any]], batches: Sequence[int]) -> List[Dict[str, Any]]:
    rows = []
    for r in runs:
        for bs in batches:
            c = r["cells"].get(str(bs))
            if c is None:
                continue
            j, u = step_summary(c["json"], bs), step_summary(c["unconstrained"], bs)
            rows.append({"variant": r["variant"], "bs": bs, "json": j, "unconstrained": u,
                         "ratio_median": ratio(j.get("step_ms"), u.get("step_ms")),
                         "ratio_mean": ratio(j.get("step_ms_mean"), u.get("step_ms_mean")),
                         "plugin": plugin_summary(c["plugin"], c["requests"]), "log": log_reach(c["texts"]),
                         "accept_length": ratio(c["tokens"], c["verify"])})
    return rows


def _revision() -> Tuple[str, bool]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "HEAD") or "unknown", bool(git("status", "--porcelain", "--", "sglang_eagle_overlap"))


def command_line(argv: Sequence[str]) -> str:
    """The command that ran this, as the Run section writes it (the lock, ``nice`` when the process ran niced)."""
    nice = os.nice(0)
    parts = ["flock", "/tmp/sglang-engine.lock"] + (["nice", "-n", str(nice)] if nice else [])
    parts += [os.path.relpath(sys.executable, ROOT), "benchmarks/bench_grammar_backends.py", *argv]
    return " ".join(shlex.quote(p) for p in parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}, run in this order")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--ttft-trials", type=int, default=5)
    ap.add_argument("--allocator", choices=("jemalloc", "system"), default="jemalloc",
                    help="host allocator of the engines (bench_scheduler_budget.use_allocator)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    argv = list(argv if argv is not None else sys.argv[1:])
    requested = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in requested):
        ap.error(f"--variants: expected names from {VARIANTS}, got {requested}")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    use_allocator(args.allocator)

    machine = _machine()
    from importlib.metadata import version

    machine["llguidance"] = version("llguidance")
    variants, skipped = runnable_variants(requested, machine["xgrammar"])
    for s in skipped:
        print(f"[backends] {s}", flush=True)
    problems: List[str] = []
    runs: List[Dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-grammar-backends-") as tmp:
        for v in variants:
            print(f"[backends] {v} ...", flush=True)
            try:
                runs.append(one_engine(v, args, tmp, problems))
            except Exception as exc:  # a variant that fails is a result too; the others still run
                problems.append(f"{v}: failed: {type(exc).__name__}: {exc}")
                print(f"[backends] {v} failed: {exc!r}", flush=True)
                continue
            r = runs[-1]
            print(f"[{time.monotonic() - t0:.0f}s] {v}: start {r['start_s']:.0f} s, ttft fresh/cached "
                  f"{statistics.median(r['ttft']['fresh']) if r['ttft']['fresh'] else 0:.0f}/"
                  f"{statistics.median(r['ttft']['cached']) if r['ttft']['cached'] else 0:.0f} ms", flush=True)
    by_variant = {r["variant"]: r for r in runs}
    pattern_outputs = None
    if "xgrammar" in by_variant and "xgrammar-pattern" in by_variant:
        base, pat = by_variant["xgrammar"]["cells"], by_variant["xgrammar-pattern"]["cells"]
        pattern_outputs = compare_outputs([t for k in pat if k in base for t in base[k]["texts"]],
                                          [t for k in pat if k in base for t in pat[k]["texts"]])
    revision, dirty = _revision()
    result = {
        "command": command_line(argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "revision": revision, "dirty": dirty,
        "machine": machine, "allocator": args.allocator,
        "variants": [r["variant"] for r in runs], "skipped": skipped,
        "batches": args.batches, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
        "warmup_tokens": args.warmup_tokens, "ttft_trials": args.ttft_trials,
        "ttft": {r["variant"]: {k: ttft_summary(r["ttft"][k]) for k in ("first",) + TTFT_KINDS} for r in runs},
        "rows": aggregate(runs, args.batches),
        "counters": {r["variant"]: r.get("counters", {}) for r in runs},
        "pattern_outputs": pattern_outputs,
        "problems": problems,
        "wall_s": time.monotonic() - t0,
        "runs": [{k: v for k, v in r.items() if k != "cells"} | {"cells": {
            bs: {k: c[k] for k in ("unconstrained", "json", "plugin", "requests", "tokens", "verify", "texts")}
            for bs, c in r["cells"].items()}} for r in runs],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"grammar_backends_{machine['sglang']}"  # not Path.with_suffix: "0.5.16" has a dot
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / stem}.json and .md in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
