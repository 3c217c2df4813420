"""What grammar-forced drafts cost per verify step on the host, by batch size and tree.

Two parts of the cost, timed in one process, alternating with and without forced drafts (medians of per-step times):

* **mask build** (the grammar job: the grammar thread, or inline on the scheduler thread): ``TreeMaskBuilder.build``
  with and without a :class:`~sglang_eagle_overlap.core.forced.ForcedDrafts` table, i.e. the extra
  ``find_jump_forward_string`` + cached tokenization per valid node;
* **device side on the scheduler thread**: ``ForcedDrafts.upload`` + ``after_verify`` + ``apply`` (a fixed number of
  tensor ops per step, here on CPU tensors; on a GPU these are kernel launches).

Workload: the 128k-vocabulary test tokenizer, the nested JSON schema (``constrained_json_disable_any_whitespace``
style separators), requests at random positions of valid documents, a chain tree (topk 1: 4 nodes) or a topk-4-shaped
tree (8 nodes) whose first-child path is the true continuation.

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_forced_cost.py

Writes benchmarks/results/forced_cost.{json,md}. Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))

VOCAB = 128000


def _workload(bs: int, n: int, seed: int) -> Tuple[List[Any], torch.Tensor, torch.Tensor, torch.Tensor]:
    import xgrammar as xgr

    from sglang_eo_dev.helpers import grammars as G
    from sglang_eo_dev.helpers.tokenizers import encode

    rng = random.Random(seed)
    compiled = G._compiler(VOCAB).compile_json_schema(json.dumps(G.NESTED_SCHEMA), any_whitespace=False)
    matchers, toks = [], []
    for _ in range(bs):
        doc = json.dumps(json.loads(G.nested_doc_text(rng)))  # ", " / ": " separators, as the engine's JSON
        ids = list(encode(doc, VOCAB))
        p = rng.randrange(1, max(2, len(ids) - n))
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        for t in ids[:p]:
            assert m.accept_token(t)
        path = ids[p - 1 : p - 1 + n] + [0] * n
        matchers.append(m)
        toks.append(path[:n])
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    sib = torch.full((bs, n), -1, dtype=torch.int64)
    tok = torch.tensor(toks, dtype=torch.int64)
    if n == 4:
        nxt[:, :3] = torch.tensor([1, 2, 3])
    else:  # 0 -> {1, 4}; 1 -> {2, 5}; 2 -> {3, 6}; 4 -> {7}: first-child path 0-1-2-3, side nodes random
        nxt[:] = torch.tensor([1, 2, 3, -1, 7, -1, -1, -1])
        sib[:] = torch.tensor([-1, 4, 5, 6, -1, -1, -1, -1])
        for j in (4, 5, 6, 7):
            tok[:, j] = torch.tensor([rng.randrange(VOCAB) for _ in range(bs)])
    return matchers, nxt, sib, tok


def measure(bs: int, n: int, steps: int) -> Dict[str, Any]:
    from sglang_eagle_overlap.core import MaskRequest
    from sglang_eagle_overlap.core.mask import TreeMaskBuilder
    from sglang_eagle_overlap.core.forced import ForcedDrafts
    from sglang_eo_dev.helpers.tokenizers import hf_tokenizer

    tok_hf = hf_tokenizer(VOCAB)
    matchers, nxt, sib, tok = _workload(bs, n, seed=bs * 10 + n)
    reqs = [MaskRequest(matcher=m, request_id=str(i)) for i, m in enumerate(matchers)]
    rids = [r.request_id for r in reqs]
    builder = TreeMaskBuilder(threads=1)
    forced = ForcedDrafts()
    forced.encode = lambda s: tok_hf.encode(s, add_special_tokens=False)
    forced.decode = tok_hf.decode  # as the plugin sets it: the prefix alternatives are built too
    accept = torch.full((bs, 4), -1, dtype=torch.int32)
    accept[:, 0] = torch.arange(bs, dtype=torch.int32) * n
    accept[:, 1] = accept[:, 0] + 1
    off: List[float] = []
    on: List[float] = []
    dev: List[float] = []
    for i in range(steps + 3):  # 3 warm-up steps (the encode cache fills)
        for use in (False, True) if i % 2 == 0 else (True, False):
            t = time.perf_counter()
            builder.build(reqs, nxt, sib, tok, VOCAB, forced=forced if use else None)
            dt = time.perf_counter() - t
            if i >= 3:
                (on if use else off).append(dt)
        draft = tok.reshape(-1).clone()
        t = time.perf_counter()
        forced.upload("cpu")
        forced.after_verify(accept, rids)
        forced.apply(draft, nxt, rids, chain=n == 4)
        if i >= 3:
            dev.append(time.perf_counter() - t)
    med = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"bs": bs, "nodes": n, "build_off_ms": med(off), "build_on_ms": med(on),
            "build_extra_ms": med(on) - med(off), "device_side_ms": med(dev), "steps": steps,
            "nodes_with_continuation": forced.recorded_nodes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    from importlib.metadata import version

    torch.set_num_threads(1)
    rows = [measure(bs, n, args.steps) for n in (4, 8) for bs in (1, 8, 32, 64)]
    cmd = "flock /tmp/sglang-engine.lock " + shlex.join([sys.executable.replace(str(ROOT) + "/", ""),
                                                          "benchmarks/bench_forced_cost.py", *sys.argv[1:]])
    env = (f"xgrammar {version('xgrammar')}, torch {torch.__version__}, Python {platform.python_version()}, this "
           "2-core machine (shared, noisy), 1 torch thread, 1 fill thread")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forced_cost.json").write_text(json.dumps({"command": cmd, "env": env, "rows": rows}, indent=1))
    lines = ["# Grammar-forced drafts: host cost per verify step", "", f"Command: `{cmd}`", "", env + ".",
             "", "| tree nodes | bs | mask build, forced off (ms) | forced on (ms) | extra (ms) | upload + pick + apply "
             "(ms, scheduler thread) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['bs']} | {r['build_off_ms']:.3f} | {r['build_on_ms']:.3f} | "
                     f"{r['build_extra_ms']:+.3f} | {r['device_side_ms']:.3f} |")
    (args.out / "forced_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
