"""Per-host CPU time of the plugin's grammar work at TP 1 vs TP 2 on the real SGLang CPU engine, and the
cost of broadcasting a tree mask between ranks.

Every TP rank is a scheduler process that advances its own grammar matchers and builds its own tree mask for the same
requests, so a host running TP ranks pays the grammar work once per rank. This measures it: for TP 1 and TP 2 (runs
alternated, ``--repeats`` each) a fresh in-process CPU engine (``sglang_eo_dev.cpu_runtime.engine.start_engine``,
"follower" pair whose drafts the grammar accepts, EAGLE3 topk 4 / 8 draft tokens, overlap on, plugin on) gets one
warm-up batch, then ``--rounds`` batches of ``--batch`` ``FOLLOWER_SCHEMA`` requests (greedy; outputs checked). After
every round each rank's plugin stats file (``<stem>.rank<r>.json``: cumulative ``grammar_s`` = advance + tree wait +
mask, ``steps``) is read; per round: grammar ms per verify step of each rank, and their sum over ranks = the host's
grammar CPU ms per step. Reported: medians over rounds and runs, the ratio TP 2 / TP 1 of the per-host value, and the
linear projection to TP 8 (each rank repeats identical work).

Mask broadcast: two processes in a gloo group broadcast an int32 tree mask ``[batch x draft tokens, ceil(vocab/32)]``
from rank 0 (what "build the mask once per TP group" would add on CPU), medians over ``--bcast-iters``, for this run's
shape and for a Llama-3-sized vocabulary (128256) at batch 64.

Run (one engine at a time)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_tp_grammar.py

Writes benchmarks/results/tp_grammar_<sglang version>.json and prints the markdown table. On this 2-core machine
the two ranks share the cores with each other (and other processes), so the per-step times are CPU work, not a
latency forecast. Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
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
KEYS = ("steps", "grammar_s", "advance_s", "tree_wait_s", "mask_s")


def per_round(before: Sequence[Dict[str, Any]], after: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """One round's per-step grammar ms of each rank and their host sum, from cumulative per-rank stats (None when a
    rank did no verify step in the round)."""
    ranks = []
    for b, a in zip(before, after, strict=True):
        steps = a.get("steps", 0) - b.get("steps", 0)
        if steps <= 0:
            return None
        ranks.append({k: (a[k] - b.get(k, 0.0)) / steps * 1e3 for k in KEYS if k != "steps"} | {"steps": steps})
    return {"ranks": ranks, "host_grammar_ms": sum(r["grammar_s"] for r in ranks),
            "host_mask_ms": sum(r["mask_s"] for r in ranks), "host_advance_ms": sum(r["advance_s"] for r in ranks)}


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _one_run(tp: int, rep: int, args: argparse.Namespace, tmp: str, problems: List[str]) -> Dict[str, Any]:
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, start_engine
    from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA
    from sglang_eo_dev.cpu_runtime.stats import read_rank_stats

    cfg = EngineConfig(pair="follower", spec="topk4", overlap=True, product_plugin=True, tp_size=tp,
                       vocab_size=args.vocab, max_running_requests=max(8, args.batch))
    stats = os.path.join(tmp, f"plugin-tp{tp}-{rep}.json")
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = stats
    t0 = time.monotonic()
    engine = start_engine(cfg, stats_file=os.path.join(tmp, f"runtime-tp{tp}-{rep}.json"))
    os.environ.pop("SGLANG_EAGLE_OVERLAP_STATS_FILE", None)
    start_s = time.monotonic() - t0
    params = {"temperature": 0.0, "max_new_tokens": 64, "json_schema": json.dumps(FOLLOWER_SCHEMA)}
    prompts = [f"Request {i}:" for i in range(args.batch)]

    def read() -> List[Dict[str, Any]]:
        deadline = time.monotonic() + 10
        while True:  # the other rank's write of the last step may trail this process by a moment
            ranks = read_rank_stats(stats, tp)
            if all(ranks) and len({r.get("steps") for r in ranks}) == 1 or time.monotonic() > deadline:
                return ranks
            time.sleep(0.1)

    rounds: List[Dict[str, Any]] = []
    try:
        for i in range(args.rounds + 1):
            before = read() if i else None
            t = time.perf_counter()
            outs = engine.generate(prompt=prompts, sampling_params=[params] * args.batch)
            wall = time.perf_counter() - t
            bad = sum(1 for o in outs if _doc(o["text"]) != FOLLOWER_DOCUMENT)
            if bad:
                problems.append(f"tp{tp}#{rep} round {i}: {bad} outputs are not the follower document")
            if i == 0:
                continue  # warm-up: first grammar compile
            r = per_round(before, read())
            if r is None:
                problems.append(f"tp{tp}#{rep} round {i}: a rank did no verify step")
                continue
            r["wall_ms_per_step"] = wall / r["ranks"][0]["steps"] * 1e3
            rounds.append(r)
    finally:
        engine.shutdown()
    return {"tp": tp, "rep": rep, "start_s": start_s, "rounds": rounds}


def _doc(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _bcast_rank(rank: int, world: int, init_file: str, shapes: Sequence[Sequence[int]], iters: int,
                out_file: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    res = []
    for rows, width in shapes:
        mask = torch.zeros((rows, width), dtype=torch.int32)
        times = []
        for _ in range(iters + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.broadcast(mask, src=0)
            times.append((time.perf_counter() - t) * 1e3)
        res.append({"rows": rows, "width": width, "bytes": rows * width * 4, "median_ms": _median(times[2:])})
    if rank == 1:
        Path(out_file).write_text(json.dumps(res))
    dist.destroy_process_group()


def broadcast_cost(shapes: Sequence[Sequence[int]], iters: int, tmp: str) -> List[Dict[str, Any]]:
    """Median receive time (rank 1) of a gloo broadcast of each int32 mask shape between two processes."""
    import torch.multiprocessing as mp

    out = os.path.join(tmp, "bcast.json")
    mp.start_processes(_bcast_rank, args=(2, os.path.join(tmp, "bcast-init"), shapes, iters, out), nprocs=2,
                       start_method="spawn")
    return json.loads(Path(out).read_text())


def summarize(runs: Sequence[Dict[str, Any]]) -> Dict[int, Dict[str, float]]:
    rows: Dict[int, Dict[str, float]] = {}
    for tp in sorted({r["tp"] for r in runs}):
        rs = [x for r in runs if r["tp"] == tp for x in r["rounds"]]
        rows[tp] = {
            "rounds": len(rs),
            "host_grammar_ms": _median([x["host_grammar_ms"] for x in rs]),
            "host_advance_ms": _median([x["host_advance_ms"] for x in rs]),
            "host_mask_ms": _median([x["host_mask_ms"] for x in rs]),
            "rank_grammar_ms": _median([r["grammar_s"] for x in rs for r in x["ranks"]]),
            "wall_ms_per_step": _median([x["wall_ms_per_step"] for x in rs]),
        }
    return rows


def markdown(result: Dict[str, Any]) -> str:
    rows = result["rows"]
    one = rows.get(1) or rows.get("1")
    lines = [
        f"SGLang {result['machine']['sglang']}, {result['machine']['cores']} cores, vocab {result['vocab']}, "
        f"batch {result['batch']}, EAGLE3 topk 4 (8 draft tokens), {result['rounds']} rounds x "
        f"{result['repeats']} runs per TP (alternated), medians over rounds:",
        "",
        "| TP | host grammar ms/step (sum over ranks) | of it: advance | mask | per rank | step wall ms | vs TP 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for tp, r in sorted(rows.items(), key=lambda kv: int(kv[0])):
        ratio = r["host_grammar_ms"] / one["host_grammar_ms"] if one else float("nan")
        lines.append(f"| {tp} | {r['host_grammar_ms']:.3f} | {r['host_advance_ms']:.3f} | {r['host_mask_ms']:.3f} | "
                     f"{r['rank_grammar_ms']:.3f} | {r['wall_ms_per_step']:.2f} | {ratio:.2f}x |")
    if one:
        lines.append(f"| 8 (projected: 8 x TP 1) | {8 * one['host_grammar_ms']:.3f} | {8 * one['host_advance_ms']:.3f} "
                     f"| {8 * one['host_mask_ms']:.3f} | {one['host_grammar_ms']:.3f} | | 8.00x |")
    lines += ["", "gloo broadcast of one int32 tree mask, rank 0 -> rank 1 (median receive ms):", "",
              "| rows (batch x draft tokens) | vocab words | bytes | ms |", "|---|---|---|---|"]
    for b in result["broadcast"]:
        lines.append(f"| {b['rows']} | {b['width']} | {b['bytes']} | {b['median_ms']:.3f} |")
    if result["problems"]:
        lines += ["", "Problems: " + "; ".join(result["problems"])]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tps", default="1,2")
    ap.add_argument("--bcast-iters", type=int, default=50)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    import importlib.metadata as md

    machine = {"sglang": md.version("sglang"), "cores": os.cpu_count(), "python": platform.python_version()}
    problems: List[str] = []
    runs: List[Dict[str, Any]] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-tp-grammar-") as tmp:
        for rep in range(args.repeats):
            for tp in [int(x) for x in args.tps.split(",")]:
                run = _one_run(tp, rep, args, tmp, problems)
                runs.append(run)
                print(f"[{time.monotonic() - t0:.0f}s] tp{tp}#{rep}: start {run['start_s']:.0f}s, "
                      f"{len(run['rounds'])} rounds", flush=True)
        width = math.ceil(args.vocab / 32)
        shapes = [(args.batch * 8, width), (64 * 8, math.ceil(128256 / 32))]
        bcast = broadcast_cost(shapes, args.bcast_iters, tmp)
    result = {
        "command": "flock /tmp/sglang-engine.lock " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT), "benchmarks/bench_tp_grammar.py",
                                     *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine, "vocab": args.vocab, "batch": args.batch, "rounds": args.rounds,
        "repeats": args.repeats, "wall_s": time.monotonic() - t0,
        "rows": summarize(runs), "broadcast": bcast, "runs": runs, "problems": problems,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"tp_grammar_{machine['sglang']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"wrote {out / name}.json in {result['wall_s']:.0f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
