"""Unit tests of the 0.5.23 adapter's functions against real SGLang objects (``XGrammarGrammar``, upstream's
``generate_token_bitmask`` / ``advance_grammar_fsm``, ``GenerationBatchResult``, ``ForwardMode``, ``GrammarMask``).

The hook functions are called directly (a fresh active runtime per test, from a fixture); SGLang itself is not patched here.

Draft tree used by the hand-written cases (topk 2, 2 steps; node: token)::

        0 (root, committed)
        +-- 1: truth[0] --- 3: truth[1]
        +-- 2: side token --- 4: side token
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_eo_dev.helpers.devices import verify_result
from sglang_eo_dev.helpers.grammars import sglang_grammar
from tests.adapters.v0_5_23_state import active_state, stand_in_req  # noqa: F401 - active_state is a fixture

pytestmark = [pytest.mark.sglang_0_5_23, pytest.mark.usefixtures("active_state")]

VOCAB = 32000


def _doc(seed=0):
    from sglang_eo_dev.helpers.grammars import doc_tokens

    return list(doc_tokens("nested", random.Random(seed), VOCAB))


def _batch(reqs, mode="DECODE"):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(reqs=reqs, has_grammar=True, forward_mode=getattr(ForwardMode, mode))


def _upstream_advance(result, batch):
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as P

    from sglang_eagle_overlap.integration.hooks import contains_hook as _contains_hook
    from sglang_eagle_overlap.adapters.v0_5_23.advance_grammar_fsm import advance_grammar_fsm_around

    # The reference must be SGLang's own method, not the plugin's hook (else the comparison is plugin vs plugin).
    assert not _contains_hook(P.advance_grammar_fsm, advance_grammar_fsm_around)
    ns = SimpleNamespace()
    ns._accept_grammar_tokens = lambda req, toks: P._accept_grammar_tokens(ns, req, toks)
    P.advance_grammar_fsm(ns, result, batch)


def _ours_advance(result, batch):
    from sglang_eagle_overlap.adapters.v0_5_23.advance_grammar_fsm import advance_grammar_fsm_around

    def original(*a, **k):
        raise AssertionError("SGLang's advance_grammar_fsm must not run while the plugin is active")

    advance_grammar_fsm_around(original, None, result, batch)


# -- advance_grammar_fsm: same results as upstream, exactly once ------------------------------------------------
@pytest.mark.parametrize("case", ["normal", "terminates_mid_run", "already_terminated", "rejected", "skips"])
def test_advance_matches_upstream(case):
    doc = _doc()
    n = 4

    def scenario():
        # Fresh grammars/requests for each side; returns (reqs, runs).
        if case == "normal":
            reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:5]), doc[:5]),
                    stand_in_req("b", sglang_grammar("nested", VOCAB, doc[:2]), doc[:2])]
            return reqs, [doc[5:8], doc[2:4]]
        if case == "terminates_mid_run":
            k = len(doc) - 2  # the run contains the last token + EOS, then two junk tokens
            reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k])]
            return reqs, [doc[k:] + [5, 6]]
        if case == "already_terminated":
            reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB, doc), doc)]
            return reqs, [[7, 8]]
        if case == "rejected":
            reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:3]), doc[:3])]
            bad = next(t for t in range(1, VOCAB) if not _allows(reqs[0].grammar, t))
            return reqs, [[doc[3], bad, doc[4]]]
        # skips: finished and retracted requests are untouched
        reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:3]), doc[:3], finished=True),
                stand_in_req("b", sglang_grammar("nested", VOCAB, doc[:3]), doc[:3], retracted=True),
                stand_in_req("c", sglang_grammar("nested", VOCAB, doc[:3]), doc[:3])]
        return reqs, [doc[3:5], doc[3:5], doc[3:6]]

    up_reqs, runs = scenario()
    up_res = verify_result(runs, n)
    _upstream_advance(up_res, _batch(up_reqs))
    our_reqs, runs = scenario()
    our_res = verify_result(runs, n)
    _ours_advance(our_res, _batch(our_reqs))
    assert our_res.grammar_advanced and up_res.grammar_advanced
    assert our_res.grammar_retained_tokens == up_res.grammar_retained_tokens
    for u, o in zip(up_reqs, our_reqs):
        assert o.grammar.accepted_tokens == u.grammar.accepted_tokens
        assert o.grammar.is_terminated() == u.grammar.is_terminated()
        assert (o.to_finish is None) == (u.to_finish is None)
        if u.to_finish is not None:
            assert type(o.to_finish) is type(u.to_finish)
            assert o.to_finish.message.startswith("Grammar accept_token failed:")
    if case == "rejected":
        assert our_reqs[0].to_finish is not None and our_res.grammar_retained_tokens == [[runs[0][0]]]
    if case in ("terminates_mid_run", "already_terminated"):
        assert our_reqs[0].grammar.is_terminated() and len(our_res.grammar_retained_tokens[0]) < len(runs[0])


def _allows(grammar, tok) -> bool:
    from sglang_eo_dev.helpers.trees import allowed_tokens

    return tok in set(allowed_tokens(grammar.matcher, VOCAB).tolist())


def test_extend_advances_prefill_token_and_skips_inflight_chunks():
    doc = _doc()
    reqs = [stand_in_req("a", sglang_grammar("nested", VOCAB)),
            stand_in_req("b", sglang_grammar("nested", VOCAB), chunks=1), stand_in_req("c", None)]
    from sglang.srt.managers.utils import GenerationBatchResult

    res = GenerationBatchResult(next_token_ids=torch.tensor([doc[0], doc[0], 9]))
    _ours_advance(res, _batch(reqs, "EXTEND"))
    assert res.grammar_advanced
    assert reqs[0].grammar.accepted_tokens == [doc[0]]
    assert reqs[1].grammar.accepted_tokens == []


def test_advance_is_exactly_once_across_barrier_and_result_processor(active_state):
    doc = _doc()
    req = stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:4]), doc[:4])
    res = verify_result([doc[4:7]], 4)
    _ours_advance(res, _batch([req]))  # the barrier, inside the next verify
    _ours_advance(res, _batch([req]))  # the result processor: flag set, nothing happens
    res.grammar_advanced = False  # even if the flag were lost, the ledger replays the recorded outcome
    _ours_advance(res, _batch([req]))
    assert req.grammar.accepted_tokens == doc[:7]
    assert res.grammar_retained_tokens == [doc[4:7]]
    assert active_state.step.ledger.tokens_fed == 3


def test_a_finished_request_is_forgotten_by_the_ledger_and_the_live_ones_are_kept(active_state):
    """The band's advance hands the finished constrained requests to ``prune`` (the ledger forgets them at once),
    without pruning the live ones of a batch that is small against the ledger."""
    doc = _doc()
    ledger = active_state.step.ledger
    a = stand_in_req("a", sglang_grammar("nested", VOCAB, doc[:4]), doc[:4])
    b = stand_in_req("b", sglang_grammar("nested", VOCAB, doc[:4]), doc[:4])
    _ours_advance(verify_result([doc[4:6], doc[4:5]], 4), _batch([a, b]))
    assert "a" in ledger and "b" in ledger
    a.finished = lambda: True  # a finished with that run; b goes on
    b.output_ids += doc[4:5]
    res = verify_result([doc[6:7], doc[5:7]], 4)
    _ours_advance(res, _batch([a, b]))
    assert "a" not in ledger and "b" in ledger and ledger.consumed("b") == 7
    assert res.grammar_retained_tokens == [None, doc[5:7]]


def test_passthrough_when_inactive(active_state):
    from sglang_eagle_overlap.adapters.v0_5_23.advance_grammar_fsm import advance_grammar_fsm_around

    active_state.active = False
    calls = []
    advance_grammar_fsm_around(lambda *a: calls.append(a), "self", "result", "batch")
    assert calls == [("self", "result", "batch")]


# -- mask path --------------------------------------------------------------------------------------------------
def _tree_batch(seed, bs, topk, steps):
    from sglang_eo_dev.helpers.trees import eagle_tree, num_draft_tokens, stack_trees

    rng = random.Random(seed)
    n = num_draft_tokens(topk, steps)
    reqs, trees = [], []
    for i in range(bs):
        doc = _doc(seed * 100 + i)
        k = rng.randrange(1, len(doc) - 1)
        g = sglang_grammar("nested", VOCAB, doc[:k])
        reqs.append(stand_in_req(f"r{i}", g, doc[:k]))
        trees.append(eagle_tree(rng, topk, steps, n, doc[k:], VOCAB, matcher=g.matcher))
    return reqs, stack_trees(trees), n


@pytest.mark.parametrize("topk,steps", [(1, 3), (4, 3)])
def test_mask_equals_upstream_generate_token_bitmask(topk, steps):
    from sglang.srt.speculative.spec_utils import generate_token_bitmask

    from sglang_eagle_overlap.adapters.v0_5_23.build_grammar_vocab_mask import build_grammar_vocab_mask_around
    from sglang_eagle_overlap.adapters.v0_5_23.band import PluginGrammarTree

    for seed in range(3):
        reqs, (nxt, sib, tok), n = _tree_batch(seed, 3, topk, steps)
        reqs.append(stand_in_req("free", None))  # an unconstrained row
        nxt = torch.cat([nxt, torch.full((1, n), -1)]); sib = torch.cat([sib, torch.full((1, n), -1)])
        tok = torch.cat([tok, torch.zeros((1, n), dtype=torch.int64)])
        before = [list(r.grammar.accepted_tokens) for r in reqs if r.grammar is not None]
        want, _ = generate_token_bitmask(reqs, nxt, sib, tok, VOCAB)
        info = SimpleNamespace(vocab_size=VOCAB, grammar_mask="leftover")
        barrier_calls = []
        draft = tok.clone()
        got = build_grammar_vocab_mask_around(
            lambda *a, **k: pytest.fail("upstream path taken"), reqs=reqs,
            tree=PluginGrammarTree.from_device(nxt, sib, draft), sampling_info=info, device=torch.device("cpu"),
            barrier=lambda: barrier_calls.append(1))
        assert barrier_calls == [1]
        assert info.grammar_mask is None
        assert type(got).__name__ == "GrammarMask" and got.grammar is reqs[0].grammar
        assert torch.equal(got.vocab_mask, want), f"seed {seed}"
        assert torch.equal(draft, tok)  # no timeout: drafts untouched
        assert [list(r.grammar.accepted_tokens) for r in reqs if r.grammar is not None] == before


def test_mask_timeout_neutralises_drafts(active_state):
    from sglang_eagle_overlap.adapters.v0_5_23.build_grammar_vocab_mask import build_grammar_vocab_mask_around
    from sglang_eagle_overlap.adapters.v0_5_23.band import PluginGrammarTree
    from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder

    reqs, (nxt, sib, tok), n = _tree_batch(7, 2, 4, 3)
    saved = active_state.step._builder
    active_state.step._builder = StrategyMaskBuilder(strategy="native", time_limit_s=1e-12)
    try:
        draft = tok.clone().reshape(-1)  # flat, like EagleVerifyInput.draft_token
        before = active_state.step.telemetry.stats.mask_timeouts
        got = build_grammar_vocab_mask_around(
            None, reqs=reqs, tree=PluginGrammarTree.from_device(nxt, sib, draft.view(nxt.shape)),
            sampling_info=SimpleNamespace(vocab_size=VOCAB, grammar_mask=None), device=torch.device("cpu"),
            barrier=None)
    finally:
        active_state.step._builder = saved
    view = draft.view(-1, n)
    assert active_state.step.telemetry.stats.mask_timeouts - before == 2
    assert torch.all(view[:, 1:] == -1) and torch.equal(view[:, 0], tok[:, 0])
    # the root rows are exact, everything else all-allowed
    for i, r in enumerate(reqs):
        root = torch.zeros((1, got.vocab_mask.shape[1]), dtype=torch.int32)
        r.grammar.matcher.fill_next_token_bitmask(root, 0)
        assert torch.equal(got.vocab_mask[i * n], root[0])
        assert torch.all(got.vocab_mask[i * n + 1:(i + 1) * n] == -1)


def test_mask_passthrough_for_sglang_trees_and_when_inactive(active_state):
    from sglang.srt.speculative.spec_utils import GrammarTree

    from sglang_eagle_overlap.adapters.v0_5_23 import band, grammar_tree
    from sglang_eagle_overlap.adapters.v0_5_23.build_grammar_vocab_mask import build_grammar_vocab_mask_around

    grammar_tree.capture_original()
    t = torch.zeros((1, 2), dtype=torch.int64)
    sentinel = object()
    theirs = GrammarTree.from_host(t, t, t)
    assert build_grammar_vocab_mask_around(lambda **k: sentinel, reqs=[], tree=theirs, sampling_info=None,
                                           device="cpu", barrier=None) is sentinel
    active_state.active = False
    tree = band.PluginGrammarTree.from_device(t, t, t)
    assert type(tree) is GrammarTree  # SGLang's own object while inactive
