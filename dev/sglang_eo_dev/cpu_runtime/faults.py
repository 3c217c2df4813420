"""TEST ONLY fault injection into the plugin's tree-mask build, for the engine-level fault tests.

Active in the scheduler process when ``SGLANG_EO_FAULTS=1`` (read by :func:`sglang_eo_dev.cpu_runtime.plugin.load`).
A request opts in through a marker in its ``rid``. Two paths into the mask build, each with a failing and a slow
fault:

* the generic walk through SGLang's grammar-object API (what non-xgrammar grammars take): the builder gets a
  :class:`FaultyGrammar` wrapping the request's real grammar object, and no matcher;

  - ``eo-fault-raise``: ``fill_vocab_mask`` raises :class:`InjectedGrammarFault`;
  - ``eo-fault-slow``: ``fill_vocab_mask`` sleeps :data:`SLOW_FILL_S` per row, so the build exceeds the plugin's time
    limit (``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS``) while every row it fills stays exact;

* the lockstep path users run (xgrammar): the builder gets a :class:`FaultyMatcher` wrapping the request's real
  ``xgrammar.GrammarMatcher``; xgrammar's batched fill reaches the real C++ matcher through ``_handle``, the walk calls
  ``accept_token`` / ``rollback`` / ``is_terminated`` on the wrapper;

  - ``eo-fault-matcher-raise``: the matcher is broken everywhere: reading ``_handle`` (inside the lockstep batched
    fill), ``accept_token`` and ``fill_next_token_bitmask`` (the per-request walk that finds the culprit) raise;
  - ``eo-fault-matcher-slow``: ``accept_token`` sleeps :data:`SLOW_FILL_S`, so the lockstep rounds pass the deadline.

* the batched llguidance walk (``--grammar-backend llguidance``): the builder gets the request's grammar wrapped as
  for ``eo-fault-raise`` and, beside it, a :class:`FaultyGuidance` in place of its ``llguidance.LLMatcher``;

  - ``eo-fault-guidance-raise``: the batched fill of its rows raises (counted as ``faults_guidance_raised``; with
    llguidance's thread pool, llguidance itself refuses the stand-in), and the per-request walk that finds the culprit
    then gets ``fill_vocab_mask`` raising (``faults_raised``).

* ``eo-fault-rank1-slow``: ``eo-fault-slow``, but only in the scheduler of tensor-parallel rank 1 (``torch.distributed``
  rank): one rank slower than the others, as when its core is busy (the ranks must still build the same mask).

How: an AROUND hook on the product plugin's ``integration.requests.mask_request_for`` (the Req -> mask input mapping,
the only place the plugin picks a request's grammar for the mask build) swaps the mask input. The request's own grammar
(used by SGLang to advance over committed tokens) is untouched. Every injected call is counted in the runtime stats
file (``faults_raised``, ``faults_slow_fills``, ``faults_matcher_raised``, ``faults_matcher_raised_in_batch_fill``,
``faults_matcher_slow_accepts``, ``faults_matcher_batch_fills``) so a test can assert the fault really happened, on
the path it was meant for.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

__all__ = ["ENV_FLAG", "GUIDANCE_RAISE_MARKER", "RAISE_MARKER", "RANK1_SLOW_MARKER", "SLOW_MARKER", "RAISE_MATCHER_MARKER",
           "SLOW_MATCHER_MARKER", "SLOW_FILL_S", "FaultyGrammar", "FaultyGuidance", "FaultyMatcher", "InjectedGrammarFault",
           "mask_request_for_around", "TARGET"]

ENV_FLAG = "SGLANG_EO_FAULTS"
RAISE_MARKER = "eo-fault-raise"
SLOW_MARKER = "eo-fault-slow"
RAISE_MATCHER_MARKER = "eo-fault-matcher-raise"
SLOW_MATCHER_MARKER = "eo-fault-matcher-slow"
RANK1_SLOW_MARKER = "eo-fault-rank1-slow"
GUIDANCE_RAISE_MARKER = "eo-fault-guidance-raise"
SLOW_FILL_S = 0.025
TARGET = "sglang_eagle_overlap.integration.requests.mask_request_for"


class InjectedGrammarFault(RuntimeError):
    """The fault an ``eo-fault-raise`` / ``eo-fault-matcher-raise`` request raises during the mask build."""


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


class FaultyGuidance:
    """Stands in for a request's ``llguidance.LLMatcher`` in the batched llguidance walk: its fills raise."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        from sglang_eo_dev.cpu_runtime import stats

        stats.count("faults_guidance_raised")
        raise InjectedGrammarFault(f"injected llguidance fill fault for request {self.rid} (SGLANG_EO_FAULTS)")

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


class FaultyMatcher:
    """Delegates an ``xgrammar.GrammarMatcher`` (the lockstep path's view of a request), with the injected fault."""

    def __init__(self, inner: Any, mode: str, rid: str) -> None:
        self.inner, self.mode, self.rid = inner, mode, rid

    def _raise(self, where: str) -> None:
        from sglang_eo_dev.cpu_runtime import stats

        stats.count("faults_matcher_raised")
        if where == "batch fill":
            stats.count("faults_matcher_raised_in_batch_fill")
        raise InjectedGrammarFault(f"injected matcher fault ({where}) for request {self.rid} (SGLANG_EO_FAULTS)")

    @property
    def _handle(self) -> Any:
        """What xgrammar's ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` reads from each matcher."""
        from sglang_eo_dev.cpu_runtime import stats

        if self.mode == "raise":
            self._raise("batch fill")
        stats.count("faults_matcher_batch_fills")
        return self.inner._handle

    def accept_token(self, token: int, *args: Any, **kwargs: Any) -> bool:
        if self.mode == "raise":
            self._raise("accept_token")
        from sglang_eo_dev.cpu_runtime import stats

        stats.count("faults_matcher_slow_accepts")
        time.sleep(SLOW_FILL_S)
        return self.inner.accept_token(token, *args, **kwargs)

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "raise":
            self._raise("fill_next_token_bitmask")
        return self.inner.fill_next_token_bitmask(bitmask, index, *args, **kwargs)

    def rollback(self, k: int) -> None:
        self.inner.rollback(k)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def __getattr__(self, name: str) -> Any:  # anything else a strategy may call (e.g. traverse_draft_tree)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _mode(rid: str) -> Optional[str]:
    for marker, mode in ((GUIDANCE_RAISE_MARKER, "guidance-raise"), (RAISE_MATCHER_MARKER, "matcher-raise"), (SLOW_MATCHER_MARKER, "matcher-slow"),
                         (RAISE_MARKER, "raise"), (SLOW_MARKER, "slow")):
        if marker in rid:
            return mode
    return None


def mask_request_for_around(original: Any, req: Any) -> Any:
    out = original(req)
    rid = str(getattr(req, "rid", ""))
    mode = _mode(rid)
    if RANK1_SLOW_MARKER in rid and _rank() == 1:
        mode = "slow"
    if mode is None or (out.matcher is None and out.grammar is None):
        return out  # not marked, or unconstrained / finished: nothing to break
    # a new row: the plugin's rows are shared by every step of the request (immutable)
    if mode == "guidance-raise":
        if out.guidance is not None:  # an llguidance request: break its batched fill, then its grammar
            return dataclasses.replace(out, grammar=FaultyGrammar(req.grammar, "raise", rid),
                                       guidance=FaultyGuidance(rid))
        return out
    if mode.startswith("matcher-"):
        if out.matcher is not None:  # an xgrammar request: break it on the lockstep path
            return dataclasses.replace(out, matcher=FaultyMatcher(out.matcher, mode[len("matcher-"):], rid))
        return out
    return dataclasses.replace(out, matcher=None, grammar=FaultyGrammar(req.grammar, mode, rid))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
