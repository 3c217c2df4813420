"""Serving benchmark, constrained EAGLE3: ``sglang.bench_serving`` against a real server, plugin x grammar on/off.

For each plugin state (``SGLANG_EAGLE_OVERLAP=1`` / ``0``) a fresh server is started; on it, for each grammar state
(each prompt with its JSON schema / the same prompts without one) and each request rate x max concurrency, SGLang's
own serving benchmark (``sglang.bench_serving``, i.e. ``sglang.benchmark.serving`` in the supported releases) sends
the requests and computes the metrics. Its ``run_benchmark`` runs unchanged with two substitutions made in this
process only: its dataset loader returns our rows (:mod:`benchmarks.schemas`; each row carries its ``json_schema`` in
bench_serving's per-request ``extra_request_body``), and its request function is wrapped to keep each request's
``meta_info.spec_accept_length`` (bench_serving parses it but only reports the server's lifetime average).

Default: CPU, the real SGLang engine through the test-only CPU runtime (``sglang_eo_dev.cpu_runtime``), the tiny local
"follower" target + EAGLE3 draft pair, EAGLE3 topk 1 / 3 steps / 4 draft tokens, overlap scheduler on. This shows
the mechanics (every variant runs, metrics are collected, grammar batches keep the overlap or not); CPU timings are
CPU work and say nothing about GPU speed. GPU machine (UNTESTED here, no GPU was available)::

    python benchmarks/bench_serving_constrained.py --model-path M --draft-model-path D [--server-args "--tp 2"]

Run (the lock keeps other engine runs on a shared machine away from the timings; hold it for the whole run)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_serving_constrained.py

Writes ``benchmarks/results/serving_<sglang version>.{json,md}`` (``--out-dir``, ``--name`` to change). Medians and
p99 are bench_serving's; ratios compare plugin on/off measured in the same run. Not a test: nothing gates on timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.schemas import Case, make_dataset  # noqa: E402

PLUGIN_STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
RUNTIME_STATS_ENV = "SGLANG_EO_STATS_FILE"
SPEC = {"topk1": (1, 3, 4), "topk4": (4, 3, 8)}  # topk, steps, draft tokens


def _bench_serving():
    """SGLang's serving benchmark module (``sglang.bench_serving`` moved to ``sglang.benchmark.serving``)."""
    try:
        from sglang.benchmark import serving
    except ImportError:  # older layout: the implementation lives in sglang.bench_serving itself
        from sglang import bench_serving as serving
    return serving


# ---------------------------------------------------------------------------------------------------------- servers
@dataclass
class Server:
    base_url: str
    stop: Callable[[], None]
    log_path: str
    plugin_stats: str
    runtime_stats: Optional[str]


def _read_json(path: Optional[str]) -> Dict[str, Any]:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cpu_server(args: argparse.Namespace, plugin: bool, tmp: str) -> Iterator[Server]:
    """The real SGLang HTTP server on CPU with the tiny local models (test-only runtime in ``sglang_eo_dev.cpu_runtime``)."""
    os.makedirs(tmp, exist_ok=True)
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server

    tag = "on" if plugin else "off"
    plugin_stats = os.path.join(tmp, f"plugin-{tag}.json")
    os.environ[PLUGIN_STATS_ENV] = plugin_stats  # launch_server passes os.environ on to the server
    cfg = EngineConfig(pair=args.pair, spec=args.spec, overlap=True, product_plugin=plugin,
                       max_running_requests=max(8, max(args.concurrencies)))
    log = os.path.join(tmp, f"server-{tag}.log")
    t0 = time.monotonic()
    srv = launch_server(cfg, log_path=log, stats_file=os.path.join(tmp, f"runtime-{tag}.json"))
    print(f"[bench] CPU server {cfg.describe()} up in {time.monotonic() - t0:.1f}s at {srv.base_url}", flush=True)
    try:
        yield Server(srv.base_url, srv.stop, log, plugin_stats, srv.stats_file)
    finally:
        srv.stop()


@contextlib.contextmanager
def gpu_server(args: argparse.Namespace, plugin: bool, tmp: str) -> Iterator[Server]:
    """``python -m sglang.launch_server`` with the given target/draft and EAGLE3 flags (untested: no GPU here)."""
    os.makedirs(tmp, exist_ok=True)
    tag = "on" if plugin else "off"
    topk, steps, draft = SPEC[args.spec]
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.draft_model_path,
           "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
           "--speculative-num-draft-tokens", str(draft), "--grammar-backend", "xgrammar",
           "--device", args.device, "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(args.server_args)]
    plugin_stats = os.path.join(tmp, f"plugin-{tag}.json")
    env = dict(os.environ, SGLANG_EAGLE_OVERLAP="1" if plugin else "0", **{PLUGIN_STATS_ENV: plugin_stats})
    log = os.path.join(tmp, f"server-{tag}.log")
    with open(log, "w") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.server_timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang.launch_server not healthy after {args.server_timeout}s; see {log}")
            try:
                with urllib.request.urlopen(base + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(2.0)
        print(f"[bench] server up at {base}: {' '.join(map(shlex.quote, cmd))}", flush=True)
        yield Server(base, stop, log, plugin_stats, None)
    finally:
        stop()


# ------------------------------------------------------------------------------------------------------ bench_serving
def _bench_args(serving, argv: List[str]) -> argparse.Namespace:
    """Parse ``argv`` with bench_serving's own command-line parser (all defaults of the installed release)."""
    captured: List[argparse.Namespace] = []
    saved_argv, saved_run = sys.argv, serving.run_benchmark
    sys.argv = ["bench_serving", *argv]
    serving.run_benchmark = captured.append
    try:
        serving.cli_main()
    finally:
        sys.argv, serving.run_benchmark = saved_argv, saved_run
    if len(captured) != 1:
        raise RuntimeError(f"bench_serving's cli_main did not reach run_benchmark with {argv}")
    return captured[0]


def _rows(serving, cases: List[Case], grammar: bool, max_new_tokens: int, tokenizer) -> list:
    rows = []
    for case in cases:
        sampling: Dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        if grammar:
            # The JSON document ends the request (the grammar then allows only EOS), or max_new_tokens does.
            sampling.update(json_schema=case.schema_json, ignore_eos=False)
        else:
            sampling.update(ignore_eos=True)  # free text: exactly max_new_tokens, like bench_serving's default
        rows.append(serving.DatasetRow(prompt=case.prompt, prompt_len=len(tokenizer.encode(case.prompt)),
                                       output_len=max_new_tokens, extra_request_body={"sampling_params": sampling}))
    return rows


def _conforms(text: str, schema: Dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_one(serving, server: Server, cases: List[Case], grammar: bool, rate: float, concurrency: int,
            args: argparse.Namespace, tmp: str) -> Dict[str, Any]:
    """One bench_serving run; returns its metrics plus accept length, JSON validity and server-side counters."""
    argv = ["--backend", "sglang", "--base-url", server.base_url, "--dataset-name", "custom",
            "--dataset-path", os.path.join(tmp, "dataset.jsonl"), "--num-prompts", str(len(cases)),
            "--request-rate", str(rate), "--max-concurrency", str(concurrency), "--seed", str(args.seed),
            "--warmup-requests", "1", "--disable-tqdm", "--output-file", os.path.join(tmp, "bench_serving.jsonl")]
    ns = _bench_args(serving, argv)
    # bench_serving's loaders cannot carry a per-request schema: hand run_benchmark our rows instead.
    def load(_args, tokenizer, _model_id=None):
        return _rows(serving, cases, grammar, args.max_new_tokens, tokenizer)

    outputs: list = []
    original = serving.ASYNC_REQUEST_FUNCS["sglang"]

    async def recording(request_func_input, pbar=None):
        out = await original(request_func_input=request_func_input, pbar=pbar)
        outputs.append(out)
        return out

    before = (_read_json(server.plugin_stats), _read_json(server.runtime_stats))
    saved_loader = serving.get_dataset
    serving.get_dataset, serving.ASYNC_REQUEST_FUNCS["sglang"] = load, recording
    try:
        result = serving.run_benchmark(ns)
    finally:
        serving.get_dataset, serving.ASYNC_REQUEST_FUNCS["sglang"] = saved_loader, original
    after = (_read_json(server.plugin_stats), _read_json(server.runtime_stats))

    measured = [o for o in outputs[ns.warmup_requests:] if o.success]  # the warm-up requests complete first
    steps = sum(o.output_len / o.spec_accept_length for o in measured if o.spec_accept_length > 0)
    accept = sum(o.output_len for o in measured if o.spec_accept_length > 0) / steps if steps else None
    texts = result["generated_texts"]
    valid = sum(_conforms(t, c.schema) for t, c in zip(texts, cases)) if grammar else None

    def delta(i: int, key: str) -> float:
        return (after[i].get(key) or 0) - (before[i].get(key) or 0)

    plugin_steps = delta(0, "steps")
    keep = ["completed", "duration", "request_throughput", "output_throughput", "total_output_tokens",
            "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "mean_tpot_ms",
            "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "concurrency"]
    row = {k: result.get(k) for k in keep}
    row.update(
        grammar=grammar, request_rate=rate, max_concurrency=concurrency, num_prompts=len(cases),
        errors=[e for e in result.get("errors", []) if e],
        accept_length=accept,  # completion tokens / verify steps over the measured requests (meta_info)
        server_avg_accept_length=result.get("accept_length"),  # bench_serving's: server lifetime average
        valid_json=valid,
        mean_output_len=(result.get("total_output_tokens") or 0) / max(result.get("completed") or 0, 1),
        sample_output=texts[0] if texts else None,
        plugin_grammar_steps=plugin_steps,
        plugin_grammar_ms_per_step=delta(0, "grammar_s") / plugin_steps * 1e3 if plugin_steps else None,
        grammar_decode_batches=delta(1, "grammar_decode_batches") if server.runtime_stats else None,
        grammar_decode_batches_synced=(delta(1, "overlap_disabled_grammar_decode_batches")
                                       if server.runtime_stats else None),
    )
    return row


# ---------------------------------------------------------------------------------------------------------- report
def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{nd}f}"
    return str(x)


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a and b else "–"


_SUMMED = ("valid_json", "num_prompts", "grammar_decode_batches", "grammar_decode_batches_synced")


def aggregate(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (plugin, grammar, rate, concurrency): the median over rounds of each metric (bench_serving's
    medians and p99s, accept length), counts summed, and the per-round rows kept under ``rounds``."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["plugin"], r["grammar"], r["request_rate"], r["max_concurrency"]), []).append(r)
    out = []
    for (plugin, grammar, rate, conc), rows in groups.items():
        agg: Dict[str, Any] = {"plugin": plugin, "grammar": grammar, "request_rate": rate, "max_concurrency": conc,
                               "rounds": rows}
        for key in dict.fromkeys(k for r in rows for k in r):
            values = [r[key] for r in rows if r.get(key) is not None]
            if key in agg or key == "round" or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                   for v in values):
                continue
            agg[key] = (sum(values) if key in _SUMMED else statistics.median(values)) if values else None
        for key in (*_SUMMED, "accept_length"):  # None when a server reports nothing (e.g. no runtime counters)
            agg.setdefault(key, None)
        out.append(agg)
    return out


def markdown(report: Dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    rows = aggregate(report["runs"])
    lines = [
        f"# Serving benchmark, constrained EAGLE3 (SGLang {m['sglang']})",
        "",
        f"Command: `{report['command']}`  ",
        f"Machine: {m['description']}  ",
        f"Server: {report['server']}  ",
        f"Requests: {cfg['num_prompts']} prompts per run (dataset seed {cfg['seed']}, {', '.join(cfg['families'])}), "
        f"max_new_tokens {cfg['max_new_tokens']}, greedy; grammar on = each prompt with its JSON schema (the request "
        "ends with the document), grammar off = the same prompts without schema, ignore_eos. Sent and measured by "
        "`sglang.bench_serving` (backend `sglang`, streaming). "
        f"{cfg['rounds']} round(s): a fresh server per plugin state and round, order on, off, off, on, ...; each cell "
        "is the median over rounds of bench_serving's numbers.",
        "",
        "| plugin | grammar | rate | conc | req/s | out tok/s | TTFT med (ms) | TTFT p99 | TPOT med (ms) | TPOT p99 "
        "| out len | accept len | valid JSON | grammar batches synced |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        synced = (f"{int(r['grammar_decode_batches_synced'])}/{int(r['grammar_decode_batches'])}"
                  if r["grammar_decode_batches"] is not None and r["grammar"] else "–")
        valid = f"{r['valid_json']}/{r['num_prompts']}" if r["valid_json"] is not None else "–"
        lines.append(
            f"| {r['plugin']} | {'on' if r['grammar'] else 'off'} | {_fmt(r['request_rate'])} | {r['max_concurrency']} "
            f"| {_fmt(r['request_throughput'], 2)} | {_fmt(r['output_throughput'])} | {_fmt(r['median_ttft_ms'])} "
            f"| {_fmt(r['p99_ttft_ms'])} | {_fmt(r['median_tpot_ms'])} | {_fmt(r['p99_tpot_ms'])} "
            f"| {_fmt(r['mean_output_len'], 0)} | {_fmt(r['accept_length'], 2)} | {valid} | {synced} |"
        )
    lines += ["", "Plugin on / off (throughput > 1 and latency < 1 favour the plugin; in brackets the ratio within "
              "each round). With grammar off the plugin has nothing to do, so those rows show the run-to-run "
              "spread:", "",
              "| grammar | rate | conc | out tok/s | TTFT med | TTFT p99 | TPOT med | TPOT p99 | accept len |",
              "|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["plugin"], r["grammar"], r["request_rate"], r["max_concurrency"]): r for r in rows}
    for (plugin, grammar, rate, conc), on in by_key.items():
        off = by_key.get(("off", grammar, rate, conc))
        if plugin != "on" or off is None:
            continue
        cells = []
        for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                  "accept_length"):
            per_round = {r["round"]: r[k] for r in off["rounds"]}
            rr = [_ratio(r[k], per_round.get(r["round"])) for r in on["rounds"]]
            cells.append(_ratio(on[k], off[k]) + (f" ({', '.join(rr)})" if len(rr) > 1 else ""))
        lines.append(f"| {'on' if grammar else 'off'} | {_fmt(rate)} | {conc} | " + " | ".join(cells) + " |")
    lines += [""]
    for tag, srv in report["servers"].items():
        p = srv.get("plugin_stats") or {}
        n = p.get("steps") or 0
        per_step = f"{p['grammar_s'] / n * 1e3:.3f} ms grammar work per step" if n else "no plugin steps"
        lines.append(f"- server plugin {tag}: plugin active={p.get('active', False)}, {n} constrained verify steps, "
                     f"{per_step}; server start {srv['start_s']:.0f} s")
    lines += ["", "out len = mean completion tokens per request; accept len = completion tokens / verify steps over "
              "the measured requests (from each response's `meta_info`); grammar batches synced = speculative grammar "
              "decode batches the scheduler ran with overlap disabled / all of them (CPU runtime counter); valid "
              "JSON = outputs that parse and conform to their schema (the rest hit max_new_tokens); both summed over "
              "rounds. With the plugin on, its stats file (`SGLANG_EAGLE_OVERLAP_STATS_FILE`) is written every "
              "constrained step, a cost the plugin does not have in production. " + report["note"], ""]
    return "\n".join(lines)


def _machine(device: str) -> Dict[str, Any]:
    import torch

    def ver(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    info = {"cpu": cpu, "cpu_count": cores, "gpu": gpu, "platform": platform.platform(),
            "python": platform.python_version(), "sglang": ver("sglang"), "xgrammar": ver("xgrammar"),
            "torch": torch.__version__, "sglang_eagle_overlap": ver("sglang-eagle-overlap")}
    with contextlib.suppress(Exception):
        info["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True, check=True).stdout.strip()
    info["description"] = (f"{gpu or 'no GPU'}; {cores} CPU cores ({cpu}); {info['platform']}; Python {info['python']},"
                           f" SGLang {info['sglang']}, xgrammar {info['xgrammar']}, torch {info['torch']}")
    return info


def _command() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.absolute().relative_to(ROOT)
    script = Path(__file__).resolve().relative_to(ROOT)
    return " ".join(["flock /tmp/sglang-engine.lock", str(exe), str(script), *map(shlex.quote, sys.argv[1:])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="target model: launch a real server (GPU mode); default: CPU tiny models")
    ap.add_argument("--draft-model-path", help="EAGLE3 draft model (with --model-path)")
    ap.add_argument("--device", default=None, help="with --model-path: SGLang --device (default cuda)")
    ap.add_argument("--server-args", default="", help="extra sglang.launch_server flags (GPU mode), one string")
    ap.add_argument("--server-timeout", type=float, default=1200, help="seconds to wait for a GPU server")
    ap.add_argument("--pair", default="follower", choices=["follower", "noisy-follower", "random"],
                    help="CPU tiny model pair (dev/, sglang_eo_dev.cpu_runtime)")
    ap.add_argument("--spec", default="topk1", choices=sorted(SPEC), help="EAGLE3 tree: topk1 (3 steps, 4 draft tokens)"
                    " or topk4 (3 steps, 8 draft tokens)")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per run (default 16; GPU: use 200+)")
    ap.add_argument("--concurrencies", default="1,4,8", help="max concurrencies, comma-separated")
    ap.add_argument("--request-rates", default="inf", help="request rates (req/s), comma-separated; inf = all at once")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="fresh servers per plugin state, order alternating "
                    "(on, off, off, on, ...); the tables show the median over rounds (default 2)")
    ap.add_argument("--plugin", default="on,off", help="plugin states to run: on,off / on / off")
    ap.add_argument("--grammar", default="on,off", help="grammar states to run: on,off / on / off")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=None, help="output file stem (default serving_<sglang version>)")
    args = ap.parse_args()
    if bool(args.model_path) != bool(args.draft_model_path):
        ap.error("--model-path and --draft-model-path go together")
    args.device = args.device or ("cuda" if args.model_path else "cpu")
    args.concurrencies = [int(c) for c in args.concurrencies.split(",")]
    args.request_rates = [float(r) for r in args.request_rates.split(",")]
    plugins = [p.strip() for p in args.plugin.split(",")]
    grammars = [g.strip() for g in args.grammar.split(",")]
    for value, name in [(p, "--plugin") for p in plugins] + [(g, "--grammar") for g in grammars]:
        if value not in ("on", "off"):
            ap.error(f"{name} takes on/off values, got {value!r}")

    if not args.model_path:
        # CPU venvs pair a CUDA torchvision wheel with CPU torch; the test runtime's shim lets `import sglang` work.
        from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

        install_import_hook()
    serving = _bench_serving()
    cases = make_dataset(args.num_prompts, args.seed)
    machine = _machine(args.device)
    tmp = tempfile.mkdtemp(prefix="sglang-eo-serving-")
    with open(os.path.join(tmp, "dataset.jsonl"), "w") as f:  # bench_serving's custom format (+ the schema), a record
        for c in cases:
            f.write(json.dumps({"conversations": [{"content": c.prompt}, {"content": ""}], "json_schema": c.schema})
                    + "\n")

    if args.model_path:
        start, server_desc = gpu_server, (f"sglang.launch_server --model-path {args.model_path} "
                                          f"--speculative-draft-model-path {args.draft_model_path} EAGLE3 {args.spec} "
                                          f"--device {args.device} {args.server_args}".strip())
    else:
        topk, steps, draft = SPEC[args.spec]
        start, server_desc = cpu_server, (
            f"real SGLang server on CPU (dev/, sglang_eo_dev.cpu_runtime), tiny '{args.pair}' target + EAGLE3 draft, EAGLE3 topk "
            f"{topk} / {steps} steps / {draft} draft tokens, overlap scheduler on, xgrammar, float32")
    runs: List[Dict[str, Any]] = []
    servers: Dict[str, Any] = {}
    t_all = time.monotonic()
    for rnd in range(args.rounds):
        # Alternate the order (on, off, off, on, ...) so drift on a shared machine does not favour one side.
        for plugin in plugins if rnd % 2 == 0 else plugins[::-1]:
            t0 = time.monotonic()
            tag = f"{plugin}-r{rnd}"
            with start(args, plugin == "on", os.path.join(tmp, tag)) as server:
                start_s = time.monotonic() - t0
                for grammar in grammars:
                    for rate in args.request_rates:
                        for conc in args.concurrencies:
                            print(f"[bench] round {rnd}, plugin {plugin}, grammar {grammar}, rate {rate}, "
                                  f"concurrency {conc}", flush=True)
                            row = run_one(serving, server, cases, grammar == "on", rate, conc, args, tmp)
                            row.update(plugin=plugin, round=rnd)
                            runs.append(row)
                            if row["errors"] or row["completed"] != len(cases):
                                raise RuntimeError(f"failed requests in {row}; server log {server.log_path}")
                servers[tag] = {"start_s": start_s, "plugin_stats": _read_json(server.plugin_stats),
                                "runtime_stats": _read_json(server.runtime_stats), "log": server.log_path}
            if plugin == "on" and not servers[tag]["plugin_stats"].get("active") and "on" in grammars:
                raise RuntimeError(f"plugin on but it never ran a constrained step; see {servers[tag]['log']}")

    report = {
        "command": _command(),
        "machine": machine,
        "server": server_desc,
        "config": {"num_prompts": args.num_prompts, "rounds": args.rounds, "seed": args.seed,
                   "max_new_tokens": args.max_new_tokens,
                   "concurrencies": args.concurrencies, "request_rates": args.request_rates, "spec": args.spec,
                   "pair": None if args.model_path else args.pair, "families": sorted({c.family for c in cases})},
        "note": ("CPU numbers show the mechanics (every variant runs through the real scheduler and bench_serving), "
                 "not GPU speed: on CPU there is no device to overlap with, so the timings measure CPU work."
                 if args.device == "cpu" else "GPU run."),
        "total_wall_s": time.monotonic() - t_all,
        "runs": runs,  # one row per round; the markdown tables aggregate them (aggregate())
        "servers": servers,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"serving_{machine['sglang']}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"[bench] wrote {out / stem}.json and .md in {report['total_wall_s']:.0f} s (temp files: {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
