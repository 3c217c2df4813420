"""TreeMaskBuilder: a grammar that raises during the build fails that request alone.

Batch of three requests on the ``regex`` grammar, each at a different point of its own document; the middle one is
faulty. Draft tree per request (topk 2, 2 steps, 5 nodes), first child = true continuation::

    0 ── 1 ── 3
    │    └─── 4
    └─── 2

Expected: the faulty row is reported in ``TreeMask.failed`` with its error, its rows stay all-allowed, the other
requests' rows are bit-identical to a build without the faulty request, and every matcher / grammar is back in its
entry state (its next-token bitmask is unchanged).
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import MaskRequest

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core import mask as mask_mod
from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder
from sglang_eo_dev.helpers import grammars as G

VOCAB = 32000
N = 5


class BrokenGrammar:
    """Host grammar API over a real matcher; ``fill_vocab_mask`` raises after ``ok_fills`` fills."""

    def __init__(self, m, ok_fills: int) -> None:
        self.m, self.ok_fills, self.fills = m, ok_fills, 0

    def accept_token(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def rollback(self, k: int) -> None:
        self.m.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def fill_vocab_mask(self, vocab_mask, idx: int) -> None:
        if self.fills >= self.ok_fills:
            raise RuntimeError("boom: broken grammar backend")
        self.fills += 1
        self.m.fill_next_token_bitmask(vocab_mask, idx)


NotAMatcher = G.CorruptMatcher  # accepts every token, raises on the fill


class RaisingMatcher(xgr.GrammarMatcher):
    """A real xgrammar matcher (the batched fills take it) whose ``accept_token`` raises for one ``armed`` token:
    xgrammar failing inside the walk after the walk already filled rows and accepted other tokens."""

    armed: Optional[int] = None

    def accept_token(self, token_id: int, *args, **kwargs) -> bool:
        if token_id == self.armed:
            raise RuntimeError(f"boom: token {token_id}")
        return bool(super().accept_token(token_id, *args, **kwargs))


def _tree(doc, at):
    nxt = [1, 3, -1, -1, -1]
    sib = [-1, 2, -1, 4, -1]
    tok = [0, doc[at], doc[at + 5] if at + 5 < len(doc) else 1, doc[at + 1], 7]
    return nxt, sib, tok


def _setup(cls=None):
    """The batch; ``cls``: its matchers are of that ``xgrammar.GrammarMatcher`` subclass (same states)."""
    rng = random.Random(3)
    docs = [list(G.doc_tokens("regex", rng, VOCAB)) for _ in range(3)]
    ats = [2, 4, 3]
    matchers = [G.matcher("regex", VOCAB, d[:a], cls=cls) for d, a in zip(docs, ats)]
    trees = [_tree(d, a) for d, a in zip(docs, ats)]
    nxt = torch.tensor([t[0] for t in trees])
    sib = torch.tensor([t[1] for t in trees])
    tok = torch.tensor([t[2] for t in trees])
    return matchers, nxt, sib, tok


@pytest.mark.parametrize("strategy", ["lockstep", "native", "python"])
@pytest.mark.parametrize("ok_fills", [0, 1])  # fails at the root / deeper in the tree (after accepting a token)
def test_raising_grammar_fails_only_its_request(strategy, ok_fills):
    matchers, nxt, sib, tok = _setup()
    before = [G.next_token_bitmask(m, VOCAB).clone() for m in matchers]
    clean = StrategyMaskBuilder(strategy=strategy, threads=1).build(
        [MaskRequest(matcher=m) for m in matchers], nxt, sib, tok, VOCAB).bitmask.clone()
    broken = BrokenGrammar(matchers[1], ok_fills)
    reqs = [MaskRequest(matcher=matchers[0], request_id="a"), MaskRequest(grammar=broken, request_id="b"),
            MaskRequest(matcher=matchers[2], request_id="c")]
    out = StrategyMaskBuilder(strategy=strategy, threads=1).build(reqs, nxt, sib, tok, VOCAB)
    assert [i for i, _ in out.failed] == [1] and "boom: broken grammar backend" in out.failed[0][1]
    assert torch.equal(out.bitmask[N : 2 * N], torch.full_like(out.bitmask[N : 2 * N], -1))
    assert torch.equal(out.bitmask[:N], clean[:N]) and torch.equal(out.bitmask[2 * N :], clean[2 * N :])
    assert broken.fills == ok_fills  # it really failed where intended
    for m, b in zip(matchers, before):
        assert torch.equal(G.next_token_bitmask(m, VOCAB), b)


@pytest.mark.parametrize("strategy", ["lockstep", "native"])
def test_matcher_breaking_the_batched_walk_is_isolated(strategy):
    matchers, nxt, sib, tok = _setup()
    before = [G.next_token_bitmask(m, VOCAB).clone() for m in matchers]
    clean = StrategyMaskBuilder(strategy=strategy, threads=1).build(
        [MaskRequest(matcher=m) for m in matchers], nxt, sib, tok, VOCAB).bitmask.clone()
    reqs = [MaskRequest(matcher=matchers[0]), MaskRequest(matcher=NotAMatcher()), MaskRequest(matcher=matchers[2])]
    out = StrategyMaskBuilder(strategy=strategy, threads=1).build(reqs, nxt, sib, tok, VOCAB)
    assert [i for i, _ in out.failed] == [1], out.failed
    assert torch.equal(out.bitmask[:N], clean[:N]) and torch.equal(out.bitmask[2 * N :], clean[2 * N :])
    assert torch.equal(out.bitmask[N : 2 * N], torch.full_like(out.bitmask[N : 2 * N], -1))
    for i in (0, 2):
        assert torch.equal(G.next_token_bitmask(matchers[i], VOCAB), before[i])


def test_a_request_without_anything_to_walk_is_refused_by_name():
    """The mask paths' guards name the request (a bug in a caller, never a user input: the builder sends a row down a
    path only when it has what that path needs)."""
    with pytest.raises(ValueError, match=r"^request 'r7' has no xgrammar matcher for the native tree walk$"):
        mask_mod._native_matcher(MaskRequest(request_id="r7"))
    with pytest.raises(ValueError, match=r"^request 'r8' has neither a matcher nor a grammar: nothing to walk$"):
        mask_mod._walk_request(MaskRequest(request_id="r8"), [-1], [-1], [0], 8, torch.zeros((1, 1), dtype=torch.int32),
                               0, None)


def test_lockstep_walk_raising_after_another_request_finished_restores_every_matcher():
    """Request 0's walk (a one-draft chain) is over -- its matcher rolled back to the entry state -- when request 1's
    matcher raises in the same round, at its second draft. The batched walk is abandoned for every request, the
    finished one included, which must not be rolled back again: the per-request rebuild gives request 0's exact rows,
    reports request 1 alone, and both matchers end where they started."""
    rng = random.Random(3)
    docs = [list(G.doc_tokens("regex", rng, VOCAB)) for _ in range(2)]
    nxt = torch.tensor([[1, -1, -1, -1, -1], [1, 2, 3, -1, -1]])
    sib = torch.full((2, N), -1)
    tok = torch.tensor([[0, docs[0][2], 0, 0, 0], [0, docs[1][2], docs[1][3], docs[1][4], 0]])
    assert docs[1][3] not in (docs[1][2], docs[1][4])  # the armed token is the second draft's only
    clean = TreeMaskBuilder(strategy="lockstep", threads=1).build(
        [MaskRequest(matcher=G.matcher("regex", VOCAB, d[:2])) for d in docs], nxt, sib, tok, VOCAB)
    matchers = [G.matcher("regex", VOCAB, docs[0][:2]), G.matcher("regex", VOCAB, docs[1][:2], cls=RaisingMatcher)]
    matchers[1].armed = docs[1][3]
    before = [G.next_token_bitmask(m, VOCAB) for m in matchers]
    got = TreeMaskBuilder(strategy="lockstep", threads=1).build(
        [MaskRequest(matcher=m) for m in matchers], nxt, sib, tok, VOCAB)
    assert got.failed == [(1, f"RuntimeError: boom: token {docs[1][3]}")]
    assert torch.equal(got.bitmask[:N], clean.bitmask[:N]) and bool((got.bitmask[N:] == -1).all())
    assert got.valid_nodes == 2  # request 0's root and draft
    for m, b in zip(matchers, before):
        assert torch.equal(G.next_token_bitmask(m, VOCAB), b)
