"""``LedgerPlan``'s less travelled paths against what they promise (written for the survivors of a mutation
run over ``core/ledger.py``, ``tests/core/MUTANTS.md``): a matcher that raises inside the native feed, two runs of one
request in one ``add_rows`` call, rows fed in Python next to queued ones, slots and sources over several calls, the
host-copy event, and the pure mapping from the native call's states to outcomes."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.core import RowRun, Run
from sglang_eagle_overlap.core.ledger import AcceptLedger
from sglang_eagle_overlap.core.ledger import FeedOutcome, LedgerGapError, ResultRuns, native_outcome
from sglang_eagle_overlap.core.native import FED, FEED_ERROR, NOT_FED, REJECTED, TERMINATED, TERMINATED_BEFORE
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.devices import CountingEvent, DeviceTensor, result_runs
from sglang_eo_dev.helpers.native import WrongHandles, native

VOCAB = 32000


def _doc(seed: int) -> List[int]:
    return list(G.doc_tokens("regex", random.Random(seed), VOCAB))


def test_a_matcher_that_raises_in_the_native_feed_gets_its_message_and_a_later_run_of_it_is_not_fed():
    """FEED_ERROR: the run keeps the tokens consumed before the raise (none here), is neither terminated nor silent,
    and its message names the token, the output position and the native error; a run of the same (raising) matcher
    later in the same call (NOT_FED) is reported as never fed; the other requests are fed as without them, and
    ``on_feed`` sees every outcome."""
    doc = _doc(1)
    bad = G.matcher("regex", VOCAB)
    good = G.matcher("regex", VOCAB)
    led = AcceptLedger(native=WrongHandles([bad], VOCAB))  # type: ignore[arg-type]
    seen: List[FeedOutcome] = []
    out = led.feed([Run("a", object(), bad, 3, doc[3:5]), Run("g", object(), good, 0, doc[:2]),
                            Run("b", object(), bad, 7, doc[7:8])], lambda g, o: seen.append(o))
    a, g, b = out
    assert isinstance(a, FeedOutcome) and isinstance(b, FeedOutcome)
    assert (a.start, a.tokens, a.retained, a.terminated) == (3, tuple(doc[3:5]), (), False)
    assert a.error is not None and a.error.startswith(f"grammar raised at token {doc[3]} at output position 3: ")
    assert "Mismatched type" in a.error and "CompiledGrammar" in a.error  # the native call's own message
    assert (b.start, b.tokens, b.retained, b.terminated) == (7, (doc[7],), (), False)
    assert b.error == "not fed: an earlier run of the same matcher raised"
    assert g == FeedOutcome(0, tuple(doc[:2]), tuple(doc[:2]), False, None)
    assert seen == [a, g, b] and led.consumed("a") == 3 and led.consumed("b") == 7 and led.consumed("g") == 2


@pytest.mark.parametrize("state, kept, want", [
    (FED, 3, ((5, 6, 7), False, None)),
    (TERMINATED, 2, ((5, 6), True, None)),
    (TERMINATED_BEFORE, 0, ((), True, None)),
    (REJECTED, 1, ((5,), False, "grammar rejected token 6 at output position 11")),
    (FEED_ERROR, 2, ((5, 6), False, "grammar raised at token 7 at output position 12: boom")),
    (NOT_FED, 0, ((), False, "not fed: an earlier run of the same matcher raised")),
])
def test_each_native_state_maps_to_the_outcome_of_the_python_feed(state, kept, want):
    """``native_outcome`` of the run (5, 6, 7) at output position 10: retained prefix, termination and error message
    per state, as ``_feed_matcher`` words them for the same matcher calls."""
    got = native_outcome(10, (5, 6, 7), kept, state, "boom")
    assert got == FeedOutcome(10, (5, 6, 7), *want)


def test_two_runs_of_one_request_in_one_add_rows_call_are_fed_in_order_and_the_rows_after_them_still_queue():
    """The second run of a request whose first waits makes the plan feed first (its check needs the first's outcome);
    the rows after it queue again, reading the same result under its new index. Same outcomes, matcher states and
    counters as ``feed`` in Python."""
    docs = [_doc(s) for s in (2, 3, 4)]
    runs = [docs[0][:2], docs[0][2:4], docs[1][:3], docs[2][:1]]
    keys, starts = ["x", "x", "y", "z"], [0, 2, 0, 0]
    m_py = {k: G.matcher("regex", VOCAB) for k in "xyz"}
    m_cx = {k: G.matcher("regex", VOCAB) for k in "xyz"}
    grammars = {k: object() for k in "xyz"}
    want = AcceptLedger().feed([Run(k, grammars[k], m_py[k], s, r) for k, s, r in zip(keys, starts, runs)])
    led = AcceptLedger(native=native())
    plan = led.plan()
    result = result_runs(runs)
    plan.add_rows([RowRun(k, grammars[k], m_cx[k], s, row) for row, (k, s) in enumerate(zip(keys, starts))], result)
    # x's first run was fed when its second came; the second (tokens packed), y and z wait
    assert len(plan) == 3 and plan.sources() == [result]
    plan.feed()
    assert plan.out == want and [len(o.retained) for o in plan.out] == [2, 2, 3, 1]
    for k in "xyz":
        assert torch.equal(G.next_token_bitmask(m_cx[k], VOCAB), G.next_token_bitmask(m_py[k], VOCAB))
    assert led.tokens_fed == 8


def test_a_request_in_two_results_of_one_plan_leaves_the_rows_after_it_queued_and_fed():
    """0.5.16's barrier with two queued results that both hold a request (one ``add_rows`` per result): the second
    result's run of it makes the plan feed the first's, and every row after it in that call is still queued and fed
    -- none is left with its placeholder, every matcher is where the Python feed puts it."""
    docs = [_doc(s) for s in (13, 14, 15)]
    m_py = {k: G.matcher("regex", VOCAB) for k in "xyz"}
    m_cx = {k: G.matcher("regex", VOCAB) for k in "xyz"}
    grammars = {k: object() for k in "xyz"}
    first = [("x", 0, docs[0][:2]), ("y", 0, docs[1][:1])]
    second = [("x", 2, docs[0][2:3]), ("z", 0, docs[2][:2]), ("y", 1, docs[1][1:3])]
    want = AcceptLedger().feed([Run(k, grammars[k], m_py[k], s, r) for k, s, r in first + second])
    plan = AcceptLedger(native=native()).plan()
    slots = [plan.add_rows([RowRun(k, grammars[k], m_cx[k], s, row) for row, (k, s, _) in enumerate(part)],
                           result_runs([r for _, _, r in part])) for part in (first, second)]
    assert slots == [range(0, 2), range(2, 5)]
    plan.feed()
    assert plan.out == want and all(o.error is None for o in plan.out)
    for k in "xyz":
        assert torch.equal(G.next_token_bitmask(m_cx[k], VOCAB), G.next_token_bitmask(m_py[k], VOCAB))


class _Counting(xgr.GrammarMatcher):
    """A matcher subclass: fed in Python (native calls would bypass an override)."""


def test_rows_fed_in_python_report_through_on_feed_and_slots_and_sources_span_several_calls():
    """In one plan: a result on the host whose fresh runs queue but for a row whose matcher is a subclass (fed at once,
    in Python), then a result whose tensors are not host tensors (its tokens read at once and packed). ``on_feed`` gets every fresh run with its own
    grammar, each call's slots follow the previous call's, and ``sources`` lists a result once however many rows
    read it."""
    docs = [_doc(s) for s in (5, 6, 7, 8)]
    grammars = [object() for _ in docs]
    plain = [G.matcher("regex", VOCAB) for _ in range(3)]
    sub = G.matcher("regex", VOCAB, cls=_Counting)
    led = AcceptLedger(native=native())
    plan = led.plan()
    seen: List[Any] = []
    on_feed = lambda g, o: seen.append((g, o))  # noqa: E731
    host = result_runs([docs[0][:2], docs[1][:1], docs[3][:3]])
    first = plan.add_rows([RowRun("a", grammars[0], plain[0], 0, 0), RowRun("b", grammars[1], plain[1], 0, 1),
                           RowRun("d", grammars[3], sub, 0, 2)], host, on_feed)
    assert first == range(0, 3) and len(plan) == 2 and plan.sources() == [host]
    assert [g for g, _ in seen] == [grammars[3]] and seen[0][1].retained == tuple(docs[3][:3])

    off_host = ResultRuns(DeviceTensor(docs[2][:2] + [0] * 4), DeviceTensor([2]), 6)
    assert not off_host.on_host
    second = plan.add_rows([RowRun("c", grammars[2], plain[2], 0, 0)], off_host, on_feed)
    assert second == range(3, 4) and plan.sources() == [host]
    assert [g for g, _ in seen] == [grammars[3]]  # c waits too: its tokens were read at once and packed
    plan.feed()
    assert sorted((grammars.index(g), o.retained) for g, o in seen) == [
        (0, tuple(docs[0][:2])), (1, tuple(docs[1][:1])), (2, tuple(docs[2][:2])), (3, tuple(docs[3][:3]))]


def test_a_result_read_by_two_calls_is_a_source_once():
    """Two ``add_rows`` calls of one plan on the same result (rows of different requests): the native call gets the
    result once, and both calls' runs are fed from it."""
    docs = [_doc(s) for s in (16, 17)]
    result = result_runs([docs[0][:2], docs[1][:3]])
    plan = AcceptLedger(native=native()).plan()
    plan.add_rows([RowRun("a", object(), G.matcher("regex", VOCAB), 0, 0)], result)
    plan.add_rows([RowRun("b", object(), G.matcher("regex", VOCAB), 0, 1)], result)
    assert plan.sources() == [result] and len(plan.pending()[2]) == 1
    plan.feed()
    assert [o.retained for o in plan.out] == [tuple(docs[0][:2]), tuple(docs[1][:3])]


def test_rows_of_a_plan_without_the_native_module_are_fed_at_once_with_their_grammar_reported():
    docs = [_doc(s) for s in (9, 10)]
    grammars = [object(), object()]
    led = AcceptLedger()
    plan = led.plan()
    seen: List[Any] = []
    slots = plan.add_rows([RowRun("a", grammars[0], G.matcher("regex", VOCAB), 0, 0),
                           RowRun("b", grammars[1], G.matcher("regex", VOCAB), 0, 1)],
                          result_runs([docs[0][:2], docs[1][:3]]), lambda g, o: seen.append((g, o.retained)))
    assert slots == range(0, 2) and len(plan) == 0
    assert seen == [(grammars[0], tuple(docs[0][:2])), (grammars[1], tuple(docs[1][:3]))]


def test_the_host_copy_is_waited_for_before_tokens_are_read_in_python_or_by_the_native_feed():
    doc = _doc(11)
    ev = CountingEvent()
    res = result_runs([doc[:2]], ready=ev)
    assert ev.waits == 0 and res.run(0) == tuple(doc[:2]) and ev.waits == 1
    assert res.run(0) == tuple(doc[:2]) and ev.waits == 1  # read once
    ev2 = CountingEvent()
    plan = AcceptLedger(native=native()).plan()
    plan.add_rows([RowRun("a", object(), G.matcher("regex", VOCAB), 0, 0)], result_runs([doc[:2]], ready=ev2))
    assert ev2.waits == 0 and len(plan) == 1  # queued without reading its tokens
    plan.feed()
    assert ev2.waits >= 1 and plan.out[0].retained == tuple(doc[:2])


def test_which_results_the_native_call_may_read():
    """Host tensors (or anything without a device) only: ids and lengths both."""
    host, meta = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64, device="meta")
    assert ResultRuns(host, host[:2], 2).on_host and ResultRuns([1, 2], None, 1).on_host
    assert not ResultRuns(host, meta[:2], 2).on_host
    assert not ResultRuns(meta, host[:2], 2).on_host and not ResultRuns(meta, None, 1).on_host
    # Not torch: a tensor's ``is_cpu`` flag decides when there is one, else its device's type (an object, or a string
    # as numpy 2 arrays have it)
    assert not ResultRuns(SimpleNamespace(is_cpu=False), None, 1).on_host
    assert ResultRuns(SimpleNamespace(device=SimpleNamespace(type="cpu")), None, 1).on_host
    assert not ResultRuns(SimpleNamespace(device=SimpleNamespace(type="meta")), None, 1).on_host
    assert ResultRuns(SimpleNamespace(device="cpu"), None, 1).on_host
    assert not ResultRuns(SimpleNamespace(device="cuda"), None, 1).on_host


def test_fill_refuses_outcomes_that_do_not_match_the_waiting_runs_and_a_gap_names_its_request():
    doc = _doc(12)
    led = AcceptLedger(native=native())
    plan = led.plan()
    plan.add([Run("a", object(), G.matcher("regex", VOCAB), 0, doc[:2]), Run("b", object(), G.matcher("regex", VOCAB), 0, doc[:1])])
    with pytest.raises(ValueError, match=r"^1 feed outcomes for 2 waiting runs$"):
        plan.fill([2, FED], {}, [2, 1], doc[:3])
    plan = led.plan()
    plan.add([Run("c", object(), G.matcher("regex", VOCAB), 0, doc[:2]), Run("d", object(), G.matcher("regex", VOCAB), 0, doc[:1])])
    with pytest.raises(ValueError, match=r"^1 run lengths for 2 waiting runs$"):  # the native call's own reading
        plan.fill([2, FED, 1, FED], {}, [2], doc[:2])
    g, m = object(), G.matcher("regex", VOCAB)
    gap = led.feed([Run("r9", g, m, 0, doc[:1]), Run("r9", g, m, 4, doc[4:5])])[1]
    assert isinstance(gap, LedgerGapError) and "'r9'" in str(gap)


def test_runs_fed_whole_by_the_native_call_are_booked_as_the_ledger_books_them():
    """``fill``'s common case (a run fed whole, booked in its loop) books what ``AcceptLedger._record`` books: the
    position moves past the run, its tokens are counted, the matcher is known live (the next run of it is packed with
    ``live`` 1, so the native feed skips its termination check) and the history keeps the last ``history`` runs (an
    older one is forgotten)."""
    doc = _doc(13)
    assert len(doc) >= 6
    led = AcceptLedger(history=2, native=native())
    g, m = object(), G.matcher("regex", VOCAB)
    for k in range(3):  # runs of two tokens at 0, 2 and 4, each queued by row of a result
        plan = led.plan()
        plan.add_rows([RowRun("a", g, m, 2 * k, 0)], result_runs([doc[2 * k : 2 * k + 2]]))
        assert plan.pending()[1][0] == (1 if k else 0)  # unknown before the first run, live after each
        plan.feed()
        assert plan.out[0] == FeedOutcome(2 * k, tuple(doc[2 * k : 2 * k + 2]), tuple(doc[2 * k : 2 * k + 2]),
                                             False, None)
    assert led.consumed("a") == 6 and led.tokens_fed == 6
    assert led.outcome("a", 0) is None  # history=2: the run at 0 is forgotten
    assert led.outcome("a", 2) is not None and led.outcome("a", 4) == plan.out[0]


def test_a_run_booked_by_the_native_call_is_a_replay_when_asked_again_at_its_start_even_if_it_moved_nothing():
    """A fresh run is told from a re-ask by the entry's newest start (``_Entry.last``), which ``fill`` books with the
    run: an empty run (it leaves the position where it was) asked again at that position is answered from the history
    as a replay, and neither fed nor reported to ``on_feed`` a second time."""
    doc = _doc(17)
    led = AcceptLedger(native=native())
    g, m = object(), G.matcher("regex", VOCAB)
    fed: List[Any] = []
    on_feed = lambda grammar, outcome: fed.append(outcome)  # noqa: E731
    plan = led.plan()
    plan.add_rows([RowRun("a", g, m, 0, 0)], result_runs([doc[:2]]), on_feed)
    plan.feed()
    empty = ResultRuns(torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32), 2)  # a row of no token
    plan = led.plan()
    plan.add_rows([RowRun("a", g, m, 2, 0)], empty, on_feed)
    assert len(plan) == 1  # fresh: queued for the native call
    plan.feed()
    assert plan.out[0] == FeedOutcome(2, (), (), False, None) and led.consumed("a") == 2
    replays = led.replays
    plan = led.plan()
    plan.add_rows([RowRun("a", g, m, 2, 0)], empty, on_feed)
    assert len(plan) == 0 and led.replays == replays + 1  # answered from the history, not queued again
    plan.feed()
    assert plan.out[0] == FeedOutcome(2, (), (), False, None) and len(fed) == 2 and led.tokens_fed == 2


def test_a_request_first_seen_after_its_first_token_is_fresh_at_that_position():
    """A request the ledger first sees with its first run at output position 1 (its first token was fed before the
    ledger saw it, so its matcher stands after it): the new entry has consumed exactly that token and has no run yet,
    so the run is fresh -- queued for the native feed and fed once, as the Python feed does -- not taken for a replay
    of a run at that position."""
    doc = _doc(41)
    m_py, m_cx = G.matcher("regex", VOCAB, doc[:1]), G.matcher("regex", VOCAB, doc[:1])
    grammar = object()
    want = AcceptLedger().feed([Run("x", grammar, m_py, 1, doc[1:4])])
    led = AcceptLedger(native=native())
    plan = led.plan()
    plan.add_rows([RowRun("x", grammar, m_cx, 1, 0)], result_runs([doc[1:4]]))
    assert len(plan) == 1  # queued: a fresh run
    plan.feed()
    assert plan.out == want and plan.out[0].retained == tuple(doc[1:4]) and led.consumed("x") == 4
    assert torch.equal(G.next_token_bitmask(m_cx, VOCAB), G.next_token_bitmask(m_py, VOCAB))
