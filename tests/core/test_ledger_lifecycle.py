"""AcceptLedger lifecycle: bounded by ``retain`` and its history, re-anchored when the host rebuilds a request's
matcher, and what a rejected token leaves behind."""

from __future__ import annotations

import pytest

from sglang_eagle_overlap.core.ledger import AcceptLedger, LedgerConflictError, LedgerGapError
from sglang_eo_dev.helpers.grammars import Recorder
from sglang_eo_dev.helpers.steps import feed_one


def test_retain_forgets_everything_not_live():
    ledger = AcceptLedger()
    grammars = {k: Recorder() for k in ("a", "b", "c")}
    for k, g in grammars.items():
        feed_one(ledger, k, g, 0, [1, 2])
    assert ledger.retain({"b"}) == 2
    assert len(ledger) == 1 and "b" in ledger and "a" not in ledger
    # "b" keeps its history: a replay feeds nothing
    feed_one(ledger, "b", grammars["b"], 0, [1, 2])
    assert grammars["b"].fed == [1, 2]


def test_rebuilt_matcher_is_reanchored_not_a_gap():
    ledger = AcceptLedger()
    old, new = Recorder(), Recorder()
    feed_one(ledger, "r", old, 0, [1, 2, 3])
    # Same request, same position chain, but the host rebuilt its grammar object (fed elsewhere up to position 5):
    out = feed_one(ledger, "r", new, 5, [7])
    assert out.retained == (7,) and new.fed == [7] and old.fed == [1, 2, 3]
    assert ledger.consumed("r") == 6
    # The same object skipping positions is still a gap.
    with pytest.raises(LedgerGapError):
        feed_one(ledger, "r", new, 9, [8])


def test_reset_keeps_the_grammar_identity():
    ledger = AcceptLedger()
    g = Recorder()
    feed_one(ledger, "r", g, 0, [1, 2])
    ledger.reset("r", 1)  # host rolled the matcher back one token
    feed_one(ledger, "r", g, 1, [5])
    assert g.fed == [1, 2, 5] and ledger.consumed("r") == 2
    # Still the same matcher after the reset: skipping positions is a gap, not a rebuilt matcher.
    ledger.reset("r", 1)
    with pytest.raises(LedgerGapError):
        feed_one(ledger, "r", g, 3, [6])
    assert g.fed == [1, 2, 5]


@pytest.mark.parametrize("history", [None, 1, 3])
def test_history_keeps_the_latest_runs_only(history):
    """Outcomes are remembered for the last ``history`` runs of a request (8 by default); older replays conflict."""
    ledger = AcceptLedger() if history is None else AcceptLedger(history=history)
    keep = 8 if history is None else history
    g = Recorder()
    for start in range(keep + 2):
        feed_one(ledger, "r", g, start, [start + 100])
    remembered = [s for s in range(keep + 2) if ledger.outcome("r", s) is not None]
    assert remembered == list(range(2, keep + 2))
    assert ledger.outcome("r", keep + 1).retained == (keep + 101,)
    assert feed_one(ledger, "r", g, keep + 1, [keep + 101]).start == keep + 1  # a remembered replay
    assert len(g.fed) == keep + 2  # ... fed nothing
    with pytest.raises(LedgerConflictError, match="no outcome is remembered"):
        feed_one(ledger, "r", g, 1, [101])


def test_outcome_and_consumed_of_unknown_requests():
    ledger = AcceptLedger()
    assert ledger.consumed("nobody") is None and ledger.outcome("nobody", 0) is None
    feed_one(ledger, "r", Recorder(), 3, [1])
    assert ledger.outcome("r", 0) is None and ledger.outcome("r", 3).tokens == (1,)
    assert ledger.retain(["r", "other"]) == 0 and len(ledger) == 1


def test_reset_of_an_unknown_request_anchors_it():
    ledger = AcceptLedger()
    ledger.reset("new", 4)
    assert ledger.consumed("new") == 4 and "new" in ledger
    g = Recorder()
    # First sight of its grammar object: re-anchored at the asked position (the host's), not a gap.
    assert feed_one(ledger, "new", g, 6, [1]).retained == (1,) and ledger.consumed("new") == 7


class Rejecting(Recorder):
    """Rejects ``bad`` by returning False (a bare xgrammar matcher) or raising ValueError (SGLang's grammar)."""

    def __init__(self, bad: int, raises: bool) -> None:
        super().__init__()
        self.bad, self.raises = bad, raises

    def accept_token(self, token: int) -> bool:
        if token == self.bad:
            if self.raises:
                raise ValueError("no such transition")
            return False
        return super().accept_token(token)


@pytest.mark.parametrize("raises", [False, True])
def test_rejection_stops_the_run_and_names_token_and_position(raises):
    ledger = AcceptLedger()
    g = Rejecting(bad=7, raises=raises)
    feed_one(ledger, "r", g, 0, [1, 2])
    out = feed_one(ledger, "r", g, 2, [3, 7, 4])
    assert out.retained == (3,) and not out.terminated and g.fed == [1, 2, 3]
    expected = "grammar rejected token 7 at output position 3"
    assert out.error == (expected + ": no such transition" if raises else expected)
    assert ledger.consumed("r") == 3 and ledger.tokens_fed == 3


@pytest.mark.parametrize("raises", [False, True])
def test_kept_whole_answers_a_whole_clean_run_and_reads_only(raises):
    ledger = AcceptLedger()
    g = Rejecting(bad=7, raises=raises)
    assert ledger.replay_whole("r", 0, [1, 2]) is None  # an unknown request
    feed_one(ledger, "r", g, 0, [1, 2])
    assert ledger.replay_whole("r", 0, [1, 2]) == (1, 2)
    assert ledger.replay_whole("r", 0, (1, 2)) == (1, 2)  # any sequence of the same ints
    assert ledger.replay_whole("r", 0, [1]) is None and ledger.replay_whole("r", 0, [1, 3]) is None  # other tokens
    assert ledger.replay_whole("r", 2, [3]) is None  # not fed yet
    feed_one(ledger, "r", g, 2, [3, 7, 4])  # cut by the rejection of 7
    assert ledger.replay_whole("r", 2, [3, 7, 4]) is None and ledger.outcome("r", 2).retained == (3,)
    # read only: nothing fed, nothing counted, the position unchanged
    assert g.fed == [1, 2, 3] and ledger.replays == 0 and ledger.consumed("r") == 3 and ledger.tokens_fed == 3
