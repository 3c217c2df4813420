"""The plugin's grammar job of one verify step, off-engine, with warm caches and after a cache sweep.

Why: on the CPU engine the grammar job runs right after the model forward, which streams hundreds of MB of weights
and logits through the caches, so every request's grammar state (SGLang's ``Req`` and ``XGrammarGrammar``, the
xgrammar matcher, the ledger entry) is read cold. On a GPU host the forward runs on the device and the scheduler
thread's caches are not swept by it. This benchmark separates the two regimes with the engine's own objects and call
path, so a change can be judged on both: the Python and native instructions it removes (``warm``) and the cache lines
it stops touching (``swept``).

What one step is (bs requests, as in ``bench_scheduler_budget.py``): the previous step's result (one accepted token
per request, the random pair's accept length) through the installed band's barrier (0.5.23:
``band.advance_grammar_fsm``; 0.5.16: ``Band.feed_results``), then ``TreeMaskBuilder.build`` of an EAGLE3
tree per request (topk 1: a 4-node chain; topk 4: 8 nodes) whose drafts are random tokens (as the random pair's), on
``BENCH_SCHEMA`` compiled as SGLang compiles it with ``constrained_json_disable_any_whitespace`` against the 128k
byte-level BPE, every request at its own position of a valid document, within its first 15 tokens
(``{"id": "ABC-1234", "name": "``: the ``name`` string's slow ``maxLength`` states, 2-20 ms a fill, which
``bench_mask_states.py`` measures, start 20-35 tokens in and would be all this benchmark sees). The first step of each child is not recorded (xgrammar's first call at a state). ``swept``: a 64 MB array is written before each step (the CPU forward's stand-in); ``warm``: not. Each mode runs
in its own child over the same positions, tokens and trees.

``--before REV`` runs the plugin of git revision REV (``package_at``) in the same way; the two alternate in child
interpreters (``--repeats`` times each), so both see the same machine. Medians of per-step wall times (of the
children's medians).

Run (CPU only, a minute or two; the lock keeps it away from engine runs)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_grammar_cache.py --before REV

Writes ``benchmarks/results/grammar_cache_<sglang>.{json,md}`` (``--out`` to change). Not a test: no timing gates
anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128256
SPECS = {"topk1": (1, 3, 4), "topk4": (4, 3, 8)}  # topk, steps, nodes


def _child(spec: str, bs: int, steps: int, mode: str) -> Dict[str, float]:
    """One measurement in this interpreter (the package on ``sys.path`` first is the one measured)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "dev"))
    import numpy as np
    import torch
    import transformers
    import xgrammar as xgr
    from bench_gpu_constrained import BENCH_SCHEMA
    from bench_mask_states import make_instance, serialise
    from sglang_eo_dev.cpu_runtime.models import build_tokenizer
    from sglang_eo_dev.helpers import grammars as G
    from sglang_eo_dev.helpers.devices import DecodeMode

    G.ensure_sglang_importable()
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_eo_dev.helpers.steps import make_step
    from sglang_eagle_overlap.integration.requests import mask_requests

    band_name = "v0_5_23" if version("sglang").startswith("0.5.23") else "v0_5_16"
    band = __import__(f"sglang_eagle_overlap.adapters.{band_name}.band", fromlist=["band"])
    topk, _, n = SPECS[spec]
    tok = transformers.AutoTokenizer.from_pretrained(str(build_tokenizer(VOCAB)))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(BENCH_SCHEMA), any_whitespace=False)
    rng = random.Random(0)
    docs = [tok.encode(serialise(make_instance(72, seed)), add_special_tokens=False) for seed in range(bs)]
    if steps > 10:
        raise SystemExit(f"--steps {steps}: positions would leave the documents' first 15 tokens")
    starts = [rng.randrange(0, 4) for _ in range(bs)]
    reqs = []
    for i, (doc, s) in enumerate(zip(docs, starts)):
        m = xgr.GrammarMatcher(compiled)
        for t in doc[:s]:
            assert m.accept_token(t)
        g = XGrammarGrammar(m, VOCAB, compiled, None)
        g.accepted_tokens.extend(doc[:s])
        r = Req(f"r{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=4096))
        r.output_ids.extend(doc[:s])
        r.grammar = g
        reqs.append(r)
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    sib = torch.full((bs, n), -1, dtype=torch.int64)
    if topk == 1:
        nxt[:, : n - 1] = torch.arange(1, n)
    else:  # the root's topk children, each with one child
        nxt[:, 0] = 1
        for c in range(1, topk):
            sib[:, c] = c + 1
        for c in range(1, topk + 1):
            if topk + c < n:
                nxt[:, c] = topk + c

    batch = SimpleNamespace(reqs=reqs, has_grammar=True, forward_mode=DecodeMode(), sampling_info=None)
    step = make_step(mask_threads=1, mask_time_limit_s=None, pin_memory=False)
    rt = SimpleNamespace(step=step)
    builder = step.builder
    sweep = np.ones(64 * 1024 * 1024 // 8)
    out: Dict[str, List[float]] = {f"{mode}{part}": [] for part in ("", "_barrier", "_mask")}
    for k in range(steps + 1):  # step 0 warms xgrammar's per-state caches up and is not recorded
        pos = [s + k for s in starts]
        ids = torch.zeros(bs * n, dtype=torch.int64)
        for i, (doc, p) in enumerate(zip(docs, pos)):
            ids[i * n] = doc[p]
        result = SimpleNamespace(grammar_advanced=False, next_token_ids=ids, accept_lens=torch.ones(bs, dtype=torch.int32),
                                 copy_done=None, speculative_output_stride=n, speculative_num_draft_tokens=n)
        draft = torch.randint(0, VOCAB, (bs, n), generator=torch.Generator().manual_seed(k))
        draft[:, 0] = torch.tensor([doc[p] for doc, p in zip(docs, pos)])
        requests = mask_requests(reqs)
        if mode == "swept":
            sweep += 1.0
        t0 = time.perf_counter()
        if band_name == "v0_5_23":
            band.advance_grammar_fsm(rt, result, batch)
        else:
            band.band_of(rt).feed_results([(batch, result)], reqs)
        t1 = time.perf_counter()
        builder.build(requests, nxt, sib, draft, VOCAB)
        t2 = time.perf_counter()
        if k:
            out[mode].append(t2 - t0)
            out[mode + "_barrier"].append(t1 - t0)
            out[mode + "_mask"].append(t2 - t1)
        for r, doc, p in zip(reqs, docs, pos):  # post-processing appends the committed token
            r.output_ids.append(doc[p])
    return {m: statistics.median(v) * 1e3 for m, v in out.items()}


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="topk1,topk4")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--steps", type=int, default=10, help="steps per child (<= 10)")
    ap.add_argument("--repeats", type=int, default=3, help="children per version and cell, alternating")
    ap.add_argument("--before", default=None, metavar="REV")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec, bs, steps, mode = json.loads(args.child)
        print(json.dumps(_child(spec, bs, steps, mode)))
        return 0
    sys.path.insert(0, str(ROOT / "dev"))
    from sglang_eo_dev.helpers.scripts import package_at

    tmp = Path(tempfile.mkdtemp(prefix="grammar-cache-"))
    versions = {"this tree": str(ROOT)}
    if args.before:
        versions[args.before] = str(package_at(args.before, tmp))
    rows = []
    for spec in args.specs.split(","):
        for bs in map(int, args.batches.split(",")):
            got: Dict[str, Dict[str, List[float]]] = {v: {} for v in versions}
            for _ in range(args.repeats):
                for name, path in versions.items():
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, str(ROOT / "dev")]))
                    for mode in ("warm", "swept"):
                        res = subprocess.run([sys.executable, __file__, "--child",
                                              json.dumps([spec, bs, args.steps, mode])],
                                             env=env, capture_output=True, text=True, check=True)
                        ms = json.loads(res.stdout.strip().splitlines()[-1])
                        for key, value in ms.items():
                            got[name].setdefault(key, []).append(value)
            for name in versions:
                rows.append({"spec": spec, "bs": bs, "version": name,
                             **{m: statistics.median(v) for m, v in got[name].items()}})
                print(rows[-1], flush=True)
    sg = version("sglang")
    meta = {"command": " ".join([os.path.relpath(sys.executable, ROOT), "benchmarks/bench_grammar_cache.py",
                                 *sys.argv[1:]]), "sglang": sg, "xgrammar": version("xgrammar"),
            "python": sys.version.split()[0], "cpus": os.cpu_count()}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"grammar_cache_{sg}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# The grammar job of one verify step off-engine, warm and after a 64 MB cache sweep (SGLang {sg})", "",
             f"Command: `{meta['command']}`", "",
             f"SGLang {sg}, xgrammar {meta['xgrammar']}, Python {meta['python']}, {meta['cpus']} CPUs. Barrier "
             "(one token per request) + tree mask with random drafts, BENCH_SCHEMA, vocab 128256. Medians of "
             f"{args.repeats} children x {args.steps} steps per mode and version, versions alternating.", "",
             "| EAGLE3 | bs | version | warm ms (barrier + mask) | swept ms (barrier + mask) | swept / warm |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['bs']} | {r['version']} | {r['warm']:.3f} ({r['warm_barrier']:.3f} + "
                     f"{r['warm_mask']:.3f}) | {r['swept']:.3f} ({r['swept_barrier']:.3f} + {r['swept_mask']:.3f}) | "
                     f"{r['swept'] / r['warm']:.2f}x |")
    (outdir / f"grammar_cache_{sg}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
