"""The grammar thread (issue 17): ``GrammarStep.start_build`` hands the barrier and the mask build to one helper thread
before the verify launch; ``finish_build`` joins it before sampling. It must produce exactly the inline path's mask,
keep the exactly-once advance, run its barrier off the calling thread, and never run two jobs at once.

Real xgrammar matchers, random draft trees (``sglang_eo_dev.helpers.trees``)::

    root ── a ── b          request i: nodes 0..n-1, first child = the true continuation,
       └─── c               side nodes grammar-valid with p=0.5
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from sglang_eagle_overlap.core import GrammarStep, MaskRequest
from sglang_eagle_overlap.core.forced import ALTERNATIVES, ForcedDrafts
from sglang_eagle_overlap.core.timeline import Timeline
from sglang_eo_dev.helpers.grammars import doc_tokens, matcher
from sglang_eo_dev.helpers.trees import eagle_tree

VOCAB = 512
N = 8


class Fed:
    """Wraps an xgrammar matcher as a ledger grammar and records the thread and tokens of every accept."""

    def __init__(self, m) -> None:
        self.m = m
        self.calls: list[tuple[int, int]] = []

    def accept_token(self, t: int) -> bool:
        self.calls.append((threading.get_ident(), t))
        return self.m.accept_token(t)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


def _batch_with_prefixes(seed: int, bs: int, grammar: str = "nested"):
    rng = random.Random(seed)
    out = []
    for i in range(bs):
        doc = doc_tokens(grammar, rng, VOCAB)
        cut = rng.randrange(1, max(2, len(doc) - 6))
        out.append((f"r{i}", list(doc[:cut]), list(doc[cut:cut + 2]), list(doc[cut + 2:])))
    return out


def _setup(seed: int, bs: int):
    """Two identical copies of one batch (fresh matchers each), so the inline and threaded runs start equal."""
    spec = _batch_with_prefixes(seed, bs)
    rng = random.Random(seed + 1)
    trees = []
    for rid, prefix, run, truth in spec:
        root = matcher("nested", VOCAB, prefix + run)
        trees.append(eagle_tree(rng, 4, 3, N, truth, VOCAB, matcher=root))
    nxt = torch.tensor([t.nxt for t in trees], dtype=torch.int64)
    sib = torch.tensor([t.sib for t in trees], dtype=torch.int64)
    tok = torch.tensor([t.tok for t in trees], dtype=torch.int64)

    def copy():
        grammars = {rid: Fed(matcher("nested", VOCAB, prefix)) for rid, prefix, run, truth in spec}
        return grammars

    return spec, nxt, sib, tok, copy


def _run(step: GrammarStep, spec, grammars, nxt, sib, tok, threaded: bool):
    """One verify step through the public API; returns (mask copy, barrier thread ids)."""
    barrier_threads: list[int] = []

    def barrier():
        barrier_threads.append(threading.get_ident())
        for rid, prefix, run, truth in spec:
            step.advance(rid, grammars[rid], len(prefix), run)

    requests = [MaskRequest(matcher=grammars[rid].m, request_id=rid) for rid, *_ in spec]
    pending = step.copy_tree(nxt, sib, tok)
    draft = tok.clone().reshape(-1)
    if threaded:
        job = step.start_build(requests, pending, vocab_size=VOCAB, barrier=barrier, allow_timeout=True)
        out = step.finish_build(job, device="cpu", draft_device=draft)
    else:
        out = step.build_mask(requests, pending, vocab_size=VOCAB, device="cpu", barrier=barrier,
                              draft_device=draft)
    return out.device_mask.clone(), barrier_threads, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threaded_mask_is_the_inline_mask_and_the_barrier_runs_off_thread(seed):
    spec, nxt, sib, tok, copy = _setup(seed, bs=6)
    inline_step = GrammarStep(mask_threads=1, mask_time_limit_s=None)
    thread_step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=True)
    try:
        g_in, g_th = copy(), copy()
        m_in, th_in, _ = _run(inline_step, spec, g_in, nxt, sib, tok, threaded=False)
        m_th, th_th, out = _run(thread_step, spec, g_th, nxt, sib, tok, threaded=True)
        assert torch.equal(m_in, m_th)
        assert (m_th != -1).any(), "no row was constrained: the comparison would be vacuous"
        me = threading.get_ident()
        assert th_in == [me]
        assert len(th_th) == 1 and th_th[0] != me  # the barrier ran once, on the grammar thread
        # every accept of the barrier happened on that thread; the ledger fed each run exactly once
        for rid, prefix, run, truth in spec:
            assert [t for _, t in g_th[rid].calls] == run
            assert {tid for tid, _ in g_th[rid].calls} == {th_th[0]}
        assert thread_step.ledger.tokens_fed == inline_step.ledger.tokens_fed == sum(len(r) for *_, r, _ in spec)
        s = thread_step.stats
        assert s.steps == 1 and thread_step.snapshot()["grammar_thread"] is True
        assert s.sched_s > 0 and s.helper_gil_s >= 0 and s.join_wait_s <= s.sched_s
    finally:
        thread_step.close()


def test_post_processing_after_the_join_replays_and_feeds_nothing():
    spec, nxt, sib, tok, copy = _setup(7, bs=4)
    step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=True)
    try:
        grammars = copy()
        _run(step, spec, grammars, nxt, sib, tok, threaded=True)
        fed = step.ledger.tokens_fed
        for rid, prefix, run, truth in spec:  # the host's post-processing asks again, on the scheduler thread
            out = step.advance(rid, grammars[rid], len(prefix), run)
            assert out.retained == tuple(run)
            assert len(grammars[rid].calls) == len(run)
        assert step.ledger.tokens_fed == fed
    finally:
        step.close()


def test_an_abandoned_job_completes_before_the_next_starts():
    """A verify that raised between start and finish leaves its job running; the next job must run after it, so two
    jobs never touch the matchers at once, and its barrier still fed each run exactly once."""
    spec, nxt, sib, tok, copy = _setup(3, bs=3)
    step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=True)
    release = threading.Event()
    order: list[str] = []

    def slow_barrier():
        release.wait(5)
        order.append("first")
        for rid, prefix, run, truth in spec:
            step.advance(rid, grammars[rid], len(prefix), run)

    try:
        grammars = copy()
        reqs = [MaskRequest(matcher=grammars[rid].m, request_id=rid) for rid, *_ in spec]
        step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, barrier=slow_barrier)
        threading.Timer(0.05, release.set).start()
        job2 = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB,
                                barrier=lambda: order.append("second"))
        step.finish_build(job2, device="cpu", draft_device=tok.clone().reshape(-1))
        assert order == ["first", "second"]
        for rid, prefix, run, truth in spec:
            assert [t for _, t in grammars[rid].calls] == run
    finally:
        step.close()


def test_an_error_of_the_job_is_raised_at_the_join():
    spec, nxt, sib, tok, copy = _setup(4, bs=2)
    step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=True)

    def broken():
        raise RuntimeError("barrier broke")

    try:
        grammars = copy()
        reqs = [MaskRequest(matcher=grammars[rid].m, request_id=rid) for rid, *_ in spec]
        job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB, barrier=broken)
        with pytest.raises(RuntimeError, match="barrier broke"):
            step.finish_build(job, device="cpu")
        # the step is usable afterwards
        job = step.start_build(reqs, step.copy_tree(nxt, sib, tok), vocab_size=VOCAB)
        assert step.finish_build(job, device="cpu").device_mask is not None
    finally:
        step.close()


class _Exporter:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def observe_step(self, grammar_s, unhidden_s, timeouts, *, forced_proposed=0, forced_accepted=0) -> None:
        self.calls.append((grammar_s, unhidden_s, timeouts, forced_proposed, forced_accepted))


@pytest.mark.parametrize("threaded", [False, True])
def test_finish_build_reports_what_ran_where(threaded, tmp_path):
    """The step's own account: stats (scheduler-thread time, join wait only when joined), the exporter's per-step
    call with the forced-draft deltas, and the timeline's spans in order on the right batch size."""
    spec, nxt, sib, tok, copy = _setup(5, bs=6)
    tl = Timeline(str(tmp_path / "timeline.json"))
    exporter = _Exporter()
    step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=threaded, timeline=tl,
                       exporter=exporter)
    step._forced_delta = lambda: (3, 2)  # what the forced-draft counters moved by since the last step
    try:
        mask, _, out = _run(step, spec, copy(), nxt, sib, tok, threaded=threaded)
    finally:
        step.close()
    s = step.stats
    assert s.steps == 1 and s.mask_timeouts == 0 and s.mask_s > 0 and s.advance_s > 0
    assert s.sched_s > 0 and (s.join_wait_s > 0) is threaded and s.helper_gil_s >= 0
    assert s.sched_s >= s.join_wait_s
    ((grammar_s, unhidden_s, timeouts, fp, fa),) = exporter.calls
    assert grammar_s > 0 and unhidden_s == 0 and timeouts == 0 and (fp, fa) == (3, 2)
    first, *events = tl.events()
    assert first[0] == "tree_copy" and first[1] == first[2]  # copy_tree's point, before the build
    names = [e[0] for e in events]
    assert names == ["advance", "tree_wait", "mask_build"] + (["grammar_join"] if threaded else []) + [
        "mask_upload", "sample"]
    assert all(e[3] == 6 for e in events)  # every event carries the batch size
    spans = {e[0]: (e[1], e[2]) for e in events}
    for name, (a, b) in spans.items():
        assert a <= b, name
    assert spans["advance"][1] <= spans["tree_wait"][0] + 1e-9 and spans["tree_wait"][1] <= spans["mask_build"][0]
    upload_from = spans["grammar_join"][1] if threaded else spans["mask_build"][1]
    assert spans["mask_upload"][0] == upload_from and spans["sample"][0] == spans["mask_upload"][1]
    if threaded:
        assert spans["grammar_join"][0] <= spans["grammar_join"][1] <= spans["mask_upload"][0]
    assert torch.equal(mask, out.device_mask)


class _Forced(ForcedDrafts):
    """Every valid node has a one-token continuation; uploads are recorded, not made."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list = []

    def _entry(self, matcher):
        rows = np.full((1, 1 + ALTERNATIVES), -1, dtype=np.int32)
        rows[0, 0] = 1
        return (1,), rows

    def upload(self, device) -> None:
        self.uploads.append(device)


@pytest.mark.parametrize("path", ["start_build", "build_mask"])
def test_forced_table_is_recorded_and_uploaded_for_eagle_jobs_only(path):
    """Jobs from start_build (EAGLE trees) record each valid node's continuation and upload the table at the join;
    build_mask jobs (chain and host-built trees) do neither, though forced drafts are on."""
    spec, nxt, sib, tok, copy = _setup(7, bs=4)
    forced = _Forced()
    step = GrammarStep(mask_threads=1, mask_time_limit_s=None, forced=forced)
    _run(step, spec, copy(), nxt, sib, tok, threaded=(path == "start_build"))
    if path == "start_build":
        assert forced.recorded_nodes > 0 and forced.uploads == ["cpu"]
    else:
        assert forced.recorded_nodes == 0 and forced.uploads == []


def test_the_grammar_threads_gil_time_is_its_python_time():
    """``helper_gil_s``: the grammar thread's CPU time outside native fills, here a barrier that runs Python for
    30 ms of thread CPU time (so at least that), never more than the job's wall time; the inline path has none."""
    spec, nxt, sib, tok, copy = _setup(8, bs=2)

    def busy():
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass

    for threaded in (True, False):
        step = GrammarStep(mask_threads=1, mask_time_limit_s=None, grammar_thread=threaded)
        requests = [MaskRequest(matcher=matcher("nested", VOCAB, prefix), request_id=rid)
                    for rid, prefix, run, truth in spec]
        try:
            t0 = time.perf_counter()
            pending = step.copy_tree(nxt, sib, tok)
            job = step.start_build(requests, pending, vocab_size=VOCAB, barrier=busy)
            step.finish_build(job, device="cpu")
            wall = time.perf_counter() - t0
        finally:
            step.close()
        if threaded:
            assert 0.03 - 1e-3 <= job.gil_s <= wall and step.stats.helper_gil_s == job.gil_s
        else:
            assert job.gil_s == 0.0
