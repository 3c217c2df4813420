"""TEST ONLY fault injection into the plugin's tree-mask build, for the engine-level fault tests.

Active in the scheduler process when ``SGLANG_EO_FAULTS=1`` (read by :func:`sglang_eo_dev.cpu_runtime.plugin.load`).
A request opts in through a marker in its ``rid``:

* ``eo-fault-raise``: its grammar object raises ``RuntimeError`` whenever the verify-tree mask is built for it (a grammar
  object that fails during the mask build);
* ``eo-fault-slow``: its grammar object sleeps :data:`SLOW_FILL_S` per mask row it fills, so the build exceeds the
  plugin's time limit (``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS``) while every row it does fill stays exact;
* ``eo-fault-rank1-slow``: the same, but only in the scheduler of tensor-parallel rank 1 (``torch.distributed`` rank):
  one rank slower than the others, as when its core is busy (issue #21: the ranks must still build the same mask).

How: an AROUND hook on the product plugin's ``integration.requests.mask_request_for`` (the Req -> mask input mapping, the
only place the plugin picks a request's grammar for the mask build) hands the builder a :class:`FaultyGrammar` that
wraps the request's real SGLang grammar object, so the plugin walks it through the generic grammar-object API. The
request's own grammar (used by SGLang to advance over committed tokens) is untouched. Every injected call is counted
in the runtime stats file (``faults_raised``, ``faults_slow_fills``) so a test can assert the fault really happened.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ENV_FLAG", "RAISE_MARKER", "RANK1_SLOW_MARKER", "SLOW_MARKER", "SLOW_FILL_S", "FaultyGrammar", "InjectedGrammarFault",
           "mask_request_for_around", "TARGET"]

ENV_FLAG = "SGLANG_EO_FAULTS"
RAISE_MARKER = "eo-fault-raise"
SLOW_MARKER = "eo-fault-slow"
RANK1_SLOW_MARKER = "eo-fault-rank1-slow"
SLOW_FILL_S = 0.025
TARGET = "sglang_eagle_overlap.integration.requests.mask_request_for"


class InjectedGrammarFault(RuntimeError):
    """The fault a ``eo-fault-raise`` request's grammar raises during the mask build."""


class FaultyGrammar:
    """Delegates SGLang's grammar-object API (accept_token / rollback / is_terminated / fill_vocab_mask) to the
    request's real grammar, with the injected fault in ``fill_vocab_mask``."""

    def __init__(self, inner: Any, mode: str, rid: str) -> None:
        self.inner, self.mode, self.rid = inner, mode, rid

    def accept_token(self, token: int) -> Any:
        return self.inner.accept_token(token)

    def rollback(self, k: int) -> None:
        self.inner.rollback(k)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def fill_vocab_mask(self, vocab_mask: Any, idx: int) -> None:
        from sglang_eo_dev.cpu_runtime import stats

        if self.mode == "raise":
            stats.count("faults_raised")
            raise InjectedGrammarFault(f"injected grammar fault for request {self.rid} (SGLANG_EO_FAULTS)")
        stats.count("faults_slow_fills")
        time.sleep(SLOW_FILL_S)
        self.inner.fill_vocab_mask(vocab_mask, idx)


def mask_request_for_around(original: Any, req: Any) -> Any:
    out = original(req)
    rid = str(getattr(req, "rid", ""))
    mode = "raise" if RAISE_MARKER in rid else "slow" if SLOW_MARKER in rid else None
    if RANK1_SLOW_MARKER in rid and _rank() == 1:
        mode = "slow"
    if mode is None or (out.matcher is None and out.grammar is None):
        return out  # not marked, or unconstrained / finished: nothing to break
    out.matcher = None
    out.grammar = FaultyGrammar(req.grammar, mode, rid)
    return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
