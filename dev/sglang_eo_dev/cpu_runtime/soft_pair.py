"""TEST ONLY: the "soft follower" pair, a target whose sampled law a distribution test can count by hand.

The follower pair (:func:`sglang_eo_dev.cpu_runtime.models.build_follower_pair`, no noise) has a context-free target:
after token ``t`` its logits are ``8 * onehot(succ[t])`` (``succ`` walks the follower document's tokens; any token
off the chain leads to its first token), and its EAGLE3 draft proposes ``succ[t]``. At temperature 1 that target puts
``e^8 / (e^8 + V - 1)`` on ``succ[t]`` -- almost all of the mass a small grammar leaves, so sampling would rarely
branch. This pair is the same models with the target's ``lm_head`` scaled so the successor's logit is ``logit``
(default :data:`SOFT_LOGIT`): under a grammar that allows the successor and a few other tokens, the successor gets
``e^logit / (e^logit + k)`` of the masked mass (``k`` other allowed tokens, logit 0 each), while the unconstrained
target gives it only ``e^logit / (e^logit + V - 1)``. The draft, unchanged, still proposes the successor: drafts the
grammar allows and the target likes, at real choice points. A verifier that tests drafts against the wrong
probabilities (:mod:`.spec_sampling`'s biased one) then changes the output law by a wide margin, and a correct one
must reproduce non-speculative sampling.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from sglang_eo_dev.cpu_runtime import models

__all__ = ["FOLLOWER_LOGIT", "SOFT_LOGIT", "build_soft_follower_pair"]

FOLLOWER_LOGIT = 8.0  # the follower target's successor logit: RMSNorm of a one-hot state is sqrt(HIDDEN) = 8
SOFT_LOGIT = 3.0  # EngineConfig pair "soft-follower", as tests/e2e/test_sampling_distribution.py runs it


def build_soft_follower_pair(logit: float = SOFT_LOGIT, vocab_size: int = 4096) -> models.ModelPair:
    """The follower pair with the target's successor logit set to ``logit`` (cached next to the tiny models)."""
    base = models.build_follower_pair(vocab_size)
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"{Path(base.target).parent.name}|{logit!r}".encode())
    key = f"soft-follower-{h.hexdigest()[:12]}"

    def build(out: Path) -> None:
        from safetensors.torch import load_file, save_file

        shutil.copytree(base.target, out / "target")
        shutil.copytree(base.draft, out / "draft")
        weights = out / "target" / "model.safetensors"
        state = load_file(str(weights))
        state["lm_head.weight"] = state["lm_head.weight"] * (logit / FOLLOWER_LOGIT)
        save_file(state, str(weights), metadata={"format": "pt"})

    root = models._cached(key, build)
    return models.ModelPair(str(root / "target"), str(root / "draft"), base.vocab_size, base.eos_token_id,
                            base.chain)
