"""TreeMaskBuilder's time limit covers the walk and its fills only, never one-time set-up.

Seen on an H200 (``../shared/notes/gpu-runtime.md``): every request hit the 50 ms mask time limit exactly once, at
bs 1 too, so its drafts were dropped for that step. The build allocated its (pinned, on a GPU host) bitmask buffer
and created its fill thread pool inside the timed region, and reallocated the buffer for every larger batch. Here a
slow allocation and a slow thread-pool start stand in for ``cudaHostAlloc``: they must not make any request time
out, and a batch that grows step by step must reallocate O(log rows) times, not once per new size.

Time is an injected clock (``TreeMaskBuilder(clock=...)``) that moves only when a test moves it: the outcome never
depends on how busy the host is.
"""

from __future__ import annotations

import logging
import random

import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import MaskRequest

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core import mask as mask_mod
from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.trees import eagle_tree, num_draft_tokens, stack_trees

VOCAB = 32000
LIMIT_S = 0.05


class Clock:
    """Seconds that pass only through :meth:`advance`, or by ``tick`` on every reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick, self.readings = 0.0, tick, 0

    def __call__(self) -> float:
        self.readings += 1
        t = self.now
        self.now += self.tick
        return t

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _batch(bs: int, seed: int = 0):
    rng = random.Random(seed)
    n = num_draft_tokens(1, 3)
    reqs, trees = [], []
    for i in range(bs):
        doc = list(G.doc_tokens("nested", random.Random(seed * 1000 + i), VOCAB))
        k = rng.randrange(1, len(doc) - 1)
        m = G.matcher("nested", VOCAB, doc[:k])
        reqs.append(MaskRequest(matcher=m, request_id=f"r{i}"))
        trees.append(eagle_tree(rng, 1, 3, n, doc[k:], VOCAB, matcher=m))
    return reqs, stack_trees(trees)


def _exact(reqs, nxt, sib, tok) -> torch.Tensor:
    return TreeMaskBuilder().build(reqs, nxt, sib, tok, VOCAB).bitmask.clone()


def test_slow_set_up_does_not_count_against_the_time_limit(monkeypatch):
    clock = Clock()
    slow = {"alloc": 0, "pool": 0}
    real_empty, real_pool = torch.empty, xgr.BatchGrammarMatcher

    def slow_empty(*args, **kwargs):  # a pinned allocation on a busy driver: longer than the whole limit
        slow["alloc"] += 1
        clock.advance(2 * LIMIT_S)
        return real_empty(*args, **kwargs)

    def slow_pool(*args, **kwargs):  # xgrammar starting its fill threads
        slow["pool"] += 1
        clock.advance(2 * LIMIT_S)
        return real_pool(*args, **kwargs)

    reqs, (nxt, sib, tok) = _batch(4)
    want = _exact(reqs, nxt, sib, tok)
    builder = TreeMaskBuilder(strategy="lockstep", threads=2, time_limit_s=LIMIT_S, clock=clock)
    monkeypatch.setattr(torch, "empty", slow_empty)
    monkeypatch.setattr(xgr, "BatchGrammarMatcher", slow_pool)
    result = builder.build(reqs, nxt, sib, tok, VOCAB)
    monkeypatch.undo()
    assert slow["alloc"] >= 1 and slow["pool"] >= 1, slow  # both slow set-up steps ran inside this build
    assert builder.allocations == 1
    assert result.timed_out == [] and builder.timeouts == 0
    assert torch.equal(result.bitmask, want)
    assert clock.readings >= 2  # the deadline was taken from the injected clock and checked against it


def test_the_limit_is_measured_on_the_injected_clock():
    """Each reading advances the clock by 3/5 of the limit: the deadline (first reading + limit) has passed at the
    third reading, so every request times out after the same rounds, with its root row exact and the rest -1."""
    reqs, (nxt, sib, tok) = _batch(3, seed=3)
    want = _exact(reqs, nxt, sib, tok)
    n = nxt.shape[1]
    for strategy in ("lockstep", "python"):
        builder = StrategyMaskBuilder(strategy=strategy, time_limit_s=LIMIT_S, clock=Clock(tick=0.6 * LIMIT_S))
        result = builder.build(reqs, nxt, sib, tok, VOCAB)
        assert sorted(result.timed_out) == [0, 1, 2] and builder.timeouts == 3, (strategy, result.timed_out)
        for i in range(3):
            rows = result.bitmask[i * n : (i + 1) * n]
            assert torch.equal(rows[0], want[i * n]), (strategy, i)
            assert bool((rows[1:] == -1).all()), (strategy, i)
        # A clock that never moves never expires, whatever the real time: the mask is exact.
        frozen = StrategyMaskBuilder(strategy=strategy, time_limit_s=0.0, clock=Clock())
        result = frozen.build(reqs, nxt, sib, tok, VOCAB)
        assert result.timed_out == [] and torch.equal(result.bitmask, want), strategy


def test_builder_default_clock_is_perf_counter():
    assert TreeMaskBuilder().clock is mask_mod.time.perf_counter


def test_growing_batch_reallocates_logarithmically():
    builder = TreeMaskBuilder()
    for bs in range(1, 65):
        reqs, (nxt, sib, tok) = _batch(bs, seed=bs)
        result = builder.build(reqs, nxt, sib, tok, VOCAB)
        assert result.bitmask.shape[0] == bs * nxt.shape[1]
    # rows grow 4 -> 256: the buffer doubles (4, 8, 16, ..., 256 rows), never reallocated per new batch size
    assert builder.allocations == 7, builder.allocations


def test_native_out_of_vocabulary_fallback_keeps_the_injected_clock(caplog):
    """Under the native strategy a request with an out-of-vocabulary draft takes the exact walk (xgrammar's native walk
    would read past the row for it), which keeps the time limit on the injected clock like the lockstep and python
    walks: frozen, it never expires (exact mask); at 3/5 of the limit per reading every such request times out with its
    root row exact and the rest -1, reported as a time-out, not as a failed native walk (no per-request rebuild)."""
    reqs, (nxt, sib, tok) = _batch(3, seed=3)
    tok = tok.clone()
    tok[:, -1] = VOCAB + 7  # each chain's last draft
    want = _exact(reqs, nxt, sib, tok)
    n = nxt.shape[1]
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        frozen = StrategyMaskBuilder(strategy="native", time_limit_s=0.0, clock=Clock())
        result = frozen.build(reqs, nxt, sib, tok, VOCAB)
        assert result.timed_out == [] and torch.equal(result.bitmask, want)
        builder = StrategyMaskBuilder(strategy="native", time_limit_s=LIMIT_S, clock=Clock(tick=0.6 * LIMIT_S))
        result = builder.build(reqs, nxt, sib, tok, VOCAB)
    assert sorted(result.timed_out) == [0, 1, 2] and builder.timeouts == 3 and result.failed == []
    for i in range(3):
        rows = result.bitmask[i * n : (i + 1) * n]
        assert torch.equal(rows[0], want[i * n]) and bool((rows[1:] == -1).all()), i
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 3 and all(" exceeded 50.0 ms; " in w for w in warned), warned
