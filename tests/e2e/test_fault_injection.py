"""The engine fault tests' injector (``sglang_eo_dev.cpu_runtime.faults``) on the real mask builder, no engine: each
marker reaches the path it is named for, and the builder's recovery on that path is what the engine test relies on."""

from __future__ import annotations

import random
import types

import pytest
import torch

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.integration.requests import mask_request_for
from sglang_eo_dev.cpu_runtime import faults, stats
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

VOCAB = 32000


def _reqs(rids):
    reqs, trees = [], []
    rng = random.Random(7)
    for i, rid in enumerate(rids):
        doc = list(G.doc_tokens("nested", random.Random(i), VOCAB))
        k = len(doc) // 3
        g = G.sglang_grammar("nested", VOCAB, doc[:k])
        reqs.append(types.SimpleNamespace(rid=rid, grammar=g, finished=lambda: False))
        trees.append(eagle_tree(rng, 2, 3, 8, doc[k:], VOCAB, matcher=g.matcher))
    return reqs, stack_trees(trees)


def _counters():
    return {k: v for k, v in stats._state.items() if k.startswith("faults_")}


def _delta(before, name):
    return _counters().get(name, 0) - before.get(name, 0)


def test_markers_pick_the_path():
    names = ["plain", f"{faults.RAISE_MARKER}-1", f"{faults.SLOW_MARKER}-1", f"{faults.RAISE_MATCHER_MARKER}-1",
             f"{faults.SLOW_MATCHER_MARKER}-1"]
    reqs, _ = _reqs(names)
    plain, g_raise, g_slow, m_raise, m_slow = (faults.mask_request_for_around(mask_request_for, r) for r in reqs)
    assert plain.matcher is reqs[0].grammar.matcher and plain.grammar is None
    for q in (g_raise, g_slow):  # the generic walk: no matcher, a wrapped grammar object
        assert q.matcher is None and isinstance(q.grammar, faults.FaultyGrammar)
    for q, r in ((m_raise, reqs[3]), (m_slow, reqs[4])):  # the lockstep path: the real matcher, wrapped
        assert isinstance(q.matcher, faults.FaultyMatcher) and q.matcher.inner is r.grammar.matcher
        assert q.grammar is None


def test_raising_matcher_fails_the_lockstep_fill_and_only_its_request():
    reqs, (nxt, sib, tok) = _reqs(["a", f"{faults.RAISE_MATCHER_MARKER}-1", "c"])
    want = TreeMaskBuilder().build([mask_request_for(r) for r in reqs], nxt, sib, tok, VOCAB).bitmask.clone()
    before = _counters()
    inputs = [faults.mask_request_for_around(mask_request_for, r) for r in reqs]
    got = TreeMaskBuilder(strategy="lockstep", threads=1).build(inputs, nxt, sib, tok, VOCAB)
    assert [i for i, _ in got.failed] == [1] and "injected matcher fault" in got.failed[0][1]
    assert _delta(before, "faults_matcher_raised_in_batch_fill") >= 1  # it struck inside xgrammar's batched fill
    n = nxt.shape[1]
    for i in (0, 2):
        assert torch.equal(got.bitmask[i * n:(i + 1) * n], want[i * n:(i + 1) * n])


def test_slow_matcher_passes_the_lockstep_deadline(monkeypatch):
    clock = {"now": 0.0}

    def advance(seconds):
        clock["now"] += seconds

    monkeypatch.setattr(faults, "time", types.SimpleNamespace(sleep=advance))  # the injected sleep moves the clock
    reqs, (nxt, sib, tok) = _reqs([f"{faults.SLOW_MATCHER_MARKER}-1"])
    matcher = reqs[0].grammar.matcher
    root = G.next_token_bitmask(matcher, VOCAB)
    before = _counters()
    inputs = [faults.mask_request_for_around(mask_request_for, r) for r in reqs]
    builder = TreeMaskBuilder(strategy="lockstep", threads=1, time_limit_s=0.04, clock=lambda: clock["now"])
    got = builder.build(inputs, nxt, sib, tok, VOCAB)
    assert got.timed_out == [0] and got.failed == []
    assert _delta(before, "faults_matcher_batch_fills") >= 1 and _delta(before, "faults_matcher_slow_accepts") >= 2
    assert torch.equal(got.bitmask[0], root[0]) and bool((got.bitmask[1:] == -1).all())
    assert torch.equal(G.next_token_bitmask(matcher, VOCAB), root)  # the real matcher is back where it was


@pytest.mark.parametrize("mode", ["raise", "slow"])
def test_generic_faults_still_take_the_grammar_walk(mode):
    marker = faults.RAISE_MARKER if mode == "raise" else faults.SLOW_MARKER
    reqs, _ = _reqs([f"{marker}-1"])
    q = faults.mask_request_for_around(mask_request_for, reqs[0])
    assert q.matcher is None and q.grammar.mode == mode and q.grammar.inner is reqs[0].grammar


def test_a_request_being_aborted_is_not_built_again():
    """With overlap the next batch is formed before an abort lands: a request whose grammar failed is still in it, with
    ``to_finish`` set. Its row is unconstrained and its grammar is not called, so one failure is counted once."""
    reqs, (nxt, sib, tok) = _reqs([f"{faults.RAISE_MATCHER_MARKER}-1", "b"])
    builder = TreeMaskBuilder(strategy="lockstep", threads=1)
    first = builder.build([faults.mask_request_for_around(mask_request_for, r) for r in reqs], nxt, sib, tok, VOCAB)
    assert [i for i, _ in first.failed] == [0]
    want_b = first.bitmask[nxt.shape[1]:].clone()
    reqs[0].to_finish = object()  # what finish_with_error leaves until SGLang's check_finished
    before = _counters()
    again = builder.build([faults.mask_request_for_around(mask_request_for, r) for r in reqs], nxt, sib, tok, VOCAB)
    assert again.failed == [] and _delta(before, "faults_matcher_raised_in_batch_fill") == 0
    n = nxt.shape[1]
    assert bool((again.bitmask[:n] == -1).all()) and torch.equal(again.bitmask[n:], want_b)
