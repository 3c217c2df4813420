"""Grammar-forced drafts' scheduler-thread work per verify step, one git revision's ``ForcedDrafts`` against the
working tree's, side by side in one process (for a change to ``core/forced.py``).

Per step, as on the inline path: ``TreeMaskBuilder.build(forced=X)`` (the mask build with each valid node's forced
continuation recorded) + ``X.upload`` + ``X.after_verify`` + ``X.apply``. The two versions share the builder, the
matchers and the tree (``bench_forced_cost.py``'s workload: 128k vocabulary, nested JSON schema, the first-child path
the true continuation, so every node is valid) and alternate A B B A per step; medians of per-step times and the
median of the paired after/before ratios. Only ``core/forced.py`` is taken from the revision; the rest is the
working tree's.

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_forced_ab.py --before REV

(REV: the revision whose ``core/forced.py`` the change replaces, e.g. ``HEAD`` for uncommitted work.)

Prints a markdown table; nothing is written. Not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_forced_cost import VOCAB, _workload  # noqa: E402  one workload for both forced-draft benchmarks


def _forced_class_at(rev: str) -> Any:
    """``ForcedDrafts`` of ``core/forced.py`` at git revision ``rev``, loaded under its own module name (its imports of
    the rest of the package resolve to the working tree's)."""
    from sglang_eo_dev.helpers.scripts import package_at

    path = package_at(rev, Path(tempfile.mkdtemp())) / "sglang_eagle_overlap" / "core" / "forced.py"
    spec = importlib.util.spec_from_file_location("forced_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ForcedDrafts


def measure(before_cls: Any, bs: int, n: int, steps: int) -> Dict[str, Any]:
    from sglang_eagle_overlap.core import MaskRequest
    from sglang_eagle_overlap.core.mask import TreeMaskBuilder
    from sglang_eagle_overlap.core.forced import ForcedDrafts
    from sglang_eagle_overlap.integration.drafts import batch_encoder
    from sglang_eo_dev.helpers.tokenizers import hf_tokenizer

    tok_hf = hf_tokenizer(VOCAB)
    matchers, nxt, sib, tok = _workload(bs, n, seed=bs * 10 + n)
    reqs = [MaskRequest(matcher=m, request_id=str(i)) for i, m in enumerate(matchers)]
    rids = [r.request_id for r in reqs]
    builder = TreeMaskBuilder(threads=1)
    versions = {"before": before_cls(), "after": ForcedDrafts()}
    encode_batch = batch_encoder(tok_hf)
    for f in versions.values():  # as the plugin sets them (a revision without ``decode`` / ``encode_batch`` ignores it)
        f.encode = lambda s: tok_hf.encode(s, add_special_tokens=False)
        f.decode = tok_hf.decode
        f.encode_batch = encode_batch
    accept = torch.full((bs, 4), -1, dtype=torch.int32)
    accept[:, 0] = torch.arange(bs, dtype=torch.int32) * n
    accept[:, 1] = accept[:, 0] + 1
    times: Dict[str, List[float]] = {k: [] for k in versions}
    for i in range(steps + 3):  # 3 warm-up steps (the encode caches fill)
        for k in ("before", "after") if i % 2 == 0 else ("after", "before"):
            f = versions[k]
            draft = tok.reshape(-1).clone()
            t = time.perf_counter()
            builder.build(reqs, nxt, sib, tok, VOCAB, forced=f)
            f.upload("cpu")
            f.after_verify(accept, rids)
            f.apply(draft, nxt, rids, chain=n == 4)
            if i >= 3:
                times[k].append(time.perf_counter() - t)
    return {"nodes": n, "bs": bs, "before_ms": 1e3 * statistics.median(times["before"]),
            "after_ms": 1e3 * statistics.median(times["after"]),
            "ratio": statistics.median(a / b for a, b in zip(times["after"], times["before"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision whose core/forced.py is 'before'")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batches", default="8,64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    before_cls = _forced_class_at(args.before)
    print(f"| tree nodes | bs | before ({args.before}) ms | after (working tree) ms | after / before (paired median) |")
    print("|---|---|---|---|---|")
    for n in (4, 8):
        for bs in (int(b) for b in args.batches.split(",")):
            r = measure(before_cls, bs, n, args.steps)
            print(f"| {n} | {bs} | {r['before_ms']:.3f} | {r['after_ms']:.3f} | {r['ratio']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
