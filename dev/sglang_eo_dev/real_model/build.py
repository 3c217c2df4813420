"""Build the real model and its drafts (idempotent): ``python -m sglang_eo_dev.real_model.build [--json]``.

Call order: :func:`build_all` -> :func:`~.target.build_target`, then :func:`build_eagle3` (which needs the target).
Each result is a folder under :func:`~.target.cache_root`, keyed by a hash of its inputs; a second call returns the
cached folders at once. ``--json`` prints ``{"target": ..., "eagle3": ...}`` on stdout (what the scripts read).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from sglang_eo_dev.real_model import data, eagle3, prompts, target

__all__ = ["DATA_ROUNDS", "EPOCHS", "MAX_NEW_TOKENS", "build_all", "build_eagle3"]

DATA_ROUNDS = 6  # x 6 schema families, plus the free prompts
MAX_NEW_TOKENS = 80
EPOCHS = 16
SEED = 0
LR = 3e-3


def build_eagle3(target_dir: Path, epochs: int = EPOCHS) -> Path:
    """The trained EAGLE3 draft for ``target_dir`` (generation + training on CPU, once per machine). ``epochs`` other
    than :data:`EPOCHS` gives a less (or more) trained draft in its own folder (benchmarks: drafts of other quality;
    the training data is generated once more for it)."""
    here = Path(__file__).resolve().parent
    key = "smollm2-eagle3-" + hashlib.sha256(
        (target_dir.name + target.code_hash(here / "eagle3.py", here / "prompts.py", Path(__file__))
         + json.dumps([data.GEN_VERSION, DATA_ROUNDS, MAX_NEW_TOKENS, epochs, SEED, LR])).encode()).hexdigest()[:12]

    def build(out: Path) -> None:
        import torch

        torch.manual_seed(SEED)
        t0 = time.monotonic()
        reqs = prompts.training_requests(DATA_ROUNDS, seed=SEED)
        samples = data.samples(target_dir, reqs, MAX_NEW_TOKENS)
        t1 = time.monotonic()
        n_gen = sum(len(s.ids) - s.prompt_len for s in samples)
        target.log(f"data: {len(samples)} sequences, {n_gen} generated tokens in {t1 - t0:.0f} s")
        state, hot, cfg, stats = eagle3.train(samples, target_dir, epochs, seed=SEED, lr=LR)
        eagle3.save_draft(out, state, hot, cfg, target_dir)
        stats.update(generate_s=round(t1 - t0, 1), sequences=len(samples), generated_tokens=n_gen)
        (out / "training.json").write_text(json.dumps(stats, indent=2))
        target.log(f"EAGLE3 draft built in {time.monotonic() - t0:.0f} s: {out}")

    return target.cached(key, build)


def build_all(epochs: int = EPOCHS) -> dict[str, str]:
    t = target.build_target()
    return {"target": str(t), "eagle3": str(build_eagle3(t, epochs))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print the paths as JSON on stdout")
    ap.add_argument("--epochs", type=int, default=EPOCHS, help=f"draft training epochs (default {EPOCHS})")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # 2 threads on a busy 2-core machine were several times slower than 1
    paths = build_all(args.epochs)
    print(json.dumps(paths) if args.json else "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
