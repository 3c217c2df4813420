"""Build the real model and its EAGLE3 drafts (idempotent): ``python -m sglang_eo_dev.real_model.build [--json]``.

Two drafts, one training code (:mod:`.eagle3`), two recipes (:data:`RECIPES`):

* ``chat`` (the default, what the demo, the tests and the benchmarks run): trained on the target's own answers to
  general prompts (:mod:`.chat_prompts`: instructions, questions, short essays, code; no JSON, no schema). It stands
  for the draft users have: public EAGLE3 drafts are trained on general chat data and were never shown JSON.
* ``json`` (the "specialised draft"): trained on the target's answers to JSON-schema prompts (:mod:`.prompts`), the
  best case for a grammar-constrained workload; built only by the benchmarks that compare it.

Call order: :func:`build_all` -> :func:`~.target.build_target`, then :func:`build_eagle3` (which needs the target).
Each result is a folder under :func:`~.target.cache_root`, keyed by a hash of its recipe and the building code; a
second call returns the cached folder at once. ``--json`` prints ``{"target": ..., "eagle3": ...}`` on stdout (what
the scripts read); ``--draft json`` builds the specialised draft instead.

Cost on the project's 2-core machine: docs/development.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from sglang_eo_dev.real_model import chat_prompts, data, eagle3, prompts, target

__all__ = ["DraftRecipe", "RECIPES", "build_all", "build_eagle3", "build_threads"]

SEED = 0


@dataclasses.dataclass(frozen=True)
class DraftRecipe:
    """How one draft is trained: its prompts, answer length, and the optimiser's schedule."""

    requests: Callable[[], list]  # the training prompts (deterministic)
    max_new_tokens: int
    epochs: int
    lr: float
    batch_size: int  # sequences per optimiser step
    gen_batch: int  # sequences per generation batch

    def fingerprint(self) -> str:
        return json.dumps([[(r.user, r.schema) for r in self.requests()], self.max_new_tokens,
                           self.epochs, self.lr, self.batch_size, data.GEN_VERSION, SEED])


RECIPES: dict[str, DraftRecipe] = {
    # 800 prompts x 96 new tokens (~70k tokens), 3 epochs: the first setting over 1.5 accepted on held-apart chat
    # prompts within the 15-minute build (docs/development.md: 480 x 128 for 3 / 4 epochs gave 1.44 / 1.47).
    "chat": DraftRecipe(lambda: chat_prompts.chat_training_requests(800, seed=SEED), max_new_tokens=96, epochs=3,
                        lr=3e-3, batch_size=4, gen_batch=128),
    "json": DraftRecipe(lambda: prompts.training_requests(6, seed=SEED), max_new_tokens=80, epochs=16, lr=3e-3,
                        batch_size=4, gen_batch=16),
}


def build_threads() -> int:
    """Torch threads for the build: ``SGLANG_EO_BUILD_THREADS`` (default 2, the machine's cores; the build runs
    before the tests, alone)."""
    return max(1, int(os.environ.get("SGLANG_EO_BUILD_THREADS", "2")))


def build_eagle3(target_dir: Path, draft: str = "chat", epochs: Optional[int] = None) -> Path:
    """The trained EAGLE3 draft ``draft`` (a :data:`RECIPES` name) for ``target_dir`` (generation + training on CPU,
    once per machine). ``epochs`` other than the recipe's gives a less (or more) trained draft in its own folder
    (benchmarks: drafts of other quality; the training data is shared)."""
    recipe = RECIPES[draft]
    if epochs is not None:
        recipe = dataclasses.replace(recipe, epochs=epochs)
    # The training code, the chat rendering (prompts.messages) and this recipe; the answers themselves are cached per
    # request by data.py (keyed by GEN_VERSION), and the fingerprint holds every prompt's text.
    here = Path(__file__).resolve().parent
    code = target.code_hash(here / "eagle3.py", here / "prompts.py", Path(__file__))
    key = f"smollm2-eagle3-{draft}-" + hashlib.sha256(
        (target_dir.name + code + recipe.fingerprint()).encode()).hexdigest()[:12]

    def build(out: Path) -> None:
        import torch

        torch.manual_seed(SEED)
        t0 = time.monotonic()
        samples = data.samples(target_dir, recipe.requests(), recipe.max_new_tokens, batch_size=recipe.gen_batch)
        t1 = time.monotonic()
        n_gen = sum(len(s.ids) - s.prompt_len for s in samples)
        target.log(f"{draft} data: {len(samples)} sequences, {n_gen} generated tokens in {t1 - t0:.0f} s")
        state, hot, cfg, stats = eagle3.train(samples, target_dir, recipe.epochs, seed=SEED, lr=recipe.lr,
                                              batch_size=recipe.batch_size)
        eagle3.save_draft(out, state, hot, cfg, target_dir)
        stats.update(recipe=draft, generate_s=round(t1 - t0, 1), sequences=len(samples), generated_tokens=n_gen)
        (out / "training.json").write_text(json.dumps(stats, indent=2))
        target.log(f"EAGLE3 {draft} draft built in {time.monotonic() - t0:.0f} s: {out}")

    return target.cached(key, build)


def build_all(draft: str = "chat", epochs: Optional[int] = None) -> dict[str, str]:
    """The target and the EAGLE3 draft ``draft`` (built when missing): ``{"target": path, "eagle3": path}``."""
    t = target.build_target()
    return {"target": str(t), "eagle3": str(build_eagle3(t, draft, epochs))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the paths as JSON on stdout")
    ap.add_argument("--draft", choices=sorted(RECIPES), default="chat", help="which EAGLE3 draft (default chat)")
    ap.add_argument("--epochs", type=int, default=None, help="draft training epochs (default: the recipe's)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(build_threads())
    paths = build_all(args.draft, args.epochs)
    print(json.dumps(paths) if args.json else "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
