"""The lockstep walk abandoned at the time limit while one grammar's rollback fails: every matcher ends where it
started.

At the time limit the walk abandons its walkers one by one (each rolls its matcher back to the entry state). If one
of those rollbacks raises (a transient backend error), the batched walk is given up and every walker is abandoned
again, the ones already rolled back included, before the requests are walked one by one. An abandoned walker must
know it has nothing left to roll back: rolling a matcher back a second time would move it before its entry state --
past tokens the ledger fed in earlier steps --, and the per-request walk and every later step would read that wrong
state.

Time is an injected clock that the drafts' acceptance moves past the limit, so the walk times out in its second
round on any host.
"""

from __future__ import annotations

import random
from typing import Optional

import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eo_dev.helpers import grammars as G

VOCAB = 32000
N = 4
LIMIT_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SlowMatcher(xgr.GrammarMatcher):
    """A real matcher (the batched fills take it) whose accepted drafts take longer than the whole time limit, and
    whose rollback raises ``fail_rollbacks`` times before it works again."""

    clock: Optional[Clock] = None  # set once the matcher is at its entry state
    fail_rollbacks = 0

    def accept_token(self, token_id: int, *args, **kwargs) -> bool:
        if self.clock is not None:
            self.clock.now += 2 * LIMIT_S
        return bool(super().accept_token(token_id, *args, **kwargs))

    def rollback(self, *args, **kwargs):
        if self.fail_rollbacks:
            self.fail_rollbacks -= 1
            raise RuntimeError("boom: rollback")
        return super().rollback(*args, **kwargs)


def test_a_rollback_failing_at_the_time_limit_leaves_every_matcher_at_its_entry_state():
    rng = random.Random(7)
    docs = [list(G.doc_tokens("regex", rng, VOCAB)) for _ in range(2)]
    # Each request a chain of its two true next tokens, after two tokens of its document.
    nxt = torch.tensor([[1, 2, -1, -1]] * 2)
    sib = torch.full((2, N), -1)
    tok = torch.tensor([[0, d[2], d[3], 0] for d in docs])
    clean = TreeMaskBuilder(strategy="lockstep", threads=1).build(
        [MaskRequest(matcher=G.matcher("regex", VOCAB, d[:2])) for d in docs], nxt, sib, tok, VOCAB).bitmask

    clock = Clock()
    matchers = [G.matcher("regex", VOCAB, d[:2], cls=SlowMatcher) for d in docs]
    for m in matchers:
        m.clock = clock
    matchers[1].fail_rollbacks = 1  # request 1's rollback at the time limit raises, once
    before = [G.next_token_bitmask(m, VOCAB) for m in matchers]
    builder = TreeMaskBuilder(strategy="lockstep", threads=1, time_limit_s=LIMIT_S, clock=clock)
    got = builder.build([MaskRequest(matcher=m, request_id=f"r{i}") for i, m in enumerate(matchers)], nxt, sib, tok,
                        VOCAB)

    assert matchers[1].fail_rollbacks == 0  # the rollback did fail where intended
    assert sorted(got.timed_out) == [0, 1] and not got.failed
    for i, (m, b) in enumerate(zip(matchers, before)):
        assert torch.equal(G.next_token_bitmask(m, VOCAB), b), i
        assert torch.equal(got.bitmask[i * N], clean[i * N]), i  # the root row: the entry state's
        assert bool((got.bitmask[i * N + 1 : (i + 1) * N] == -1).all()), i  # past the time limit: all-allowed
