"""The native batch calls (``core/native.py``, ``native/grammar_batch.cc``) against the Python code they
replace: the ledger's batched feed gives the outcomes, matcher states and ``on_feed`` reports of the Python feed, run
by run; the loader builds once per key, fails with the compiler's words, and the runtime falls back (auto) or refuses
(required). The tree walk's equivalence with SGLang's own mask is in ``test_mask_equivalence.py`` (strategy
``lockstep+cxx``)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import GrammarStep, MaskRequest, RowRun, Run

from sglang_eagle_overlap.core.ledger import AcceptLedger

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core.native import NativeUnavailable, build_native, load_native
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.devices import DeviceTensor, result_runs
from sglang_eo_dev.helpers.native import feed_runs, native
from sglang_eo_dev.helpers.tokenizers import EOS_ID
from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees
from sglang_eo_dev.helpers.steps import feed_one, make_step

VOCAB = 32000


def _state(m) -> torch.Tensor:
    return G.next_token_bitmask(m, VOCAB)


def _requests(rng: random.Random, k: int):
    """``k`` documents (ids ending with EOS) of mixed grammars, each with a starting position."""
    out = []
    for _ in range(k):
        g = rng.choice(["regex", "nested", "ebnf"])
        doc = list(G.doc_tokens(g, rng, VOCAB))
        out.append((g, doc, rng.randrange(0, max(1, len(doc) - 6))))
    return out


def _run_for(rng: random.Random, doc, pos: int):
    """The next run of a request: 1-4 true tokens, sometimes past the EOS, sometimes with a bad token inside."""
    k = rng.randint(1, 4)
    run = list(doc[pos : pos + k]) or [doc[-1]]
    if rng.random() < 0.1:
        run.append(doc[0])  # tokens after the grammar's end
    if rng.random() < 0.15:
        run.insert(rng.randrange(len(run) + 1), rng.randrange(VOCAB))  # often a rejection
    return run


def _norm(results):
    """Outcomes as they are, ledger errors by type and message (exceptions do not compare equal)."""
    return [(type(r).__name__, str(r)) if isinstance(r, Exception) else r for r in results]


def _twin_ledgers(rng: random.Random, k: int):
    """``k`` requests, a Python ledger and a native one, each with its own matchers at the requests' positions, the
    host's grammar objects and the positions."""
    reqs = _requests(rng, k)
    m_py = [G.matcher(g, VOCAB, doc[:p]) for g, doc, p in reqs]
    m_cx = [G.matcher(g, VOCAB, doc[:p]) for g, doc, p in reqs]
    return (reqs, AcceptLedger(), AcceptLedger(native=native()), m_py, m_cx, [object() for _ in reqs],
            [p for _, _, p in reqs])


@pytest.mark.parametrize("seed", range(4))
def test_batched_feed_matches_the_python_feed_run_by_run(seed):
    rng = random.Random(seed)
    reqs, py, cx, m_py, m_cx, grammars, pos = _twin_ledgers(rng, 24)
    fed_py, fed_cx = [], []
    fresh = 0
    for step in range(12):
        runs_py, runs_cx = [], []
        for i, (_, doc, _) in enumerate(reqs):
            if rng.random() < 0.2:
                continue  # not in this batch
            run = _run_for(rng, doc, pos[i])
            runs_py.append(Run(f"r{i}", grammars[i], m_py[i], pos[i], run))
            runs_cx.append(Run(f"r{i}", grammars[i], m_cx[i], pos[i], run))
        if step % 3 == 2 and runs_py:  # the same runs asked again: replays
            runs_py += runs_py[:3]
            runs_cx += runs_cx[:3]
        got_py = py.feed(runs_py, lambda g, o: fed_py.append((id(g), o)))
        got_cx = cx.feed(runs_cx, lambda g, o: fed_cx.append((id(g), o)))
        assert _norm(got_cx) == _norm(got_py), f"step {step}"
        assert sorted(fed_cx, key=repr) == sorted(fed_py, key=repr), f"step {step}"
        for run, out in zip(runs_py, got_py):
            key, start = run.key, run.start
            i = int(key[1:])
            if not isinstance(out, Exception) and out.start == start == pos[i]:
                pos[i] = start + len(out.retained)
                fresh += 1
        for a, b in zip(m_py, m_cx):
            assert torch.equal(_state(a), _state(b)) and a.is_terminated() == b.is_terminated()
    assert cx.tokens_fed == py.tokens_fed and cx.replays == py.replays > 0
    outcomes = [o for _, o in fed_py]
    assert fresh > 100 and any(o.terminated for o in outcomes) and any(o.error for o in outcomes)


def test_a_second_run_of_a_request_in_one_call_is_fed_after_the_first():
    doc = list(G.doc_tokens("regex", random.Random(3), VOCAB))
    m_py, m_cx = G.matcher("regex", VOCAB), G.matcher("regex", VOCAB)
    g = object()
    want = AcceptLedger().feed([Run("r", g, m_py, 0, doc[:2]), Run("r", g, m_py, 2, doc[2:5])])
    got = AcceptLedger(native=native()).feed([Run("r", g, m_cx, 0, doc[:2]), Run("r", g, m_cx, 2, doc[2:5])])
    assert got == want and [len(o.retained) for o in got] == [2, 3]
    assert torch.equal(_state(m_cx), _state(m_py))


def test_a_gap_or_conflict_in_a_batch_changes_nothing_else():
    doc = list(G.doc_tokens("regex", random.Random(4), VOCAB))
    led = AcceptLedger(native=native())
    a, b = G.matcher("regex", VOCAB), G.matcher("regex", VOCAB)
    ga, gb = object(), object()
    led.feed([Run("a", ga, a, 0, doc[:2]), Run("b", gb, b, 0, doc[:1])])
    out = led.feed([Run("a", ga, a, 5, doc[5:6]), Run("b", gb, b, 1, doc[1:3]), Run("a", ga, a, 0, doc[1:3])])
    assert type(out[0]).__name__ == "LedgerGapError" and type(out[2]).__name__ == "LedgerConflictError"
    assert out[1].retained == tuple(doc[1:3]) and led.consumed("a") == 2 and led.consumed("b") == 3


class CountingSubclass(xgr.GrammarMatcher):
    """A matcher subclass overriding a method in Python: native calls would bypass it, so it is fed in Python."""

    calls = 0

    def accept_token(self, token_id: int, *, debug_print: bool = False) -> bool:
        CountingSubclass.calls += 1
        return super().accept_token(token_id, debug_print=debug_print)


def test_a_matcher_subclass_is_fed_and_walked_in_python():
    doc = list(G.doc_tokens("regex", random.Random(5), VOCAB))
    m = G.matcher("regex", VOCAB, cls=CountingSubclass)
    CountingSubclass.calls = 0
    out = feed_one(AcceptLedger(native=native()), "r", object(), 0, doc[:3], matcher=m)
    assert out.retained == tuple(doc[:3]) and CountingSubclass.calls == 3
    assert native().handles([m]) is None and native().handles([G.matcher("regex", VOCAB)]) is not None
    tree = eagle_tree(random.Random(1), 4, 3, 8, doc[3:6], VOCAB, matcher=m)
    nxt, sib, tok = stack_trees([tree])
    b = TreeMaskBuilder(threads=1, native=native())
    b.build([MaskRequest(matcher=m)], nxt, sib, tok, VOCAB)
    assert b.native_walks == 0 and CountingSubclass.calls > 3


def _batch(seed: int, k: int = 6, n: int = 8):
    rng = random.Random(seed)
    ms, trees = [], []
    for g, doc, p in _requests(rng, k):
        m = G.matcher(g, VOCAB, doc[:p])
        ms.append(m)
        trees.append(eagle_tree(rng, 4, 3, n, doc[p : p + 3], VOCAB, matcher=m, extra_tokens=(EOS_ID,)))
    return ms, stack_trees(trees)


def test_step_batch_refuses_bad_arguments_before_touching_anything():
    ms, (nxt, sib, tok) = _batch(0, k=2)
    nat = native()
    handles = nat.handles(ms)
    mask = torch.full((16, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="given twice"):
        nat.step_batch((), (), (), handles, [0, 0], nxt, sib, tok, mask, VOCAB, None)
    with pytest.raises(IndexError, match="out of"):
        nat.step_batch((), (), (), handles, [0, 2], nxt, sib, tok, mask, VOCAB, None)
    with pytest.raises(TypeError, match="bitmask"):
        nat.step_batch((), (), (), handles, [0, 1], nxt, sib, tok, mask.float(), VOCAB, None)
    with pytest.raises(ValueError, match="contiguous"):
        nat.step_batch((), (), (), handles, [0, 1], nxt, sib, tok, torch.full((32, 1000), -1, dtype=torch.int32)[::2], VOCAB, None)
    with pytest.raises(ValueError, match="elements"):
        nat.step_batch((), (), (), handles, [0, 1], nxt, sib, tok, mask[:4], VOCAB, None)
    assert bool((mask == -1).all()), "a refused call writes nothing"


def test_a_failing_native_walk_is_rebuilt_request_by_request(caplog):
    ms, (nxt, sib, tok) = _batch(1)
    want = TreeMaskBuilder(threads=1).build([MaskRequest(matcher=m) for m in ms], nxt, sib, tok, VOCAB).bitmask.clone()

    class Broken:
        matcher_type = xgr.GrammarMatcher

        def handles(self, matchers):
            return native().handles(matchers)

        def step_call(self, *a, **k):
            raise RuntimeError("boom")

    b = TreeMaskBuilder(threads=1, native=Broken())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        got = b.build([MaskRequest(matcher=m) for m in ms], nxt, sib, tok, VOCAB)
    assert torch.equal(got.bitmask, want) and not got.failed
    assert any("boom" in r.getMessage() and "request by request" in r.getMessage() for r in caplog.records)


def test_consecutive_native_builds_on_the_reused_buffer_are_exact():
    """The sparse reset (stale rows of the previous build) works with the rows the native walk reports written."""
    py, cx = TreeMaskBuilder(threads=1), TreeMaskBuilder(threads=1, native=native())
    for seed, k in enumerate([7, 3, 6, 2, 5, 5]):
        ms, (nxt, sib, tok) = _batch(10 + seed, k=k)
        # Rows that were constrained in the previous build and are not now (an unconstrained request, a shorter
        # batch) must come back all-allowed: only the rows this walk reports written are skipped by the reset.
        reqs = [MaskRequest(matcher=m) if (i + seed) % 3 else MaskRequest() for i, m in enumerate(ms)]
        want = py.build(reqs, nxt, sib, tok, VOCAB).bitmask.clone()
        got = cx.build(reqs, nxt, sib, tok, VOCAB)
        assert torch.equal(got.bitmask, want), seed
        assert torch.equal(got.bitmask, TreeMaskBuilder(threads=1).build(reqs, nxt, sib, tok, VOCAB).bitmask), seed
    assert cx.native_walks == 6 and cx.reset_rows == py.reset_rows


def test_the_build_is_cached_by_key_and_a_failed_compile_names_the_cause(tmp_path, monkeypatch):
    first = build_native(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build_native(tmp_path) == first and first.stat().st_mtime_ns == stamp  # reused, not rebuilt
    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\necho 'no compiler here' >&2\nexit 3\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    with pytest.raises(NativeUnavailable, match="no compiler here"):
        build_native(tmp_path)  # another compiler is another key: it compiles, and fails
    assert sorted(p.name for p in tmp_path.glob("*.so*")) == [first.name]  # no partial file left


def test_the_runtime_falls_back_when_auto_and_refuses_when_required(tmp_path, monkeypatch, caplog):
    from sglang_eagle_overlap.integration.runtime import load_native_for

    bad = tmp_path / "cxx"
    bad.write_text("#!/bin/sh\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("CXX", str(bad))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert load_native_for(None) is None
    assert any("stays in Python" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="SGLANG_EAGLE_OVERLAP_NATIVE=1"):
        load_native_for(True)
    monkeypatch.delenv("CXX")
    assert load_native_for(True) is not None


def test_grammar_step_loads_the_module_at_its_first_build_and_shares_it():
    calls = []

    def loader():
        calls.append(1)
        return native()

    step = make_step(native=loader)
    assert calls == [] and step.native is None and step.telemetry.snapshot()["native"] is False
    builder = step.builder
    assert calls == [1] and builder.native is step.native is step.ledger.native is native()
    assert step.builder is builder and calls == [1] and step.telemetry.snapshot()["native"] is True
    assert make_step().builder.native is None


def test_load_native_checks_the_matcher_type(tmp_path):
    nat = load_native(tmp_path)
    assert nat.type_key == "xgrammar.tvm_ffi_binding.GrammarMatcher" and nat.matcher_type is xgr.GrammarMatcher
    assert Path(nat.path).parent == tmp_path


@pytest.mark.parametrize("live", [True, False])
def test_a_matcher_terminated_behind_the_ledgers_back_is_terminated_not_rejected(live):
    """As the Python feed (test_ledger_native_feed.py): with the live shortcut taken (the ledger's own last run left
    the matcher live) or not (a rebuilt grammar object), a matcher fed to its end elsewhere refuses the next token,
    and the run is reported terminated, not rejected."""
    doc = list(G.doc_tokens("regex", random.Random(5), VOCAB))
    outs = []
    for ledger in (AcceptLedger(), AcceptLedger(native=native())):
        raw = G.matcher("regex", VOCAB)
        grammar = object()
        feed_one(ledger, "r", grammar, 0, doc[:2], matcher=raw)
        for t in doc[2:]:
            assert raw.accept_token(t)
        assert raw.is_terminated()
        outs.append(feed_one(ledger, "r", grammar if live else object(), 2, [doc[2]], matcher=raw))
    assert outs[1] == outs[0] and outs[1].terminated and outs[1].error is None and outs[1].retained == ()


# -- the fused step call: feeds and walk in one call, runs read from a result's tensors, the persistent helpers -----
def _fused_world(seed: int, k: int = 10, n: int = 8):
    """``k`` requests with a next run each and a draft tree that continues after it; returns a builder of fresh
    matchers (before the run), the runs, and the stacked tree."""
    rng = random.Random(seed)
    reqs = _requests(rng, k)
    runs = [_run_for(rng, doc, p) for _, doc, p in reqs]
    trees = []
    for (g, doc, p), run in zip(reqs, runs):
        after = G.matcher(g, VOCAB, doc[:p])
        for t in run:
            if after.is_terminated() or not after.accept_token(t):
                break
        trees.append(eagle_tree(rng, 4, 3, n, doc[p + len(run) : p + len(run) + 3] or [EOS_ID], VOCAB,
                                matcher=after, extra_tokens=(EOS_ID,)))

    def fresh():
        return [G.matcher(g, VOCAB, doc[:p]) for g, doc, p in reqs]

    return fresh, runs, stack_trees(trees), n


def _mask(k: int, n: int) -> torch.Tensor:
    return torch.full((k * n, (VOCAB + 31) // 32), -1, dtype=torch.int32)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_one_fused_call_equals_the_feed_then_the_walk(threads):
    """step_batch(feeds + walk) == feed_runs then step_batch(walk): the same outcomes, mask, rows and matcher states,
    on 1 thread and spread over the module's persistent helper threads (called twice: the helpers are reused)."""
    nat = native()
    fresh, runs, (nxt, sib, tok), n = _fused_world(11)
    k = len(runs)
    a, b = fresh(), fresh()
    live = [False] * k
    fed = feed_runs(nat, nat.handles(a), runs, live)
    want_mask = _mask(k, n)
    want = nat.step_batch((), (), (), nat.handles(a), list(range(k)), nxt, sib, tok, want_mask, VOCAB, None)
    for _ in range(2):
        got_mask = _mask(k, n)
        packed = []
        for run in runs:
            packed += (0, -1, len(run), *run)
        got = nat.step_batch(nat.handles(b), packed, (), nat.handles(b), list(range(k)), nxt, sib, tok, got_mask,
                             VOCAB, None, threads)
        assert tuple(got.feeds) == tuple(fed.feeds) and tuple(got.status) == tuple(want.status)
        assert got.total == want.total > k and sorted(got.written) == sorted(want.written)
        assert torch.equal(got_mask, want_mask)
        assert all(torch.equal(_state(x), _state(y)) for x, y in zip(a, b))
        b = fresh()  # the second round starts over


def test_runs_read_from_a_results_tensors_equal_packed_runs():
    """A run given as (result, row) is read in C++ from ``ids[row * stride : row * stride + lens[row]]`` (a decode
    result, int32 or int64) or ``ids[row]`` (a prefill result: no lengths): the same outcomes as the tokens packed."""
    nat = native()
    fresh, runs, _, n = _fused_world(12, k=6)
    stride = 7
    ids = torch.zeros(len(runs) * stride, dtype=torch.int64)
    lens = torch.zeros(len(runs), dtype=torch.int32)
    for i, run in enumerate(runs):
        run = run[:stride]
        ids[i * stride : i * stride + len(run)] = torch.tensor(run)
        lens[i] = len(run)
    runs = [run[:stride] for run in runs]
    want = feed_runs(nat, nat.handles(fresh()), runs, [False] * len(runs))
    for dtype in (torch.int64, torch.int32):
        ms = fresh()
        packed = [x for i in range(len(runs)) for x in (0, 0, i)]
        got = nat.step_batch(nat.handles(ms), packed, [(ids.to(dtype), lens, stride)], (), (), None, None, None,
                             None, 0, None)
        assert tuple(got.feeds) == tuple(want.feeds)
        # what the call read, handed back: every run's length and all runs' tokens in order, as packed runs give them
        assert list(got.run_lens) == [len(run) for run in runs] == list(want.run_lens)
        assert list(got.run_tokens) == [t for run in runs for t in run] == list(want.run_tokens)
    prefill = torch.tensor([run[0] for run in runs], dtype=torch.int64)
    first = feed_runs(nat, nat.handles(fresh()), [run[:1] for run in runs], [False] * len(runs))
    got = nat.step_batch(nat.handles(fresh()), [x for i in range(len(runs)) for x in (0, 0, i)],
                         [(prefill, None, 1)], (), (), None, None, None, None, 0, None)
    assert tuple(got.feeds) == tuple(first.feeds)
    assert list(got.run_lens) == [1] * len(runs) and list(got.run_tokens) == [run[0] for run in runs]


def test_a_raising_request_stays_alone_and_nothing_is_fed_twice():
    """A request whose matcher raises inside the call (here: a handle of another xgrammar type) gets FEED_ERROR /
    WALK_FAILED with the message, the others are fed and walked as without it; the refused arguments raise before
    anything is touched."""
    from sglang_eagle_overlap.core.native import FEED_ERROR, WALK_FAILED, WALKED

    nat = native()
    fresh, runs, (nxt, sib, tok), n = _fused_world(13, k=5)
    k = len(runs)
    ms = fresh()
    handles = nat.handles(ms)
    bad = G.compiled("regex", VOCAB)._handle  # a CompiledGrammar: its "accept_token" lookup fails in C++
    handles_bad = list(handles)
    handles_bad[2] = bad
    packed = []
    for run in runs:
        packed += (0, -1, len(run), *run)
    mask = _mask(k, n)
    got = nat.step_batch(handles_bad, packed, (), handles_bad, list(range(k)), nxt, sib, tok, mask, VOCAB, None)
    states = [got.feeds[2 * f + 1] for f in range(k)]
    assert states[2] == FEED_ERROR and got.status[2] == WALK_FAILED and ("f", 2) in got.errors
    ok = fresh()
    want_mask = _mask(k, n)
    want = nat.step_batch(nat.handles(ok), packed, (), nat.handles(ok), list(range(k)), nxt, sib, tok, want_mask,
                          VOCAB, None)
    for i in range(k):
        if i == 2:
            continue
        assert got.feeds[2 * i : 2 * i + 2] == want.feeds[2 * i : 2 * i + 2] and got.status[i] == want.status[i]
        assert torch.equal(mask[i * n : (i + 1) * n], want_mask[i * n : (i + 1) * n])
        assert torch.equal(_state(ms[i]), _state(ok[i]))
    assert torch.equal(_state(ms[2]), _state(fresh()[2]))  # never reached: the matcher is as it was
    assert WALKED in tuple(got.status)
    untouched = _mask(k, n)
    with pytest.raises(IndexError, match="reset row"):
        nat.step_batch(handles, packed, (), handles, list(range(k)), nxt, sib, tok, untouched, VOCAB, None,
                       reset=[10 ** 6], buffer=untouched)
    with pytest.raises(IndexError, match="out of the result"):
        nat.step_batch(handles, [0, 0, 99], [(torch.zeros(4, dtype=torch.int64), torch.ones(2, dtype=torch.int32), 2)],
                       (), (), None, None, None, None, 0, None)
    with pytest.raises(ValueError, match="packed runs"):
        nat.step_batch(handles[:1], [0, -1, 5, 1], (), (), (), None, None, None, None, 0, None)
    assert bool((untouched == -1).all()) and all(torch.equal(_state(a), _state(b)) for a, b in zip(fresh(), fresh()))
    assert all(torch.equal(_state(a), _state(b)) for a, b in zip(ms[3:], ok[3:]))  # the refused calls fed nothing


def test_the_sparse_reset_in_the_call_spares_the_rows_it_fills():
    """``reset`` rows (of the whole buffer, beyond the mask's view too) go back to all-allowed unless the call filled
    them; the count is reported."""
    nat = native()
    fresh, runs, (nxt, sib, tok), n = _fused_world(14, k=3)
    k = len(runs)
    buf = torch.zeros((4 * k * n, (VOCAB + 31) // 32), dtype=torch.int32)  # stale everywhere
    view = buf[: k * n]
    view.fill_(-1)
    ms = fresh()
    got = nat.step_batch((), (), (), nat.handles(ms), list(range(k)), nxt, sib, tok, view, VOCAB, None,
                         reset=list(range(4 * k * n)), buffer=buf)
    written = set(got.written)
    assert written and got.reset == 4 * k * n - len(written)
    for r in range(4 * k * n):
        if r not in written:
            assert bool((buf[r] == -1).all()), r
    assert any(not bool((buf[r] == -1).all()) for r in written)  # the filled rows were not reset


@pytest.mark.parametrize("layout", ["decode", "prefill", "two-results"])
@pytest.mark.parametrize("seed", range(3))
def test_runs_queued_by_row_match_the_python_feed_run_by_run(seed, layout):
    """``LedgerPlan.add_rows`` (a result's rows, tokens read by the native call) against ``feed`` in Python on
    the same runs: replays, gaps and conflicts answered at once, fresh runs queued without their tokens, then fed --
    the same outcomes, ``on_feed`` reports, matcher states and counters, step after step. Decode results, prefill
    results (one token per row) and a step whose rows come from two results (one plan, two ``add_rows`` calls: the
    0.5.16 barrier with two queued results), whose outcomes ``LedgerPlan.fill`` reads from the right result."""

    rng = random.Random(100 + seed)
    reqs, py, cx, m_py, m_cx, grammars, pos = _twin_ledgers(rng, 16)
    queued_total = 0
    for step in range(10):
        rows, runs = [], []
        for i, (_, doc, _) in enumerate(reqs):
            if rng.random() < 0.2:
                continue
            run = _run_for(rng, doc, pos[i])
            if rng.random() < 0.05 and pos[i] > 0:
                start = pos[i] - 1  # a stale position: a conflict or a replay
            elif rng.random() < 0.05:
                start = pos[i] + 2  # a gap
            else:
                start = pos[i]
            if rng.random() < 0.05:
                grammars[i] = object()  # the host rebuilt the grammar: re-anchored at start
            rows.append((i, start, run[:1] if layout == "prefill" else run))
        fed_py, fed_cx = [], []
        got_py = py.feed([Run(f"r{i}", grammars[i], m_py[i], start, run) for i, start, run in rows],
                                 lambda g, o: fed_py.append((id(g), o)))
        plan = cx.plan()
        parts = [rows[: len(rows) // 2], rows[len(rows) // 2 :]] if layout == "two-results" else [rows]
        first = len(plan.out)
        for part in parts:
            plan.add_rows([RowRun(f"r{i}", grammars[i], m_cx[i], start, r) for r, (i, start, _) in enumerate(part)],
                          result_runs([run for _, _, run in part], prefill=layout == "prefill"), lambda g, o: fed_cx.append((id(g), o)))
        queued_total += len(plan)
        plan.feed()
        got_cx = plan.out[first:]
        assert _norm(got_cx) == _norm(got_py), f"step {step}"
        assert sorted(fed_cx, key=repr) == sorted(fed_py, key=repr), f"step {step}"
        assert plan.errors == sum(isinstance(o, Exception) for o in got_py)
        for (i, start, _), out in zip(rows, got_py):
            if not isinstance(out, Exception) and out.start == start == pos[i]:
                pos[i] = start + len(out.retained)
        for a, b in zip(m_py, m_cx):
            assert torch.equal(_state(a), _state(b)) and a.is_terminated() == b.is_terminated()
    assert cx.tokens_fed == py.tokens_fed and cx.replays == py.replays
    assert queued_total > 50  # most fresh runs waited for the native call


def test_a_result_not_on_the_host_is_read_at_once_never_by_the_native_call():
    """Runs of a result whose tensors are not host tensors are read through Python at once and packed with their
    tokens: the native call never gets a tensor it could not read, and the outcomes are the same."""
    from sglang_eagle_overlap.core.ledger import ResultRuns

    rng = random.Random(21)
    reqs, py, cx, m_py, m_cx, grammars, pos = _twin_ledgers(rng, 6)
    runs = [_run_for(rng, doc, p)[:4] for _, doc, p in reqs]
    ids = [0] * (len(runs) * 4)
    for i, run in enumerate(runs):
        ids[i * 4 : i * 4 + len(run)] = run
    result = ResultRuns(DeviceTensor(ids), DeviceTensor([len(r) for r in runs]), 4)
    assert not result.on_host and ResultRuns(torch.zeros(4, dtype=torch.int64), None, 1).on_host
    plan = cx.plan()
    plan.add_rows([RowRun(f"r{i}", grammars[i], m_cx[i], pos[i], i) for i in range(len(runs))], result)
    _, packed, results = plan.pending()
    assert results == [] and len(plan) == len(runs) and packed[1] == -1  # packed with their tokens
    plan.feed()
    want = py.feed([Run(f"r{i}", grammars[i], m_py[i], pos[i], runs[i]) for i in range(len(runs))])
    assert _norm(plan.out) == _norm(want)
    assert all(torch.equal(_state(a), _state(b)) for a, b in zip(m_py, m_cx))


def test_step_batch_walks_within_the_budget_it_is_given():
    """``step_batch``'s ``budget_s`` is the walk's time limit: a spent budget (0 s) stops every walk after its root
    (timed out, non-root rows all-allowed again, matchers where they were), no budget walks every tree whole."""
    from sglang_eagle_overlap.core.native import WALK_TIMED_OUT, WALKED

    ms, (nxt, sib, tok) = _batch(3, k=4)
    nat = native()
    before = [_state(m) for m in ms]
    width = (VOCAB + 31) // 32
    rows = list(range(len(ms)))
    whole = torch.full((len(ms) * 8, width), -1, dtype=torch.int32)
    res = nat.step_batch((), (), (), nat.handles(ms), rows, nxt, sib, tok, whole, VOCAB, None)
    assert list(res.status) == [WALKED] * len(ms)
    assert all(v > 1 for v in res.valid)  # every tree has drafts past its root: a walk the budget can cut
    spent = torch.full((len(ms) * 8, width), -1, dtype=torch.int32)
    res = nat.step_batch((), (), (), nat.handles(ms), rows, nxt, sib, tok, spent, VOCAB, 0.0)
    assert list(res.status) == [WALK_TIMED_OUT] * len(ms)
    for i in rows:
        assert torch.equal(spent[i * 8], whole[i * 8])  # the root row is exact
        assert bool((spent[i * 8 + 1 : (i + 1) * 8] == -1).all())
    assert all(torch.equal(_state(m), b) for m, b in zip(ms, before))


def test_reading_a_calls_messages_and_texts_never_raises_after_it_fed():
    """Once the native call returned, it has fed and walked: an exception while its messages or forced texts are read
    would make the caller take the call as never made and feed its runs again. A module whose readers raise (an
    unreadable text) leaves the call's values as they are, without the messages or texts."""
    from sglang_eagle_overlap.core.native import NativeGrammar

    values = [3, 0, 1, 0, 1, 0, 1, 7, -1]  # total 3, 1 error, 1 forced text; one walk: status, valid; (row, key)

    class Module:
        def step_batch(self, *args):
            return values

        def step_errors(self):
            raise UnicodeDecodeError("utf-8", b"\xa9", 0, 1, "invalid start byte")

        def step_forced(self):
            raise UnicodeDecodeError("utf-8", b"\xa9", 0, 1, "invalid start byte")

    nat = NativeGrammar(module=Module(), path="", type_key="", matcher_type=xgr.GrammarMatcher)
    raw = nat.step_call((), (), (), ["h"], [0], torch.zeros((1, 1), dtype=torch.int64),
                        torch.zeros((1, 1), dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                        torch.zeros((1, 1), dtype=torch.int32), 32, None)()
    res = nat.step_result(raw, 0, 1)
    assert res.total == 3 and list(res.status) == [0] and list(res.valid) == [1]
    assert res.errors == {} and list(res.forced) == [] and list(res.written) == []
