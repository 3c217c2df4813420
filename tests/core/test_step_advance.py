"""``GrammarStep``'s exactly-once advance as the bands call it (written for the survivors of a mutation run
over ``core/step.py``, ``tests/core/MUTANTS.md``): ``feed_later`` outside a build (fed at once) and inside a
build's barrier (queued, fed by the build, a conflicting run re-anchored there), ``replay_whole`` (0.5.16's
post-processing), ``advance``'s ``on_feed``, and the warning of an abandoned step that failed."""

from __future__ import annotations

import logging
import random
from typing import Any, List

import pytest
import torch

from sglang_eagle_overlap.core import RowRun, Run
from sglang_eagle_overlap.core import GrammarStep, MaskRequest

from sglang_eagle_overlap.core.ledger import AcceptLedger
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.devices import result_runs
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.steps import feed_one, make_step, was_fed

VOCAB = 512
N = 4


def _step(thread: bool = True) -> GrammarStep:
    return make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=thread, native=native)


def _docs(k: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [list(G.doc_tokens("nested", rng, VOCAB)) for _ in range(k)]


def _tree(bs: int):
    """A chain tree per request (root -> 1 -> 2 -> 3) of token 0: only the build's mechanics matter here."""
    nxt = torch.tensor([[1, 2, 3, -1]] * bs, dtype=torch.int64)
    sib = torch.full((bs, N), -1, dtype=torch.int64)
    return nxt, sib, torch.zeros(bs, N, dtype=torch.int64)


def test_feed_later_outside_a_build_feeds_at_once_reports_and_counts_replays_when_asked():
    docs = _docs(3)
    runs = [d[:2] for d in docs]
    grammars = [object() for _ in docs]
    ms = [G.matcher("nested", VOCAB) for _ in docs]
    twins = [G.matcher("nested", VOCAB) for _ in docs]
    want = AcceptLedger().feed([Run(f"r{i}", grammars[i], twins[i], 0, runs[i]) for i in range(3)])
    step = _step()
    try:
        told: List[Any] = []
        seen: List[Any] = []
        rows = [RowRun(f"r{i}", grammars[i], ms[i], 0, i) for i in range(3)]
        step.feed_later(rows, result_runs(runs), told.append, lambda g, o: seen.append((g, o)))
        assert told == [want] and seen == list(zip(grammars, want))
        step.feed_later(rows[:2], result_runs(runs[:2]), told.append)  # asked again: replays, not counted
        assert told[1] == want[:2] and step.telemetry.stats.counters["replays"] == 0 and step.ledger.tokens_fed == 6
        step.feed_later(rows[:2], result_runs(runs[:2]), told.append, count_replays=True)
        assert told[2] == want[:2] and step.telemetry.stats.counters["replays"] == 2
    finally:
        step.close()


@pytest.mark.parametrize("threaded", [True, False], ids=["grammar-thread", "inline"])
def test_a_conflicting_run_in_a_barrier_is_re_anchored_fed_from_its_start_and_reported(threaded, caplog):
    """The host rolled a request back and commits other tokens at a position the ledger fed already: inside a
    build's barrier the run is re-anchored (counted, logged) and fed from that position into the matcher it names,
    with ``on_feed`` told the request's own grammar; the other rows are fed as usual; the caller gets every outcome
    when the build is joined, and a replay in the same call is counted when asked."""
    docs = _docs(3, seed=1)
    g = [object() for _ in docs]
    old = [G.matcher("nested", VOCAB) for _ in docs]
    step = _step(threaded)
    try:
        step.feed([Run(f"r{i}", g[i], old[i], 0, docs[i][:1]) for i in range(3)])
        # r0: the host rolled it back to 0 and commits 2 other tokens there (a fresh matcher stands for the rollback);
        # r1: the same run again (a replay); r2: its next run
        fresh = G.matcher("nested", VOCAB)
        other = docs[0][:2]  # at position 0, where the ledger fed docs[0][:1]: a conflict
        runs = [other, docs[1][:1], docs[2][1:3]]
        rows = [RowRun("r0", g[0], fresh, 0, 0), RowRun("r1", g[1], old[1], 0, 1), RowRun("r2", g[2], old[2], 1, 2)]
        told: List[Any] = []
        seen: List[Any] = []
        nxt, sib, tok = _tree(3)
        reqs = [MaskRequest(matcher=m) for m in (fresh, old[1], old[2])]
        barrier = lambda: step.feed_later(rows, result_runs(runs), told.append,  # noqa: E731
                                             lambda gr, o: seen.append((gr, o)), count_replays=True)
        with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
            if threaded:
                job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, barrier=barrier)
                step.finish_build(job, device="cpu")
            else:
                step.build_mask(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, device="cpu", barrier=barrier)
        assert len(told) == 1
        o0, o1, o2 = told[0]
        assert (o0.start, o0.retained, o0.error) == (0, tuple(other), None)
        assert (o1.start, o1.retained) == (0, tuple(docs[1][:1])) and (o2.start, o2.retained) == (1, tuple(docs[2][1:3]))
        assert step.ledger.consumed("r0") == len(other) and step.ledger.consumed("r2") == 3
        assert step.telemetry.stats.counters["ledger_resets"] == 1 and step.telemetry.stats.counters["replays"] == 1
        assert step.telemetry.stats.counters["thread_steps"] == (1 if threaded else 0)
        assert "re-anchoring grammar ledger of request r0 at position 0" in caplog.text
        assert sorted((g.index(gr), o.start) for gr, o in seen) == [(0, 0), (2, 1)]
        twin = G.matcher("nested", VOCAB)
        for t in other:
            assert twin.accept_token(t)
        assert torch.equal(G.next_token_bitmask(fresh, VOCAB), G.next_token_bitmask(twin, VOCAB))
    finally:
        step.close()


def test_replay_kept_answers_only_a_whole_clean_run_asked_with_the_same_tokens():
    docs = _docs(2, seed=2)
    m = G.matcher("nested", VOCAB)
    g = object()
    step = _step()
    try:
        assert step.replay_whole("a", 0, docs[0][:2]) is None  # never fed
        feed_one(step, "a", g, 0, docs[0][:2], m)
        assert step.replay_whole("a", 0, docs[0][:2]) == docs[0][:2] and step.telemetry.stats.counters["replays"] == 1
        assert step.replay_whole("a", 0, torch.tensor(docs[0][:2])) == docs[0][:2]  # tensor ints compare as ints
        assert step.replay_whole("a", 0, docs[0][:1]) is None and step.telemetry.stats.counters["replays"] == 2
        bad = next(t for t in range(VOCAB) if not G.matcher("nested", VOCAB, docs[0][:3]).accept_token(t))
        out = feed_one(step, "a", g, 2, [docs[0][2], bad], m)
        assert out.error is not None and step.replay_whole("a", 2, [docs[0][2], bad]) is None  # cut by a rejection
        assert step.replay("a", 2, [docs[0][2], bad]) == out and step.telemetry.stats.counters["replays"] == 3
        assert step.replay("a", 0, docs[0][:1]) is None and step.replay("zz", 0, [1]) is None
        doc = docs[1]
        ended = feed_one(step, "t", object(), 0, doc + [doc[0]], G.matcher("nested", VOCAB))  # past the grammar's end
        assert ended.terminated and ended.error is None and ended.retained == tuple(doc)
        assert step.replay_whole("t", 0, doc + [doc[0]]) is None and step.telemetry.stats.counters["replays"] == 3
    finally:
        step.close()


def test_feed_reports_a_fresh_feed_to_on_feed():
    doc = _docs(1, seed=3)[0]
    g = object()
    seen: List[Any] = []
    step = _step()
    try:
        out = feed_one(step, "a", g, 0, doc[:2], G.matcher("nested", VOCAB), lambda gr, o: seen.append((gr, o)))
        assert seen == [(g, out)] and out.retained == tuple(doc[:2])
    finally:
        step.close()


def test_an_abandoned_step_that_fails_is_logged_once_and_its_runs_are_recorded(monkeypatch, caplog):
    """A verify raised after ``start_build``, and finishing its job fails too: the next use of the step logs the
    failure once (type and message), the queued runs are recorded exactly once and their caller told, and the step
    goes on without another warning."""
    docs = _docs(2, seed=4)
    g = [object(), object()]
    ms = [G.matcher("nested", VOCAB) for _ in docs]
    step = _step(True)
    told: List[Any] = []
    try:
        nxt, sib, tok = _tree(2)
        reqs = [MaskRequest(matcher=m) for m in ms]
        rows = [RowRun(f"r{i}", g[i], ms[i], 0, i) for i in range(2)]
        step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB,
                         barrier=lambda: step.feed_later(rows, result_runs([d[:2] for d in docs]), told.append))
        builder = step.builder
        real = builder.finish

        def broken(*args: Any, **kw: Any) -> Any:
            monkeypatch.setattr(builder, "finish", real)
            raise RuntimeError("boom")

        monkeypatch.setattr(builder, "finish", broken)
        with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
            assert step.replay_whole("r1", 0, docs[1][:2]) == docs[1][:2]  # settles the open job first
            assert was_fed(step, "r0", 0)
        assert [r.getMessage() for r in caplog.records] == [
            "sglang-eagle-overlap: an abandoned grammar step failed: RuntimeError: boom"]
        assert len(told) == 1 and step.ledger.tokens_fed == 4
        # a second abandoned job (it finishes cleanly when settled), settled by ``replay``
        rows2 = [RowRun(f"r{i}", g[i], ms[i], 2, i) for i in range(2)]
        step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB,
                         barrier=lambda: step.feed_later(rows2, result_runs([d[2:3] for d in docs]), told.append))
        out = step.replay("r0", 2, docs[0][2:3])
        assert out is not None and out.retained == tuple(docs[0][2:3]) and len(told) == 2
        assert step.ledger.tokens_fed == 6 and len(caplog.records) == 1
    finally:
        step.close()


@pytest.mark.parametrize("allow", [True, False])
def test_the_grammar_thread_build_keeps_the_callers_time_limit_choice(allow):
    """``allow_timeout=False`` (a caller that cannot neutralise drafts) builds without the time limit on the grammar
    thread's path too."""
    ms = [G.matcher("nested", VOCAB) for _ in range(2)]
    step = make_step(mask_threads=1, mask_time_limit_s=0.5, grammar_thread=True, native=native)
    try:
        nxt, sib, tok = _tree(2)
        job = step.start_build([MaskRequest(matcher=m) for m in ms], step.copy_tree(nxt, sib, tok), vocab_size=VOCAB,
                               allow_timeout=allow)
        assert job.future is not None and job.build is not None
        assert job.build.limit == (0.5 if allow else None)
        step.finish_build(job, device="cpu")
    finally:
        step.close()


@pytest.mark.parametrize("threaded", [True, False], ids=["grammar-thread", "inline"])
def test_the_mask_is_built_after_the_barriers_runs_are_fed(threaded):
    """Each request's root row is the mask of its grammar *after* the previous step's run: the barrier's runs are fed
    before the walk, in the same native call (both paths). Checked against twin matchers, with the stale state
    (before the run) shown to differ for some request, so that feeding after the walk cannot pass."""
    rng = random.Random(7)
    docs = _docs(6, seed=7)
    cuts = [rng.randrange(1, len(d) - 4) for d in docs]
    runs = [d[c : c + 2] for d, c in zip(docs, cuts)]
    ms = [G.matcher("nested", VOCAB, d[:c]) for d, c in zip(docs, cuts)]
    step = _step(threaded)
    try:
        # the module is loaded with the builder, at the first build: loaded here, as in every step after the first
        # (without it the ledger feeds the barrier's runs in Python at once, before any walk)
        assert step.builder.native is not None and step.ledger.native is not None
        nxt, sib, _ = _tree(len(docs))
        tok = torch.tensor([d[c + 2 : c + 2 + N] + [0] * (N - len(d[c + 2 : c + 2 + N])) for d, c in zip(docs, cuts)],
                           dtype=torch.int64)
        rows = [RowRun(f"r{i}", object(), ms[i], c, i) for i, c in enumerate(cuts)]
        reqs = [MaskRequest(matcher=m) for m in ms]
        barrier = lambda: step.feed_later(rows, result_runs(runs), lambda o: None)  # noqa: E731
        if threaded:
            job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, barrier=barrier)
            mask = step.finish_build(job, device="cpu").device_mask.clone()
        else:
            mask = step.build_mask(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, device="cpu",
                                   barrier=barrier).device_mask.clone()
        after = [G.next_token_bitmask(G.matcher("nested", VOCAB, d[: c + 2]), VOCAB) for d, c in zip(docs, cuts)]
        before = [G.next_token_bitmask(G.matcher("nested", VOCAB, d[:c]), VOCAB) for d, c in zip(docs, cuts)]
        assert any(not torch.equal(a, b) for a, b in zip(after, before))
        for i, a in enumerate(after):
            assert torch.equal(mask[i * N].reshape(a.shape), a), f"request {i}"
    finally:
        step.close()


@pytest.mark.parametrize("threaded", [True, False], ids=["grammar-thread", "inline"])
def test_a_barrier_whose_caller_waits_for_no_outcome_still_feeds_and_records_each_run_once(threaded):
    """``feed_later(..., on_done=None)`` (0.5.16's barrier: post-processing asks again): the build feeds the runs
    and the ledger records them, so the later ask is a replay that feeds nothing, and the matchers are where one feed
    leaves them."""
    docs = _docs(3, seed=3)
    runs = [d[:3] for d in docs]
    ms = [G.matcher("nested", VOCAB) for _ in docs]
    grammars = [object() for _ in docs]
    rows = [RowRun(f"r{i}", grammars[i], ms[i], 0, i) for i in range(3)]
    step = _step(threaded)
    try:
        nxt, sib, tok = _tree(3)
        reqs = [MaskRequest(matcher=m) for m in ms]
        barrier = lambda: step.feed_later(rows, result_runs(runs), None)  # noqa: E731
        job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, barrier=barrier)
        assert (job.future is not None) == threaded
        step.finish_build(job, device="cpu")
        assert step.ledger.tokens_fed == 9
        for i, run in enumerate(runs):
            assert step.ledger.outcome(f"r{i}", 0).retained == tuple(run)
        told: List[Any] = []
        step.feed_later(rows, result_runs(runs), told.append, count_replays=True)  # post-processing's ask
        assert [o.retained for o in told[0]] == [tuple(r) for r in runs]
        assert step.ledger.tokens_fed == 9 and step.telemetry.stats.counters["replays"] == 3
        for i, d in enumerate(docs):
            want = G.next_token_bitmask(G.matcher("nested", VOCAB, d[:3]), VOCAB)
            assert torch.equal(G.next_token_bitmask(ms[i], VOCAB), want), f"request {i} fed other than once"
    finally:
        step.close()


def test_forced_continuations_are_recorded_by_a_verify_build_and_not_by_build_mask():
    """With forced drafts on, ``start_build`` / ``finish_build`` (an EAGLE verify: the native call on the grammar
    thread asks every filled node's forced text) record the valid nodes' grammar-forced continuations; ``build_mask``
    (chain algorithms, host-built trees, which never take them) records none."""
    from sglang_eagle_overlap.core.forced import ForcedDrafts
    from sglang_eo_dev.helpers.tokenizers import hf_tokenizer

    tokenizer = hf_tokenizer(VOCAB)
    forced = ForcedDrafts()
    forced.encode = lambda s: tokenizer.encode(s, add_special_tokens=False)
    docs = _docs(8, seed=8)
    rng = random.Random(8)
    cuts = [rng.randrange(1, len(d) - N - 1) for d in docs]
    step = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=True, native=native, forced=forced)
    try:
        def build(verify: bool) -> None:
            ms = [G.matcher("nested", VOCAB, d[:c]) for d, c in zip(docs, cuts)]
            nxt, sib, _ = _tree(len(docs))
            tok = torch.tensor([[0] + d[c : c + N - 1] for d, c in zip(docs, cuts)], dtype=torch.int64)
            reqs = [MaskRequest(matcher=m) for m in ms]
            if verify:
                job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB)
                assert job.future is not None  # forced drafts do not keep the build off the grammar thread
                step.finish_build(job, device="cpu")
            else:
                step.build_mask(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, device="cpu")

        assert step.forced is not None
        build(True)
        recorded = step.forced.recorded_nodes
        assert recorded > 0
        build(False)
        assert step.forced.recorded_nodes == recorded
    finally:
        step.close()


def test_a_conflict_re_anchored_by_feed_is_reported_to_on_feed():
    doc = _docs(1, seed=9)[0]
    g = object()
    step = _step()
    try:
        step.feed([Run("a", g, G.matcher("nested", VOCAB), 0, doc[:1])])
        seen: List[Any] = []
        out = step.feed([Run("a", g, G.matcher("nested", VOCAB), 0, doc[:2])], lambda gr, o: seen.append((gr, o)))
        assert out[0].retained == tuple(doc[:2]) and seen == [(g, out[0])]
        assert step.telemetry.stats.counters["ledger_resets"] == 1
    finally:
        step.close()


def test_an_inline_native_walk_that_is_refused_falls_back_with_the_reason_and_the_same_mask(monkeypatch, caplog):
    """Inline (no grammar thread): the step's native call raises before touching anything; the build feeds the runs
    and walks in Python -- the mask of a step whose call went through, the refusal's reason in the warning."""
    from sglang_eagle_overlap.core.native import NativeGrammar

    docs = _docs(4, seed=10)
    rng = random.Random(10)
    cuts = [rng.randrange(1, len(d) - N - 3) for d in docs]
    runs = [d[c : c + 2] for d, c in zip(docs, cuts)]

    def one_step(step: GrammarStep) -> torch.Tensor:
        assert step.builder.native is not None
        ms = [G.matcher("nested", VOCAB, d[:c]) for d, c in zip(docs, cuts)]
        nxt, sib, _ = _tree(len(docs))
        tok = torch.tensor([[0] + d[c + 2 : c + 1 + N] for d, c in zip(docs, cuts)], dtype=torch.int64)
        rows = [RowRun(f"r{i}", object(), ms[i], c, i) for i, c in enumerate(cuts)]
        return step.build_mask([MaskRequest(matcher=m) for m in ms], step.copy_tree(nxt, sib, tok), vocab_size=VOCAB,
                               device="cpu", barrier=lambda: step.feed_later(rows, result_runs(runs), lambda o: None)
                               ).device_mask.clone()

    ok = _step(False)
    refused = _step(False)
    try:
        want = one_step(ok)

        real = NativeGrammar.step_call

        def refuse_once(self: Any, *a: Any, **k: Any) -> Any:  # the step's call; the ledger's own feed then goes
            monkeypatch.setattr(NativeGrammar, "step_call", real)

            def call() -> Any:
                raise ValueError("refused here")

            return call

        monkeypatch.setattr(NativeGrammar, "step_call", refuse_once)
        with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap"):
            got = one_step(refused)
        assert torch.equal(got, want)
        assert "native tree mask build failed (ValueError: refused here); rebuilding request by request" in caplog.text
        assert refused.ledger.tokens_fed == ok.ledger.tokens_fed == sum(len(r) for r in runs)
    finally:
        ok.close()
        refused.close()


def test_drafts_of_timed_out_requests_are_neutralised_on_the_grammar_threads_path():
    """A build that runs out of its time limit on the grammar thread: the requests it timed out keep only their root
    row, and their drafts in the sampler's tensor are neutralised (the tree's node count comes from the job)."""
    docs = _docs(6, seed=11)
    ms = [G.matcher("nested", VOCAB, d[:1]) for d in docs]
    step = make_step(mask_threads=1, mask_time_limit_s=1e-9, grammar_thread=True, native=native)
    try:
        nxt, sib, _ = _tree(len(docs))
        tok = torch.tensor([d[1 : 1 + N] for d in docs], dtype=torch.int64)
        draft = tok.clone().reshape(-1)
        job = step.start_build([MaskRequest(matcher=m) for m in ms], step.copy_tree(nxt, sib, tok), vocab_size=VOCAB)
        assert job.future is not None
        out = step.finish_build(job, device="cpu", draft_device=draft)
        timed_out = out.tree.timed_out
        assert timed_out, "a 1 ns limit times some request out"
        for i in range(len(docs)):
            kept = draft[i * N + 1 : (i + 1) * N]
            if i in timed_out:
                assert not torch.equal(kept, tok[i, 1:]), f"request {i} kept its drafts"
            else:
                assert torch.equal(kept, tok[i, 1:])
    finally:
        step.close()
