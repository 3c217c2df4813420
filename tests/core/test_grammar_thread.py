"""The grammar thread: ``GrammarStep.start_build`` runs the barrier on the calling (scheduler) thread -- the
ledger checks the previous result's runs and queues them by row, without reading their tokens -- prepares the build,
and hands the step's one native call (those runs fed, then the tree walked) to one helper thread; ``finish_build``
joins it, records the feeds and finishes the mask. It must produce exactly the inline path's mask and matcher states,
feed every run exactly once whatever happens in between, keep the helper out of the host's Python objects, and fall
back to the inline work where the native call does not apply.

Real xgrammar matchers and the plugin's native module; random draft trees (``sglang_eo_dev.helpers.trees``)::

    root ── a ── b          request i: nodes 0..n-1, first child = the true continuation,
       └─── c               side nodes grammar-valid with p=0.5
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from sglang_eagle_overlap.core import GrammarStep, MaskRequest, RowRun
from sglang_eagle_overlap.core.ledger import ResultRuns
from sglang_eagle_overlap.core.native import NativeGrammar
from sglang_eagle_overlap.core.timeline import Timeline
from sglang_eo_dev.helpers.grammars import doc_tokens, matcher, next_token_bitmask
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.trees import eagle_tree
from sglang_eo_dev.helpers.steps import make_step

VOCAB = 512
N = 8


def _spec(seed: int, bs: int):
    """Per request: id, the prefix already in its matcher, the run the previous step accepted, the rest."""
    rng = random.Random(seed)
    out = []
    for i in range(bs):
        doc = list(doc_tokens("nested", rng, VOCAB))
        cut = rng.randrange(1, max(2, len(doc) - 6))
        k = rng.randint(1, 3)
        out.append((f"r{i}", doc[:cut], doc[cut:cut + k], doc[cut + k:]))
    return out


class World:
    """One batch, its verify tree and the previous step's result (a ``[bs * N]`` token tensor with accept lengths, as
    SGLang's), with fresh matchers per copy so that two steps can start from equal states."""

    def __init__(self, seed: int, bs: int = 6) -> None:
        self.spec = _spec(seed, bs)
        rng = random.Random(seed + 1)
        trees = [eagle_tree(rng, 4, 3, N, truth, VOCAB, matcher=matcher("nested", VOCAB, prefix + run))
                 for _, prefix, run, truth in self.spec]
        self.nxt = torch.tensor([t.nxt for t in trees], dtype=torch.int64)
        self.sib = torch.tensor([t.sib for t in trees], dtype=torch.int64)
        self.tok = torch.tensor([t.tok for t in trees], dtype=torch.int64)
        ids = torch.zeros(bs * N, dtype=torch.int64)
        for i, (_, _, run, _) in enumerate(self.spec):
            ids[i * N : i * N + len(run)] = torch.tensor(run)
        self.ids = ids
        self.lens = torch.tensor([len(run) for _, _, run, _ in self.spec], dtype=torch.int32)

    def matchers(self):
        return [matcher("nested", VOCAB, prefix) for _, prefix, _, _ in self.spec]

    def result(self) -> ResultRuns:
        return ResultRuns(self.ids, self.lens, N)

    def rows(self, matchers, grammars):
        return [RowRun(rid, grammars[i], matchers[i], len(prefix), i) for i, (rid, prefix, _, _) in enumerate(self.spec)]


def _step(thread: bool, **kw) -> GrammarStep:
    return make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=thread, native=native, **kw)


def _run(step: GrammarStep, w: World, ms, threaded: bool, *, between=None, result=None):
    """One verify step through the public API. Returns (mask copy, the barrier's thread ids, the outcomes handed to
    the barrier's caller, the StepMask)."""
    grammars = [object() for _ in ms]  # the host's grammar objects around the matchers
    barrier_threads, outcomes = [], []
    result = result if result is not None else w.result()

    def barrier():
        barrier_threads.append(threading.get_ident())
        step.feed_later(w.rows(ms, grammars), result, outcomes.append)

    requests = [MaskRequest(matcher=m, request_id=rid) for m, (rid, *_) in zip(ms, w.spec)]
    pending = step.copy_tree(w.nxt, w.sib, w.tok)
    draft = w.tok.clone().reshape(-1)
    if threaded:
        job = step.start_build(requests, pending, vocab_size=VOCAB, barrier=barrier, allow_timeout=True)
        if between is not None:
            between(job)
        out = step.finish_build(job, device="cpu", draft_device=draft)
    else:
        out = step.build_mask(requests, pending, vocab_size=VOCAB, device="cpu", barrier=barrier,
                              draft_device=draft)
    return out.device_mask.clone(), barrier_threads, outcomes, out


def _record_native_calls(monkeypatch) -> list:
    """The ids of the threads that make each native step call from now on, in call order."""
    calls: list = []
    orig = NativeGrammar.step_call

    def step_call(self, *a, **k):
        call = orig(self, *a, **k)

        def recorded():
            calls.append(threading.get_ident())
            return call()

        return recorded

    monkeypatch.setattr(NativeGrammar, "step_call", step_call)
    return calls


def _states(ms):
    return [(next_token_bitmask(m, VOCAB), m.is_terminated()) for m in ms]


def _same_states(a, b) -> bool:
    return all(torch.equal(x[0], y[0]) and x[1] == y[1] for x, y in zip(_states(a), _states(b)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threaded_mask_is_the_inline_mask_the_barrier_on_the_caller_the_native_call_on_the_helper(seed, monkeypatch):
    w = World(seed)
    calls = _record_native_calls(monkeypatch)  # threads that made a native call
    inline_step, thread_step = _step(False), _step(True)
    try:
        m_in, m_th = w.matchers(), w.matchers()
        mask_in, th_in, out_in, _ = _run(inline_step, w, m_in, threaded=False)
        mask_th, th_th, out_th, res = _run(thread_step, w, m_th, threaded=True)
        assert torch.equal(mask_in, mask_th)
        assert (mask_th != -1).any(), "no row was constrained: the comparison would be vacuous"
        me = threading.get_ident()
        assert th_in == [me] and th_th == [me]  # the barrier ran on the caller, once, both ways
        assert len(calls) == 2 and calls[0] == me and calls[1] != me  # inline here; threaded on the helper
        assert out_in == out_th and [len(o) for o in out_th] == [len(w.spec)]  # the caller told once, same outcomes
        assert [o.retained for o in out_th[0]] == [tuple(run) for _, _, run, _ in w.spec]
        assert _same_states(m_in, m_th)  # every run fed exactly once on both paths
        assert thread_step.ledger.tokens_fed == inline_step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec)
        assert thread_step.builder.native_walks == 1
        s = thread_step.telemetry.stats
        assert s.steps == 1 and thread_step.telemetry.snapshot()["grammar_thread"] is True
        assert s.sched_s > 0 and s.join_wait_s <= s.sched_s
    finally:
        thread_step.close()


@pytest.mark.parametrize("bs, min_batch, helper", [(1, 2, False), (2, 2, True), (3, 4, False), (1, 1, True)])
def test_a_batch_below_the_min_batch_runs_inline_with_the_same_mask_and_feeds(bs, min_batch, helper, monkeypatch):
    """``grammar_thread_min_batch``: a verify batch of fewer grammar requests makes its native call on the scheduler
    thread (counted as ``small_batch_inline_steps``), one of at least that many on the helper; either way the mask,
    the outcomes and the exactly-once feeds are the inline path's."""
    w = World(5, bs=bs)
    calls = _record_native_calls(monkeypatch)
    inline_step, step = _step(False), _step(True, grammar_thread_min_batch=min_batch)
    try:
        m_in, m_th = w.matchers(), w.matchers()
        mask_in, _, out_in, _ = _run(inline_step, w, m_in, threaded=False)
        mask_th, _, out_th, _ = _run(step, w, m_th, threaded=True)
        assert torch.equal(mask_in, mask_th) and (mask_th != -1).any()
        assert out_in == out_th and _same_states(m_in, m_th)
        assert step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec)
        me = threading.get_ident()
        assert len(calls) == 2 and calls[0] == me and (calls[1] != me) is helper
        counters = step.telemetry.stats.counters
        assert counters.get("thread_steps", 0) == int(helper)
        assert counters.get("small_batch_inline_steps", 0) == int(not helper)
    finally:
        step.close()


def test_the_runs_are_queued_at_start_and_fed_by_the_helper_not_before():
    """Between start_build and the join nothing has been recorded in the ledger (the scheduler thread launches the
    verify there), the result's tokens are never read as Python lists (the native call hands back what it read), and
    after the join every run is recorded."""
    w = World(3)
    step = _step(True)
    seen = {}

    def between(job):
        job.future._done.acquire()  # the helper's call is done ...
        job.future._done.release()
        seen["recorded"] = step.ledger.tokens_fed  # ... but the scheduler thread records it only at the join
        seen["open"] = step._open is job

    try:
        ms = w.matchers()
        result = w.result()

        def listed_before_join(job):
            seen["listed"] = result._ids is not None  # the runs' tokens as Python lists: not before the join
            between(job)

        _, _, outcomes, _ = _run(step, w, ms, threaded=True, between=listed_before_join, result=result)
        assert seen == {"listed": False, "recorded": 0, "open": True}
        assert step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec) and step._open is None
        # the join booked the outcomes from the native call's own reading of the runs (StepResult.run_tokens): the
        # result's tensors were never converted to lists, and every outcome holds the run's tokens
        assert result._ids is None
        assert [o.tokens for o in outcomes[0]] == [tuple(r) for _, _, r, _ in w.spec]
    finally:
        step.close()


def test_post_processing_after_the_join_replays_and_feeds_nothing():
    w = World(7, bs=4)
    step = _step(True)
    try:
        ms = w.matchers()
        _run(step, w, ms, threaded=True)
        fed = step.ledger.tokens_fed
        before = _states(ms)
        for i, (rid, prefix, run, _) in enumerate(w.spec):  # the host's post-processing asks again
            out = step.replay(rid, len(prefix), run)
            assert out is not None and out.retained == tuple(run)
        assert step.ledger.tokens_fed == fed and step.telemetry.stats.counters["replays"] == len(w.spec)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(before, _states(ms)))
    finally:
        step.close()


def test_an_abandoned_job_is_settled_before_the_ledger_is_used_again():
    """A verify that raised between start_build and finish_build leaves its job open: the next use of the step
    joins it first, records its runs exactly once and tells their caller; its mask is dropped."""
    w = World(4, bs=3)
    step = _step(True)
    grammars = [object() for _ in w.spec]
    outcomes = []
    try:
        ms = w.matchers()
        reqs = [MaskRequest(matcher=m) for m in ms]
        step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB,
                         barrier=lambda: step.feed_later(w.rows(ms, grammars), w.result(), outcomes.append))
        assert outcomes == [] and step._open is not None  # no finish_build: the verify "raised"
        job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB)
        assert len(outcomes) == 1 and [o.retained for o in outcomes[0]] == [tuple(r) for _, _, r, _ in w.spec]
        step.finish_build(job, device="cpu")
        assert step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec)
        for (rid, prefix, run, _), m in zip(w.spec, ms):  # each run in the matcher once: its next true token fits
            assert step.ledger.consumed(rid) == len(prefix) + len(run)
        other = World(4, bs=3).matchers()
        for (rid, prefix, run, _), m in zip(w.spec, other):
            for t in run:
                assert m.accept_token(t)
        assert _same_states(ms, other)
    finally:
        step.close()


@pytest.mark.parametrize("threaded", [True, False], ids=["grammar-thread", "inline"])
def test_a_tree_copy_that_fails_fails_the_step_and_its_queued_runs_are_still_fed_once(threaded, monkeypatch):
    """The verify tree's host copy raises after the barrier queued the previous result's runs (inline: before the
    build starts; grammar thread: on the helper, before its native call): the step raises, and every queued run has
    still been fed exactly once and handed to the barrier's caller, so the next step starts from the right states."""
    from sglang_eagle_overlap.core.tree_copy import PendingTree

    w = World(9, bs=3)
    step = _step(threaded)
    grammars = [object() for _ in w.spec]
    outcomes = []
    original = PendingTree.resolve
    broken = []

    def resolve(self):
        if any(self is b for b in broken):
            raise RuntimeError("tree copy failed")
        return original(self)

    monkeypatch.setattr(PendingTree, "resolve", resolve)
    try:
        ms = w.matchers()
        reqs = [MaskRequest(matcher=m) for m in ms]
        pending = step.copy_tree(w.nxt, w.sib, w.tok)
        broken.append(pending)
        job = step.start_build(reqs, pending, vocab_size=VOCAB,
                               barrier=lambda: step.feed_later(w.rows(ms, grammars), w.result(), outcomes.append))
        with pytest.raises(RuntimeError, match="tree copy failed"):
            step.finish_build(job, device="cpu")
        assert len(outcomes) == 1 and [o.retained for o in outcomes[0]] == [tuple(r) for _, _, r, _ in w.spec]
        assert step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec)
        other = World(9, bs=3).matchers()
        for (_, _, run, _), m in zip(w.spec, other):
            for t in run:
                assert m.accept_token(t)
        assert _same_states(ms, other)  # fed once: not zero times, not twice
        job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB)
        assert step.finish_build(job, device="cpu").device_mask is not None  # the step stays usable
    finally:
        step.close()


def test_a_barrier_error_is_raised_at_start_and_the_step_stays_usable():
    w = World(5, bs=2)
    step = _step(True)

    def broken():
        raise RuntimeError("barrier broke")

    try:
        ms = w.matchers()
        reqs = [MaskRequest(matcher=m) for m in ms]
        with pytest.raises(RuntimeError, match="barrier broke"):
            step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB, barrier=broken)
        job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB)
        assert step.finish_build(job, device="cpu").device_mask is not None
        assert step.ledger.tokens_fed == 0
    finally:
        step.close()


def test_a_refused_native_call_falls_back_to_python_at_the_join(monkeypatch, caplog):
    """The helper's call raises before touching anything (the module refused it): finish_build feeds the queued runs
    itself and walks in Python -- the same mask, every run fed once."""
    w = World(6)
    want_ms = w.matchers()
    want, _, want_out, _ = _run(_step(False), w, want_ms, threaded=False)

    def refused(self, *a, **k):
        def call():
            raise ValueError("refused")

        return call

    step = _step(True)
    try:
        orig = NativeGrammar.step_call
        ms = w.matchers()
        calls = []

        def first_refused(self, *a, **k):
            calls.append(1)
            return (refused if len(calls) == 1 else orig)(self, *a, **k)

        monkeypatch.setattr(NativeGrammar, "step_call", first_refused)
        got, _, got_out, _ = _run(step, w, ms, threaded=True)
        assert torch.equal(got, want) and got_out == want_out and _same_states(ms, want_ms)
        assert any("native tree mask build failed (ValueError: refused); rebuilding request by request"
                   in r.getMessage() for r in caplog.records)  # the helper's own exception, handed back
    finally:
        step.close()


def test_without_the_native_call_the_work_runs_inline_at_finish():
    """The grammar thread takes only the native call: without it (no module) start_build only records the job,
    and the barrier runs in finish_build on the caller."""
    w = World(8, bs=3)
    step = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=True, native=None)
    order = []
    try:
        ms = w.matchers()
        grammars = [object() for _ in ms]
        reqs = [MaskRequest(matcher=m) for m in ms]

        def barrier():
            order.append("barrier")
            step.feed_later(w.rows(ms, grammars), w.result(), lambda o: order.append("told"))

        job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB, barrier=barrier)
        assert job.future is None and order == []
        order.append("finish")
        step.finish_build(job, device="cpu")
        assert order == ["finish", "barrier", "told"]
        assert step.ledger.tokens_fed == sum(len(r) for _, _, r, _ in w.spec)
    finally:
        step.close()


def test_forced_drafts_run_on_the_grammar_thread_with_the_python_walks_table(monkeypatch):
    """With forced drafts on, the step's native call (forced texts included) runs on the grammar thread; its mask,
    matcher states and forced table equal an inline step's without the native module (the Python walk, the
    reference), bonus keys included."""
    from sglang_eagle_overlap.core.forced import ForcedDrafts
    from sglang_eo_dev.helpers.tokenizers import hf_tokenizer

    tokenizer = hf_tokenizer(VOCAB)

    def forced() -> ForcedDrafts:
        f = ForcedDrafts()
        f.encode = lambda s: tokenizer.encode(s, add_special_tokens=False)
        f.decode = tokenizer.decode
        f._key_counts = {tokenizer.encode(t, add_special_tokens=False)[0]: 1 for t in ('"', '",')}
        return f

    w = World(3)
    calls = _record_native_calls(monkeypatch)
    ref = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=False, native=None, forced=forced())
    thr = _step(True, forced=forced())
    try:
        m_ref, m_thr = w.matchers(), w.matchers()
        # both through start_build / finish_build (a verify: the path that records forced drafts); the reference
        # has no native module, so its work runs inline there
        mask_ref, _, out_ref, _ = _run(ref, w, m_ref, threaded=True)
        mask_thr, _, out_thr, _ = _run(thr, w, m_thr, threaded=True)
        assert calls and threading.get_ident() not in calls  # the native call ran, on the grammar thread
        assert torch.equal(mask_thr, mask_ref) and out_thr == out_ref and _same_states(m_thr, m_ref)
        assert ref.forced is not None and thr.forced is not None
        assert ref.forced.recorded_nodes > 0 and thr.forced.recorded_nodes == ref.forced.recorded_nodes
        ref.forced.upload("cpu")
        thr.forced.upload("cpu")
        assert torch.equal(thr.forced._table, ref.forced._table)
    finally:
        ref.close()
        thr.close()


class _Exporter:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe_step(self, grammar_s, unhidden_s, timeouts, *, forced_proposed=0, forced_accepted=0) -> None:
        self.calls.append((grammar_s, unhidden_s, timeouts, forced_proposed, forced_accepted))


@pytest.mark.parametrize("threaded", [False, True])
def test_finish_build_reports_what_ran_where(threaded, tmp_path):
    """The step's own account: stats (scheduler-thread time, join wait only when joined), the exporter's per-step
    call with the forced-draft deltas, and the timeline's spans in order on the right batch size."""
    w = World(5)
    tl = Timeline(str(tmp_path / "timeline.json"))
    exporter = _Exporter()
    step = _step(threaded, timeline=tl, exporter=exporter)
    step._forced_delta = lambda: (3, 2)  # what the forced-draft counters moved by since the last step
    try:
        mask, _, _, out = _run(step, w, w.matchers(), threaded=threaded)
    finally:
        step.close()
    s = step.telemetry.stats
    assert s.steps == 1 and s.mask_timeouts == 0 and s.mask_s > 0 and s.advance_s > 0
    assert s.sched_s > 0 and (s.join_wait_s > 0) is threaded
    if not threaded:
        assert s.helper_gil_s == 0.0  # inline there is no helper: all of it is scheduler-thread work
    assert s.sched_s >= s.join_wait_s
    # the hand-off's latency: only a grammar thread has one; it is part of the tree wait (the helper stamps the end of
    # its device waits after it woke), and the snapshot reports it
    assert (s.handoff_s > 0) is threaded and s.handoff_s <= s.tree_wait_s
    assert step.telemetry.snapshot()["handoff_s"] == s.handoff_s
    ((grammar_s, unhidden_s, timeouts, fp, fa),) = exporter.calls
    assert grammar_s > 0 and unhidden_s == 0 and timeouts == 0 and (fp, fa) == (3, 2)
    first, *events = tl.events()
    assert first[0] == "tree_copy" and first[1] == first[2]  # copy_tree's point, before the build
    names = [e[0] for e in events]
    assert names == ["advance", "tree_wait", "mask_build"] + (["grammar_join"] if threaded else []) + [
        "mask_upload", "sample"]
    assert all(e[3] == len(w.spec) for e in events)  # every event carries the batch size
    spans = {e[0]: (e[1], e[2]) for e in events}
    for name, (a, b) in spans.items():
        assert a <= b, name
    assert spans["advance"][1] <= spans["tree_wait"][0] + 1e-9 and spans["tree_wait"][1] <= spans["mask_build"][0]
    upload_from = spans["grammar_join"][1] if threaded else spans["mask_build"][1]
    assert spans["mask_upload"][0] == upload_from and spans["sample"][0] == spans["mask_upload"][1]
    if threaded:  # the helper's call ended before the join did
        assert spans["mask_build"][1] <= spans["grammar_join"][1] <= spans["mask_upload"][0]
    assert torch.equal(mask, out.device_mask)


def test_the_barriers_python_runs_on_the_scheduler_thread_and_the_helper_takes_little_gil():
    """``helper_gil_s``: the grammar thread's CPU time outside its native call. The barrier's Python (here 30 ms of
    thread CPU time) now runs on the scheduler thread inside start_build, so it counts there, not as GIL time."""
    w = World(8, bs=2)

    def busy():
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass

    step = _step(True)
    try:
        ms = w.matchers()
        reqs = [MaskRequest(matcher=m) for m in ms]
        t0 = time.perf_counter()
        job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB, barrier=busy)
        start_s = time.perf_counter() - t0
        step.finish_build(job, device="cpu")
    finally:
        step.close()
    assert job.submit_s >= 0.03 - 1e-3 and start_s >= 0.03 - 1e-3
    assert job.gil_s < 0.03 and step.telemetry.stats.helper_gil_s == job.gil_s


class _ThreadClocks:
    """Stands in for ``core.step``'s ``time`` module: ``thread_time`` reads a CPU clock per thread that only the test
    moves (``spend``); every other function is the real one."""

    def __init__(self) -> None:
        self.cpu: dict = {}
        self.thread_time = lambda: self.cpu.get(threading.get_ident(), 0.0)

    def spend(self, seconds: float) -> None:
        me = threading.get_ident()
        self.cpu[me] = self.cpu.get(me, 0.0) + seconds

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_helper_gil_time_is_the_helpers_cpu_time_outside_its_native_call(monkeypatch):
    """``helper_gil_s``, the grammar thread's CPU time outside its GIL-free native call, on per-thread CPU clocks only
    the test moves. Per step the helper spends CPU in its tree wait (Python around the device waits: 0.25 s, then
    0.125 s) and 1.0 s in the native call; the barrier spends 0.5 s on the scheduler thread::

        scheduler: start_build [barrier 0.5] ......................... finish_build (join)
        helper:                  [tree wait 0.25 | native call 1.0 ]

    so each job's ``gil_s`` is its tree wait (0.25, 0.125) and the stats add them up (0.375): neither the native call
    nor the scheduler thread's barrier is the helper's GIL time."""
    from sglang_eagle_overlap.core import step as step_mod
    from sglang_eagle_overlap.core.tree_copy import PendingTree

    clocks = _ThreadClocks()
    monkeypatch.setattr(step_mod, "time", clocks)
    waits = iter([0.25, 0.125])
    original_resolve, original_call = PendingTree.resolve, NativeGrammar.step_call

    def resolve(self):
        if threading.current_thread().name.startswith("sglang-eo-grammar"):
            clocks.spend(next(waits))
        return original_resolve(self)

    def step_call(self, *a, **k):
        call = original_call(self, *a, **k)

        def timed():
            clocks.spend(1.0)
            return call()

        return timed

    monkeypatch.setattr(PendingTree, "resolve", resolve)
    monkeypatch.setattr(NativeGrammar, "step_call", step_call)
    w = World(8, bs=2)
    step = _step(True)
    jobs = []
    try:
        for _ in range(2):
            reqs = [MaskRequest(matcher=m) for m in w.matchers()]
            job = step.start_build(reqs, step.copy_tree(w.nxt, w.sib, w.tok), vocab_size=VOCAB,
                                   barrier=lambda: clocks.spend(0.5))
            assert job.future is not None  # the native call ran on the helper
            step.finish_build(job, device="cpu")
            jobs.append(job)
    finally:
        step.close()
    assert [j.gil_s for j in jobs] == [0.25, 0.125]
    assert step.telemetry.stats.helper_gil_s == 0.375 and step.telemetry.snapshot()["helper_gil_s"] == 0.375
