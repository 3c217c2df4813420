"""TreeMaskBuilder's contract around the mask itself: the strategy it picks, its host buffer (reused, regrown for a
new vocabulary, or the caller's own ``out``), what it logs, and how a broken grammar or walk is accounted for.

The batch is ``test_mask_failures.py``'s: three ``regex`` requests, one 5-node draft tree each.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import time
from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import MaskRequest

from sglang_eagle_overlap.core.mask import TreeMaskBuilder, bitmask_width
from sglang_eagle_overlap.core import mask as mask_mod
from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.clocks import FakeTime
from sglang_eo_dev.helpers.native import native
from tests.core.test_mask_failures import N, VOCAB, BrokenGrammar, NotAMatcher, _setup

STRATEGIES = ["lockstep", "native", "python"]


def _reqs(matchers):
    return [MaskRequest(matcher=m, request_id=f"r{i}") for i, m in enumerate(matchers)]


def _reference() -> torch.Tensor:
    matchers, nxt, sib, tok = _setup()
    return TreeMaskBuilder(strategy="lockstep", threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB).bitmask.clone()


def test_auto_strategy_is_lockstep():
    assert TreeMaskBuilder().strategy == "lockstep"
    assert StrategyMaskBuilder(strategy="auto").strategy == "lockstep"
    assert StrategyMaskBuilder(strategy="native").strategy == "native"


def test_empty_batch_builds_nothing():
    empty = torch.zeros((0, N), dtype=torch.int64)
    got = TreeMaskBuilder().build([], empty, empty, empty, VOCAB)
    assert got.bitmask is None and got.timed_out == [] and got.failed == [] and got.valid_nodes == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_builder_follows_the_vocabulary_width(strategy):
    """The reused host buffer is regrown when the row width changes (another model's vocabulary)."""
    builder = StrategyMaskBuilder(strategy=strategy, threads=1)
    for vocab in (32000, 128000, 32000):
        matchers = [G.matcher("nested", vocab) for _ in range(2)]
        nxt = torch.tensor([[1, -1], [1, -1]])
        sib = torch.full((2, 2), -1)
        tok = torch.tensor([[0, 90], [0, 5]])
        got = builder.build(_reqs(matchers), nxt, sib, tok, vocab)
        assert tuple(got.bitmask.shape) == (4, bitmask_width(vocab))
        fresh = StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(matchers), nxt, sib, tok, vocab)
        assert torch.equal(got.bitmask, fresh.bitmask)
        assert torch.equal(got.bitmask[0], G.next_token_bitmask(matchers[0], vocab)[0])
    assert builder.allocations == 3


def test_buffer_grows_to_a_power_of_two_and_is_reused():
    builder = TreeMaskBuilder(threads=1)
    matchers, nxt, sib, tok = _setup()
    first = builder.build(_reqs(matchers[:1]), nxt[:1], sib[:1], tok[:1], VOCAB).bitmask  # 5 rows -> 8
    ptr = first.data_ptr()
    builder.build(_reqs(matchers[:1]), nxt[:1], sib[:1], tok[:1], VOCAB)
    assert builder.allocations == 1
    got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)  # 15 rows -> 16
    assert builder.allocations == 2 and got.bitmask.shape[0] == 3 * N
    assert torch.equal(got.bitmask, _reference())
    again = builder.build(_reqs(matchers[:2]), nxt[:2], sib[:2], tok[:2], VOCAB)  # 10 rows fit in 16
    assert builder.allocations == 2 and again.bitmask.data_ptr() == got.bitmask.data_ptr() != ptr
    # The reused buffer is all-allowed again wherever this build wrote nothing (no row left from the last one).
    assert torch.equal(again.bitmask, _reference()[: 2 * N])
    free_first = builder.build([MaskRequest()] + _reqs(_setup()[0][1:]), nxt, sib, tok, VOCAB)
    assert bool((free_first.bitmask[:N] == -1).all()) and torch.equal(free_first.bitmask[N:], _reference()[N:])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_caller_buffer_receives_the_mask(strategy):
    matchers, nxt, sib, tok = _setup()
    out = torch.zeros((3 * N + 2, bitmask_width(VOCAB)), dtype=torch.int32)
    got = StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB, out=out)
    assert got.bitmask.data_ptr() == out.data_ptr() and got.bitmask.shape[0] == 3 * N
    assert torch.equal(out[: 3 * N], _reference())
    assert bool((out[3 * N :] == 0).all())  # rows past the batch are not the builder's
    exact = torch.zeros((3 * N, bitmask_width(VOCAB)), dtype=torch.int32)  # exactly the rows needed is enough
    StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(_setup()[0]), nxt, sib, tok, VOCAB, out=exact)
    assert torch.equal(exact, _reference())


@pytest.mark.parametrize("shape,dtype", [
    ((3 * N - 1, 1000), torch.int32),  # too few rows
    ((3 * N, 999), torch.int32),  # wrong width
    ((3 * N, 1001), torch.int32),
    ((3 * N, 1000), torch.int64),  # wrong dtype
])
def test_caller_buffer_is_checked(shape, dtype):
    matchers, nxt, sib, tok = _setup()
    with pytest.raises(ValueError, match=r"out must be int32 \[>= 15, 1000\]"):
        TreeMaskBuilder().build(_reqs(matchers), nxt, sib, tok, VOCAB, out=torch.zeros(shape, dtype=dtype))


@pytest.mark.parametrize("strategy", ["lockstep", "python"])  # their walks check the limit between nodes
def test_time_limit_is_logged_with_the_request(strategy, caplog):
    matchers, nxt, sib, tok = _setup()
    builder = StrategyMaskBuilder(strategy=strategy, threads=1, time_limit_s=1e-9)
    reqs = _reqs(matchers)
    reqs[1] = dataclasses.replace(reqs[1], request_id="")  # a request without an id is named by its row
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = builder.build(reqs, nxt, sib, tok, VOCAB)
    assert got.timed_out, "a 1 ns limit cannot be met"
    warned = [r.getMessage() for r in caplog.records if "exceeded" in r.getMessage()]
    assert len(warned) == len(got.timed_out)
    for i in got.timed_out:
        name = f"row {i}" if i == 1 else f"r{i}"
        assert any(f"tree mask for request {name} exceeded 0.0 ms" in w for w in warned), warned
    assert all("accepts only the grammar-masked bonus token" in w for w in warned)


def test_without_time_limit_nothing_times_out():
    matchers, nxt, sib, tok = _setup()
    builder = TreeMaskBuilder(threads=1, time_limit_s=1e-9)
    got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB, allow_timeout=False)
    assert got.timed_out == [] and builder.timeouts == 0 and torch.equal(got.bitmask, _reference())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_failure_is_logged_with_the_request_and_counted_once(strategy, caplog):
    matchers, nxt, sib, tok = _setup()
    clean = StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB)
    reqs = _reqs(matchers)
    reqs[1] = MaskRequest(grammar=BrokenGrammar(matchers[1], ok_fills=0), request_id="bad-1")
    with caplog.at_level(logging.ERROR, logger="sglang_eagle_overlap.core.mask"):
        got = StrategyMaskBuilder(strategy=strategy, threads=1).build(reqs, nxt, sib, tok, VOCAB)
    assert got.failed == [(1, "RuntimeError: boom: broken grammar backend")]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["sglang-eagle-overlap: grammar of request bad-1 raised during the tree mask build: "
                      "RuntimeError: boom: broken grammar backend"]
    # The failed request's rows are not counted as built.
    assert got.valid_nodes == clean.valid_nodes - _valid_rows(clean.bitmask[N : 2 * N])


def _valid_rows(rows: torch.Tensor) -> int:
    return int((~(rows == -1).all(dim=1)).sum())


@pytest.mark.parametrize("strategy", ["lockstep", "native"])
def test_batched_walk_broken_by_one_matcher_is_redone_exactly(strategy, caplog):
    """After the batched walk failed, the per-request rebuild starts from scratch: no row, valid-node count or
    time-limit report of the failed batched attempt survives."""
    matchers, nxt, sib, tok = _setup()
    clean = StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB)
    reqs = _reqs(matchers)
    reqs[1] = MaskRequest(matcher=NotAMatcher(), request_id="corrupt")
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = StrategyMaskBuilder(strategy=strategy, threads=1).build(reqs, nxt, sib, tok, VOCAB)
    assert [i for i, _ in got.failed] == [1] and got.timed_out == []
    assert got.valid_nodes == clean.valid_nodes - _valid_rows(clean.bitmask[N : 2 * N])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(f"sglang-eagle-overlap: {strategy} tree mask build failed (")
    assert warned[0].endswith("); rebuilding request by request")


class _DepthGrammar:
    """The part of a host grammar the builder's walk needs besides accepting and filling: a depth it rolls back,
    never terminated."""

    depth = 0

    def rollback(self, k: int) -> None:
        self.depth -= k

    def is_terminated(self) -> bool:
        return False


class RejectingOnAccept(_DepthGrammar):
    """A host grammar whose mask allows every token but whose ``accept_token`` raises ``ValueError`` for ``bad``
    (SGLang's grammar objects raise on a rejected token)."""

    def __init__(self, bad: int) -> None:
        self.bad, self.depth = bad, 0

    def accept_token(self, token: int) -> None:
        if token == self.bad:
            raise ValueError(f"token {token} rejected")
        self.depth += 1

    def fill_vocab_mask(self, vocab_mask, idx: int) -> None:
        vocab_mask[idx] = -2  # every token but 0 and 32: a filled row, distinguishable from an all-allowed one


def test_host_grammar_rejecting_on_accept_makes_an_invalid_node():
    """Tree 0 - 1 - 3 / 1 - 4 / 0 - 2 with node 1's token rejected: nodes 1, 3 and 4 stay -1, node 2 is filled."""
    g = RejectingOnAccept(bad=11)
    nxt = torch.tensor([[1, 3, -1, -1, -1]])
    sib = torch.tensor([[-1, 2, -1, 4, -1]])
    tok = torch.tensor([[0, 11, 12, 13, 14]])
    got = StrategyMaskBuilder(strategy="python").build([MaskRequest(grammar=g)], nxt, sib, tok, 64)
    rows = got.bitmask
    assert [bool((rows[i] == -2).all()) for i in range(N)] == [True, False, True, False, False]
    assert [bool((rows[i] == -1).all()) for i in range(N)] == [False, True, False, True, True]
    assert got.valid_nodes == 2 and got.failed == [] and g.depth == 0


class SlowFills(_DepthGrammar):
    """A host grammar whose every mask fill takes ``fill_s`` on ``clock`` (and allows every token)."""

    def __init__(self, clock: FakeTime, fill_s: float) -> None:
        self.clock, self.fill_s, self.fills, self.depth = clock, fill_s, 0, 0

    def accept_token(self, token: int) -> None:
        self.depth += 1

    def fill_vocab_mask(self, vocab_mask, idx: int) -> None:
        self.clock.now += self.fill_s
        self.fills += 1


@pytest.mark.parametrize("strategy, with_native", [(s, False) for s in STRATEGIES] + [("lockstep", True)])
def test_build_time_is_the_time_spent_inside_the_call(strategy, with_native, monkeypatch):
    """``TreeMask.build_s`` is what the call took, on a clock only the test moves: 1000 s pass before each call (not
    the build's), each host-grammar fill takes 0.25 s and nothing else takes time. The tree (n = 5)::

        request 0 (SlowFills):  0 ── 1 ── 3       request 1 (SlowFills):  0 ── 1
                                     └── 2                                  (2, 3, 4 unused)
                                (4 unused)

    fills one row per node reached: 4 (0, 1, 2, 3) and 2 (0, 1), so 1.5 s; alone, request 1's build is 0.5 s; an
    empty or unconstrained batch walks nothing: 0 s. Beside regex matchers (real xgrammar work, which this clock does
    not see) the build took 0.25 s per host fill."""
    clock = FakeTime()
    monkeypatch.setattr(mask_mod, "time", clock)
    builder = StrategyMaskBuilder(strategy=strategy, threads=1, clock=clock.perf_counter,
                              native=native() if with_native else None)
    nxt = torch.tensor([[1, 3, -1, -1, -1], [1, -1, -1, -1, -1]])
    sib = torch.tensor([[-1, 2, -1, -1, -1], [-1, -1, -1, -1, -1]])
    tok = torch.tensor([[0, 11, 12, 13, 14], [0, 21, 22, 23, 24]])
    empty = torch.zeros((0, N), dtype=torch.int64)

    def build(reqs, *tree):
        clock.now += 1000.0  # whatever happened before the call
        return builder.build(reqs, *tree, VOCAB)

    a, b = SlowFills(clock, 0.25), SlowFills(clock, 0.25)
    assert build([MaskRequest(grammar=a), MaskRequest(grammar=b)], nxt, sib, tok).build_s == 1.5
    assert (a.fills, b.fills) == (4, 2)
    assert build([MaskRequest(grammar=SlowFills(clock, 0.25))], nxt[1:], sib[1:], tok[1:]).build_s == 0.5
    assert build([], empty, empty, empty).build_s == 0.0
    assert build([MaskRequest()] * 2, nxt, sib, tok).build_s == 0.0
    matchers, mnxt, msib, mtok = _setup()
    mixed = _reqs(matchers)
    mixed[1] = MaskRequest(grammar=SlowFills(clock, 0.25))
    mixed[2] = MaskRequest(grammar=SlowFills(clock, 0.25))
    got = build(mixed, mnxt, msib, mtok)
    fills = mixed[1].grammar.fills + mixed[2].grammar.fills
    assert got.failed == [] and fills >= 2 and got.build_s == 0.25 * fills
    assert builder.native_walks == (1 if with_native else 0)  # the native module walked the regex rows


def test_shape_errors_name_the_tensors():
    matchers, nxt, sib, tok = _setup()
    reqs = _reqs(matchers)
    with pytest.raises(ValueError, match=r"^retrieve_next_token must be \[batch=2, nodes\], got \(3, 5\)$"):
        TreeMaskBuilder().build(reqs[:2], nxt, sib, tok, VOCAB)
    with pytest.raises(ValueError, match=r"^retrieve_next_token must be \[batch=3, nodes\], got \(15,\)$"):
        TreeMaskBuilder().build(reqs, nxt.reshape(-1), sib, tok, VOCAB)
    with pytest.raises(ValueError, match=r"^verify tree tensors disagree: retrieve_next_token \(3, 5\), "
                                         r"retrieve_next_sibling \(3, 4\), draft_tokens \(3, 5\); expected \[3, 5\] "
                                         r"each \(draft tokens may be flat \[15\]\)$"):
        TreeMaskBuilder().build(reqs, nxt, sib[:, :4], tok, VOCAB)
    with pytest.raises(ValueError, match=r"draft_tokens \(14,\); expected"):
        TreeMaskBuilder().build(reqs, nxt, sib, tok.reshape(-1)[:14], VOCAB)
    with pytest.raises(ValueError, match=r"^unknown mask strategy 'fast'; expected one of auto, lockstep, native, "
                                         r"python$"):
        StrategyMaskBuilder(strategy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^unknown mask strategy 'native'; expected auto or lockstep$"):
        TreeMaskBuilder(strategy="native")  # type: ignore[arg-type]  # the product's builder: a dev-only strategy


class Clock:
    """The builder's injected time source (``TreeMaskBuilder(clock=...)``); ``tick`` seconds pass at every reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now, self.tick = 100.0, tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def test_fill_pool_creation_is_not_counted_against_the_time_limit(monkeypatch):
    """Creating xgrammar's fill thread pool (once per builder) happens before the clock of the time limit starts."""
    clock = Clock()
    real = xgr.BatchGrammarMatcher

    def slow_pool(*args, **kwargs):
        clock.now += 1.0  # a pool start on a loaded host
        return real(*args, **kwargs)

    monkeypatch.setattr(xgr, "BatchGrammarMatcher", slow_pool)
    matchers, nxt, sib, tok = _setup()
    builder = TreeMaskBuilder(strategy="lockstep", threads=1, time_limit_s=0.5, clock=clock.perf_counter)
    got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert got.timed_out == [] and builder.timeouts == 0
    assert torch.equal(got.bitmask, _reference())


@pytest.mark.parametrize("limit,shown", [(0.0123, "12.3"), (0.5, "500.0"), (0.0, "0.0")])
@pytest.mark.parametrize("strategy", ["lockstep", "python"])
def test_time_limit_warning_gives_the_limit(strategy, limit, shown, monkeypatch, caplog):
    """The warning gives the limit in ms (a zero limit is one too); ``timeouts`` counts over the builder's builds."""
    matchers, nxt, sib, tok = _setup()
    # every reading is a second later: the limit is hit
    builder = StrategyMaskBuilder(strategy=strategy, threads=1, time_limit_s=limit, clock=Clock(tick=1.0).perf_counter)
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert sorted(got.timed_out) == [0, 1, 2] and builder.timeouts == 3
    warned = sorted(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert warned == [f"sglang-eagle-overlap: tree mask for request r{i} exceeded {shown} ms; this step it accepts "
                      "only the grammar-masked bonus token" for i in range(3)]
    ref = _reference()
    for i in range(3):
        assert torch.equal(got.bitmask[i * N], ref[i * N]) and bool((got.bitmask[i * N + 1 : (i + 1) * N] == -1).all())
    again = builder.build(_reqs(matchers[:2]), nxt[:2], sib[:2], tok[:2], VOCAB)
    assert sorted(again.timed_out) == [0, 1] and builder.timeouts == 5


@pytest.mark.parametrize("strategy,limit", [("lockstep", 1.5), ("python", 1.5)])
def test_time_limit_after_some_rows_were_built_resets_them(strategy, limit, monkeypatch):
    """The limit is hit after some child rows were filled (a second passes per clock reading; lockstep: after its
    first round of child fills, python: inside request 0's walk): those rows are reset to all-allowed too, only the
    root rows stay exact, and every matcher is back at its entry state."""
    matchers, nxt, sib, tok = _setup()
    before = [G.next_token_bitmask(m, VOCAB) for m in matchers]
    builder = StrategyMaskBuilder(strategy=strategy, threads=1, time_limit_s=limit, clock=Clock(tick=1.0).perf_counter)
    got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert sorted(got.timed_out) == [0, 1, 2]
    assert got.valid_nodes > 3  # rows past the roots were really built before the limit hit
    ref = _reference()
    for i, m in enumerate(matchers):
        assert torch.equal(got.bitmask[i * N], ref[i * N])
        assert bool((got.bitmask[i * N + 1 : (i + 1) * N] == -1).all()), i
        assert torch.equal(G.next_token_bitmask(m, VOCAB), before[i])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_int32_tree_tensors_give_the_same_mask(strategy, caplog):
    """Hosts hand over int32 as well as int64 tree tensors (draft tokens especially); the mask is the same, built on
    the strategy's own path (xgrammar's native walk takes int64 only: no failed attempt and per-request rebuild)."""
    matchers, nxt, sib, tok = _setup()
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = StrategyMaskBuilder(strategy=strategy, threads=1).build(
            _reqs(matchers), nxt.to(torch.int32), sib.to(torch.int32), tok.to(torch.int32), VOCAB)
    assert torch.equal(got.bitmask, _reference()) and got.failed == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_out_of_vocabulary_drafts_stay_on_the_native_path(caplog):
    """Draft tokens < 0 (neutralised drafts are -1) or >= vocab_size are invalid nodes; the native strategy handles
    them itself (no failed batched attempt, no per-request rebuild) and gives the exact walk's rows."""
    matchers, nxt, sib, tok = _setup()
    tok = tok.clone()
    tok[0, 2] = -1  # a root child
    tok[1, 4] = VOCAB + 3  # a grandchild
    tok[2, 1] = VOCAB  # the true continuation itself
    exact = StrategyMaskBuilder(strategy="python").build(_reqs(_setup()[0]), nxt, sib, tok, VOCAB)
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = StrategyMaskBuilder(strategy="native", threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert torch.equal(got.bitmask, exact.bitmask) and got.valid_nodes == exact.valid_nodes
    for row in (2, N + 4, 2 * N + 1, 2 * N + 3):  # the invalid nodes (and the child of one)
        assert bool((got.bitmask[row] == -1).all()), row


def test_early_returns_measure_their_build_time(monkeypatch):
    """``build_s`` is the call's own span on ``time.perf_counter`` for the early returns too (an empty batch, a batch
    without a constrained request); here a ``perf_counter`` that moves 0.25 s per reading."""
    readings = itertools.count()
    monkeypatch.setattr(mask_mod, "time", SimpleNamespace(perf_counter=lambda: 0.25 * next(readings),
                                                          thread_time=time.thread_time))
    _, nxt, sib, tok = _setup()
    empty = torch.zeros((0, N), dtype=torch.int64)
    assert TreeMaskBuilder(threads=1).build([], empty, empty, empty, VOCAB).build_s == 0.25
    free = TreeMaskBuilder(threads=1).build([MaskRequest()] * 3, nxt, sib, tok, VOCAB)
    assert free.bitmask is None and free.build_s == 0.25


class NativeWalkSpy(xgr.GrammarMatcher):
    """A real matcher that records the time threshold the native strategy gives xgrammar's ``traverse_draft_tree``;
    ``report_timeout``: that walk reports a time-out after filling its rows (xgrammar's own timer runs on real time,
    not on the builder's clock); ``fail``: it raises (xgrammar failing inside the native walk)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.thresholds = []
        self.report_timeout = False
        self.fail = False

    def traverse_draft_tree(self, nxt, sib, tok, bitmask, time_threshold=-1.0, *args, **kwargs) -> bool:
        self.thresholds.append(time_threshold)
        if self.fail:
            raise RuntimeError("boom: native walk")
        done = super().traverse_draft_tree(nxt, sib, tok, bitmask, time_threshold, *args, **kwargs)
        return False if self.report_timeout else done


def _warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_native_walk_gets_the_time_left_as_xgrammars_threshold():
    """The native strategy gives xgrammar's ``traverse_draft_tree`` the time left until the deadline (on the builder's
    clock); without a time limit a threshold <= 0, which xgrammar reads as none."""
    matchers, nxt, sib, tok = _setup(NativeWalkSpy)
    got = StrategyMaskBuilder(strategy="native", threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert torch.equal(got.bitmask, _reference())
    assert [len(m.thresholds) for m in matchers] == [1, 1, 1] and all(m.thresholds[0] <= 0 for m in matchers)
    matchers, nxt, sib, tok = _setup(NativeWalkSpy)
    builder = StrategyMaskBuilder(strategy="native", threads=1, time_limit_s=30.0, clock=Clock().perf_counter)
    got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert torch.equal(got.bitmask, _reference()) and got.timed_out == []
    assert [m.thresholds for m in matchers] == [[30.0]] * 3  # the clock is frozen: the whole limit is left


def test_native_walk_timed_out_by_xgrammar_keeps_the_root_row_only(caplog):
    """xgrammar's timer ends request 1's native walk (``traverse_draft_tree`` returns False after writing rows): the
    request is reported as timed out -- not as a failed walk to rebuild --, its root row is exact, its other rows are
    all-allowed, its matcher is unchanged, and the other requests' rows are exact."""
    matchers, nxt, sib, tok = _setup(NativeWalkSpy)
    matchers[1].report_timeout = True
    before = [G.next_token_bitmask(m, VOCAB) for m in matchers]
    builder = StrategyMaskBuilder(strategy="native", threads=1, time_limit_s=30.0, clock=Clock().perf_counter)
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = builder.build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert got.timed_out == [1] and builder.timeouts == 1 and got.failed == []
    assert _warnings(caplog) == ["sglang-eagle-overlap: tree mask for request r1 exceeded 30000.0 ms; this step it "
                                 "accepts only the grammar-masked bonus token"]
    ref = _reference()
    assert torch.equal(got.bitmask[N], ref[N]) and bool((got.bitmask[N + 1 : 2 * N] == -1).all())
    assert torch.equal(got.bitmask[:N], ref[:N]) and torch.equal(got.bitmask[2 * N :], ref[2 * N :])
    for m, b in zip(matchers, before):
        assert torch.equal(G.next_token_bitmask(m, VOCAB), b)


def test_native_walk_broken_by_one_matcher_is_redone_with_exact_rows(caplog):
    """xgrammar raises inside the last request's native walk, after the builder zeroed that request's rows for it: the
    per-request rebuild walks it exactly, and its rows are the exact walk's (the zeroed rows of its invalid nodes are
    all-allowed again); the warning names the error."""
    matchers, nxt, sib, tok = _setup(NativeWalkSpy)
    matchers[2].fail = True
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = StrategyMaskBuilder(strategy="native", threads=1).build(_reqs(matchers), nxt, sib, tok, VOCAB)
    assert got.failed == [] and got.timed_out == [] and matchers[2].thresholds  # it failed where intended
    ref = _reference()
    assert bool((ref[2 * N :] == -1).all(dim=1).any())  # request 2 has rows the exact walk leaves all-allowed
    assert torch.equal(got.bitmask, ref) and got.valid_nodes == _valid_rows(ref)
    assert _warnings(caplog) == ["sglang-eagle-overlap: native tree mask build failed (RuntimeError: boom: native "
                                 "walk); rebuilding request by request"]


class UncheckedGrammar(_DepthGrammar):
    """A host grammar whose ``accept_token`` takes any token (SGLang's outlines grammar object advances its FSM without
    checking) and whose rows allow only the tokens of ``allowed``."""

    def __init__(self, allowed, vocab: int) -> None:
        self.row = torch.zeros(bitmask_width(vocab), dtype=torch.int32)
        for t in allowed:
            self.row[t >> 5] |= 1 << (t & 31)
        self.accepted = []
        self.depth = 0

    def accept_token(self, token: int) -> None:
        self.accepted.append(token)
        self.depth += 1

    def fill_vocab_mask(self, vocab_mask, idx: int) -> None:
        vocab_mask[idx] = self.row


def test_a_node_is_valid_only_if_its_parents_row_allows_its_token():
    """Validity is decided by the parent's row (SGLang's ``traverse_tree``), not by whether the grammar object takes
    the token: tree 0 - 1 / 0 - 2 with node 2's token outside the rows -- node 2 stays -1 and is never fed."""
    g = UncheckedGrammar(allowed=[5, 40], vocab=64)
    nxt = torch.tensor([[1, -1, -1]])
    sib = torch.tensor([[-1, 2, -1]])
    tok = torch.tensor([[0, 5, 6]])
    got = StrategyMaskBuilder(strategy="python").build([MaskRequest(grammar=g)], nxt, sib, tok, 64)
    assert [bool(torch.equal(got.bitmask[i], g.row)) for i in range(3)] == [True, True, False]
    assert bool((got.bitmask[2] == -1).all()) and got.valid_nodes == 2
    assert g.accepted == [5] and g.depth == 0


def test_host_grammar_rejecting_after_a_rollback_leaves_the_walk_consistent():
    """Tree 0 - 1 - 3 / 0 - 2 / 0 - 4, node 2's token rejected by ``accept_token`` right after the walk rolled back
    from node 3 to the root: node 4 is still walked from the root state, and the grammar ends where it started."""
    g = RejectingOnAccept(bad=12)
    nxt = torch.tensor([[1, 3, -1, -1, -1]])
    sib = torch.tensor([[-1, 2, 4, -1, -1]])
    tok = torch.tensor([[0, 11, 12, 13, 14]])
    got = StrategyMaskBuilder(strategy="python").build([MaskRequest(grammar=g)], nxt, sib, tok, 64)
    assert got.failed == [] and got.valid_nodes == 4 and g.depth == 0
    assert [bool((got.bitmask[i] == -2).all()) for i in range(N)] == [True, True, False, True, True]
    assert bool((got.bitmask[2] == -1).all())


# A 4-token vocabulary in which token 0 is an ordinary character ('!' is id 0 in GPT-2's and Qwen's vocabularies;
# the test tokenizers' id 0 is their EOS) and its grammar ``a!*b``.
TINY_VOCAB = ["!", "a", "b", "</s>"]


@functools.lru_cache(maxsize=None)
def _tiny_grammar():
    info = xgr.TokenizerInfo(TINY_VOCAB, stop_token_ids=[3])
    return xgr.GrammarCompiler(info).compile_regex(r"a!*b")


def _tiny_matcher(prefix):
    m = xgr.GrammarMatcher(_tiny_grammar(), max_rollback_tokens=-1)
    for t in prefix:
        assert m.accept_token(t), t
    return m


def _tiny_row(prefix) -> torch.Tensor:
    """The exact row after ``prefix`` (token ids), from a fresh matcher."""
    return G.next_token_bitmask(_tiny_matcher(prefix), len(TINY_VOCAB))[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_token_zero_is_an_ordinary_token(strategy):
    """Drafts of token id 0 the grammar allows are valid nodes: after "a", tree 0 - 1('!') - 3('!') / 0 - 2('b')."""
    bang, a, b = 0, 1, 2
    nxt = torch.tensor([[1, 3, -1, -1]])
    sib = torch.tensor([[-1, 2, -1, -1]])
    tok = torch.tensor([[a, bang, b, bang]])
    got = StrategyMaskBuilder(strategy=strategy, threads=1).build(
        [MaskRequest(matcher=_tiny_matcher([a]))], nxt, sib, tok, len(TINY_VOCAB))
    want = torch.stack([_tiny_row(p) for p in ([a], [a, bang], [a, b], [a, bang, bang])])
    assert torch.equal(got.bitmask, want) and got.valid_nodes == 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_root_without_drafts_fills_its_root_row_only(strategy):
    """Request 1's root has no child (every link -1) while its padding nodes carry a token its grammar would allow:
    only its root row is filled, and request 0's rows are untouched by it."""
    bang, a, b = 0, 1, 2
    nxt = torch.tensor([[1, 3, -1, -1], [-1, -1, -1, -1]])
    sib = torch.tensor([[-1, 2, -1, -1], [-1, -1, -1, -1]])
    tok = torch.tensor([[a, bang, b, bang], [a, b, b, b]])
    got = StrategyMaskBuilder(strategy=strategy, threads=1).build(
        [MaskRequest(matcher=_tiny_matcher([a])), MaskRequest(matcher=_tiny_matcher([a]))], nxt, sib, tok,
        len(TINY_VOCAB))
    want = torch.stack([_tiny_row(p) for p in ([a], [a, bang], [a, b], [a, bang, bang])])
    assert torch.equal(got.bitmask[:4], want) and torch.equal(got.bitmask[4], _tiny_row([a]))
    assert bool((got.bitmask[5:] == -1).all()) and got.valid_nodes == 5


# -- sparse reset of the reused buffer ------------------------------------------------------------------------------
def _batch(pick, broken_at=None):
    """Rows of :func:`_setup`'s batch chosen by ``pick`` (None: an unconstrained row), the one at ``broken_at`` through
    a grammar whose fill raises (it fails alone)."""
    matchers, nxt, sib, tok = _setup()
    reqs = []
    for j, i in enumerate(pick):
        if i is None:
            reqs.append(MaskRequest(request_id=f"free{j}"))
        elif j == broken_at:
            reqs.append(MaskRequest(grammar=BrokenGrammar(matchers[i], 1), request_id=f"broken{j}"))
        else:
            reqs.append(MaskRequest(matcher=matchers[i], request_id=f"r{j}"))
    rows = [0 if i is None else i for i in pick]
    return reqs, nxt[rows], sib[rows], tok[rows]


SEQUENCE = [  # (rows of _setup's batch, index of a failing row): grows, shrinks, frees rows, fails one
    ([0, 1, 2], None),
    ([None, 1, 2], None),
    ([2, 0], None),
    ([0, 1, 2], 1),
    ([None, None, None], None),
    ([1], None),
    ([0, 1, 2, 0, 1], None),
    ([None, 2, None, 0, None], 3),
    ([0, 1, 2], None),
]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reused_buffer_equals_a_fresh_builders_after_every_build(strategy):
    """One builder through builds of changing batches (rows freed, fewer and more rows, a failing request): every mask
    equals a fresh builder's, so no row the sparse reset skipped keeps a word of an earlier build."""
    builder = StrategyMaskBuilder(strategy=strategy, threads=1)
    for pick, broken in SEQUENCE:
        got = builder.build(*_batch(pick, broken), VOCAB)
        want = StrategyMaskBuilder(strategy=strategy, threads=1).build(*_batch(pick, broken), VOCAB)
        assert [i for i, _ in got.failed] == [i for i, _ in want.failed]
        if want.bitmask is None:
            assert got.bitmask is None
        else:
            assert torch.equal(got.bitmask, want.bitmask), (pick, broken)


def test_only_stale_rows_this_build_did_not_overwrite_are_reset():
    """The reset is sparse and deferred: a build resets, when it ends, the rows the previous build wrote that it did
    not fill itself (a fill overwrites the whole row), and no other row."""
    builder = TreeMaskBuilder(threads=1)
    first = builder.build(*_batch([0, 1, 2]), VOCAB)
    assert builder.reset_rows == 3 * N  # a new buffer: every row it hands out
    written = (first.bitmask != -1).any(dim=1)
    assert first.valid_nodes == int(written.sum()) and 3 <= first.valid_nodes < 3 * N  # roots + valid nodes
    builder.build(*_batch([0, 1, 2]), VOCAB)
    assert builder.reset_rows == 3 * N  # the same rows filled again: nothing to reset
    got = builder.build(*_batch([None, 1, 2]), VOCAB)  # row 0's request is unconstrained now
    assert builder.reset_rows == 3 * N + int(written[:N].sum())  # exactly its rows the first build wrote
    assert bool((got.bitmask[:N] == -1).all())


def test_a_larger_batch_in_the_buffers_spare_capacity_resets_only_its_new_rows():
    """Rows handed out for the first time are reset when first used, once: a batch that grows inside the buffer's
    capacity (2 -> 3 requests: 2 N rows make a buffer of the next power of two, which holds 3 N) resets its new rows
    and nothing it already had (its first two requests fill the same rows as before)."""
    builder = TreeMaskBuilder(threads=1)
    builder.build(*_batch([0, 1]), VOCAB)
    assert builder.reset_rows == 2 * N
    builder.build(*_batch([0, 1, 2]), VOCAB)
    assert builder.allocations == 1 and builder.reset_rows == 3 * N


def test_a_build_that_raises_through_makes_the_next_reset_everything(monkeypatch):
    """A build interrupted after writing rows (an exception the builder does not handle) leaves the buffer unknown:
    the next build resets every row it uses and is exact again."""
    builder = TreeMaskBuilder(threads=1)
    builder.build(*_batch([0, 1, 2]), VOCAB)

    def scribble_then_interrupt(self, requests, rows, nxt, sib, tok, n, vocab, mask, *args, **kwargs):
        mask[:] = 0
        raise KeyboardInterrupt

    monkeypatch.setattr(TreeMaskBuilder, "_lockstep", scribble_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        builder.build(*_batch([0, 1, 2]), VOCAB)
    monkeypatch.undo()
    got = builder.build(*_batch([None, 1]), VOCAB)
    want = TreeMaskBuilder(threads=1).build(*_batch([None, 1]), VOCAB)
    assert torch.equal(got.bitmask, want.bitmask)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reused_buffer_is_exact_when_a_request_terminated_or_has_out_of_vocabulary_drafts(strategy):
    """The rows a terminated request (no row filled) or a request sent down the exact walk (out-of-vocabulary drafts)
    leaves behind are all-allowed, though the same rows held masks in the previous build."""
    import random as _random

    builder = StrategyMaskBuilder(strategy=strategy, threads=1)
    builder.build(*_batch([0, 1, 2]), VOCAB)
    matchers, nxt, sib, tok = _setup()
    doc = list(G.doc_tokens("regex", _random.Random(9), VOCAB))
    matchers[1] = G.matcher("regex", VOCAB, doc)  # terminated: ends with EOS
    assert matchers[1].is_terminated()
    oov = tok.clone()
    oov[2, 1] = VOCAB + 5  # the main path's first node: its subtree, filled last build, is not reached
    for toks in (tok, oov):
        got = builder.build(_reqs(matchers), nxt, sib, toks, VOCAB)
        want = StrategyMaskBuilder(strategy=strategy, threads=1).build(_reqs(matchers), nxt, sib, toks, VOCAB)
        assert torch.equal(got.bitmask, want.bitmask)
        assert bool((got.bitmask[N : 2 * N] == -1).all())
        builder.build(*_batch([0, 1, 2]), VOCAB)  # the next round starts from a full set of written rows again


@pytest.mark.parametrize("seed", range(4))
def test_root_check_is_the_walkers_first_step(seed):
    """The lockstep walk builds a walker only for requests whose root has a child the root's row allows
    (``_root_child_allowed``); that check must say exactly what the walker's first step finds, for any tree: a child
    in or out of the vocabulary, allowed or not, first child or a later sibling, or no child at all."""
    import random

    rng = random.Random(seed)
    doc = list(G.doc_tokens("nested", rng, VOCAB))
    seen = set()
    for trial in range(60):
        at = rng.randrange(len(doc) - 1)
        m = G.matcher("nested", VOCAB, doc[:at])
        row = G.next_token_bitmask(m, VOCAB).reshape(1, -1).clone()
        n = rng.randint(1, 6)
        # A root with k children (a sibling chain), each a valid, a rejected or an out-of-vocabulary token.
        k = rng.randint(0, n - 1)
        nxt, sib = [-1] * n, [-1] * n
        if k:
            nxt[0] = 1
            for c in range(1, k):
                sib[c] = c + 1
        tok = [doc[at]] + [rng.choice([doc[at], rng.randrange(VOCAB), -1, VOCAB + 3]) for _ in range(n - 1)]
        mask_np = row.expand(n, -1).contiguous().numpy()
        walker = mask_mod._Walker(m, nxt, sib, tok, 0, VOCAB, mask_np, 0)
        first = walker.step()
        walker.abandon()
        allowed = mask_mod._root_child_allowed(nxt, sib, tok, mask_np[0], VOCAB)
        assert allowed == (first >= 0), (nxt, sib, tok)
        seen.add(allowed)
    assert seen == {True, False}


def test_root_children_its_row_rejects_are_skipped_inside_the_batched_walk(caplog):
    """The lockstep walk's shortcut at the roots (a request whose root allows none of its children gets no walker)
    reads past a rejected first child to its siblings: the root's first child is the token one past the vocabulary
    (the row has no bit for it: 32000 tokens fill the row's 1000 words exactly), its second a token the grammar
    forbids, its third the document's next token, whose row is filled. The batched walk does it all -- no warning, no
    request-by-request rebuild -- and the mask is the exact walk's."""
    doc = G.doc_tokens("regex", random.Random(3), VOCAB)
    pos = 2
    m = G.matcher("regex", VOCAB, list(doc[:pos]))
    root_row = G.next_token_bitmask(m, VOCAB).view(-1)
    forbidden = next(t for t in range(VOCAB) if not (int(root_row[t >> 5]) >> (t & 31)) & 1)
    assert VOCAB % 32 == 0 and bitmask_width(VOCAB) == VOCAB // 32
    nxt = torch.tensor([[1, -1, -1, -1]])
    sib = torch.tensor([[-1, 2, 3, -1]])
    tok = torch.tensor([[0, VOCAB, forbidden, doc[pos]]])
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = TreeMaskBuilder(strategy="lockstep", threads=1).build([MaskRequest(matcher=m)], nxt, sib, tok, VOCAB)
    assert _warnings(caplog) == [] and not got.failed and not got.timed_out
    assert torch.equal(got.bitmask[0], root_row)
    assert bool((got.bitmask[1:3] == -1).all())
    m.accept_token(doc[pos])
    assert torch.equal(got.bitmask[3], G.next_token_bitmask(m, VOCAB).view(-1)) and got.valid_nodes == 2


def test_a_batch_of_terminated_grammars_has_no_valid_node():
    """Every request's grammar has terminated (its document and EOS fed): the lockstep walk fills no row, not even a
    root, and counts no valid node."""
    ms = [G.matcher("regex", VOCAB, list(G.doc_tokens("regex", random.Random(s), VOCAB))) for s in (1, 2)]
    assert all(m.is_terminated() for m in ms)
    nxt = torch.tensor([[1, -1, -1]] * 2)
    sib = torch.tensor([[-1, 2, -1]] * 2)
    tok = torch.tensor([[0, 5, 6]] * 2)
    got = TreeMaskBuilder(strategy="lockstep", threads=1).build(_reqs(ms), nxt, sib, tok, VOCAB)
    assert got.valid_nodes == 0 and not got.timed_out and bool((got.bitmask == -1).all())


def test_a_mask_batch_builds_the_mask_of_its_rows():
    """``MaskBatch.of`` keeps every row, in order (its index lists beside them), and a build given the batch is the
    build given the plain list -- a host grammar's row included, which the build reads through the batch."""
    from sglang_eagle_overlap.core.mask import MaskBatch

    matchers, nxt, sib, tok = _setup()
    rows = _reqs(matchers[:2]) + [MaskRequest(grammar=BrokenGrammar(matchers[2], ok_fills=10**6), request_id="host")]
    batch = MaskBatch.of(rows)
    assert list(batch) == rows and (batch.native, batch.generic) == ([0, 1], [2])
    want = TreeMaskBuilder(threads=1).build(rows, nxt, sib, tok, VOCAB).bitmask.clone()
    got = TreeMaskBuilder(threads=1).build(batch, nxt, sib, tok, VOCAB)
    assert not got.failed and torch.equal(got.bitmask, want)
