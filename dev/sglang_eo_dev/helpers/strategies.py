"""Tree-mask strategies the product never chooses, kept to compare with its lockstep walk (tests, benchmarks).

:class:`StrategyMaskBuilder` is the product's ``TreeMaskBuilder`` with its walk of plain xgrammar matchers replaced
per ``strategy``:

* ``"native"`` -- per-request ``GrammarMatcher.traverse_draft_tree`` (C++ DFS, one thread), rejected rows restored to
  all-allowed (a fully zero row would turn a row of logits into all -inf);
* ``"python"`` -- the generic walk through the grammar object API for every request;
* ``"lockstep"`` / ``"auto"`` -- the product's own walk.

Same contract as the product's walk: the time limit keeps the exact root row and leaves the others all-allowed, a
request whose grammar raises fails alone, and every matcher is returned to its state on entry.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from sglang_eagle_overlap.core import mask as mask_mod
from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.mask import MaskRequest, TreeMaskBuilder

__all__ = ["STRATEGIES", "StrategyMaskBuilder"]

STRATEGIES = ("auto", "lockstep", "native", "python")


class StrategyMaskBuilder(TreeMaskBuilder):
    """``TreeMaskBuilder`` with any of :data:`STRATEGIES` (the module docstring). The product's native module walk
    applies only under ``lockstep`` (``TreeMaskBuilder.prepare`` checks the strategy)."""

    def __init__(self, strategy: str = "auto", **kwargs: Any) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown mask strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
        super().__init__(**kwargs)
        self.strategy = "lockstep" if strategy == "auto" else strategy  # type: ignore[assignment]

    def _walk_setup(self) -> None:
        if self.strategy == "lockstep":
            super()._walk_setup()

    def _walk_xgrammar(self, requests: Sequence[MaskRequest], rows: Sequence[int],
                       lists: Tuple[List[List[int]], List[List[int]], List[List[int]]],
                       tensors: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, vocab_size: int,
                       mask: torch.Tensor, deadline: Optional[float], timed_out: List[int],
                       forced: Optional[ForcedDrafts], written: List[int]) -> Optional[int]:
        if self.strategy == "lockstep":
            return super()._walk_xgrammar(requests, rows, lists, tensors, n, vocab_size, mask, deadline, timed_out,
                                          forced, written)
        if self.strategy == "python":
            return None
        for i in rows:
            written.extend(range(i * n, (i + 1) * n))
        nxt, sib, tok = tensors
        return self._traverse(requests, rows, nxt, sib, tok.reshape(len(requests), n), n, vocab_size, mask, deadline,
                              timed_out)

    def _traverse(self, requests: Sequence[MaskRequest], rows: Sequence[int], nxt_t: torch.Tensor,
                  sib_t: torch.Tensor, tok_t: torch.Tensor, n: int, vocab_size: int, mask: torch.Tensor,
                  deadline: Optional[float], timed_out: List[int]) -> int:
        """The ``native`` strategy: xgrammar's ``traverse_draft_tree`` per request."""
        nxt_t = nxt_t.to(torch.int64).contiguous()
        sib_t = sib_t.to(torch.int64).contiguous()
        tok_t = tok_t.to(torch.int64).contiguous()
        # Out-of-vocabulary draft tokens are invalid; xgrammar would read past the bitmask row for them.
        oov = (tok_t < 0) | (tok_t >= vocab_size)
        if bool(oov.any()):
            tok_t = tok_t.masked_fill(oov, 0)
            oov_any = oov.any(dim=1).tolist()
        else:
            oov_any = None
        valid = 0
        for i in rows:
            matcher = mask_mod._native_matcher(requests[i])
            block = mask[i * n : (i + 1) * n]
            # Every row of the block is written below (the caller counts them all as this build's: the deferred
            # reset skips them), so the paths that fill only some rows start from all-allowed.
            if matcher.is_terminated():
                mask_mod._fill_all_allowed(block)
                continue
            if oov_any is not None and oov_any[i]:
                # Rare: fall back to the exact walk for this request.
                mask_mod._fill_all_allowed(block)
                v, done = mask_mod._walk_request(requests[i], nxt_t[i].tolist(), sib_t[i].tolist(),
                                                 tok_t[i].masked_fill(oov[i], -1).tolist(), vocab_size, mask, i * n,
                                                 deadline, self.clock)
                valid += v
                if not done:
                    timed_out.append(i)
                continue
            limit = -1.0 if deadline is None else max(deadline - self.clock(), 1e-6)
            block_np = block.numpy()
            # Start from zero rows: xgrammar writes the rows of the nodes it reaches and zeroes rejected ones, so a
            # row still zero afterwards is a node that got no mask (rejected, terminating, unreached or padding).
            block_np.fill(0)
            done = matcher.traverse_draft_tree(nxt_t[i], sib_t[i], tok_t[i], block, limit)
            # Restore SGLang's all-allowed rows for all of those.
            zero = ~block_np.any(axis=1)
            nzero = int(zero.sum())
            if nzero:
                block_np[zero] = -1
            valid += n - nzero
            if not done:
                # Keep the exact root row, drop everything else (see the product's mask module docstring).
                mask_mod._fill_all_allowed(block)
                matcher.fill_next_token_bitmask(block, 0)
                timed_out.append(i)
        return valid
