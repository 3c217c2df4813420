"""AcceptLedger lifecycle: bounded by ``retain``, and re-anchored when the host rebuilds a request's matcher."""

from __future__ import annotations

import pytest

from sglang_eagle_overlap.core import AcceptLedger, LedgerGapError


class Recorder:
    """A grammar that accepts everything and records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.fed.append(token)
        return True

    def is_terminated(self) -> bool:
        return False


def test_retain_forgets_everything_not_live():
    ledger = AcceptLedger()
    grammars = {k: Recorder() for k in ("a", "b", "c")}
    for k, g in grammars.items():
        ledger.advance(k, g, 0, [1, 2])
    assert ledger.retain({"b"}) == 2
    assert len(ledger) == 1 and "b" in ledger and "a" not in ledger
    # "b" keeps its history: a replay feeds nothing
    ledger.advance("b", grammars["b"], 0, [1, 2])
    assert grammars["b"].fed == [1, 2]


def test_rebuilt_matcher_is_reanchored_not_a_gap():
    ledger = AcceptLedger()
    old, new = Recorder(), Recorder()
    ledger.advance("r", old, 0, [1, 2, 3])
    # Same request, same position chain, but the host rebuilt its grammar object (fed elsewhere up to position 5):
    out = ledger.advance("r", new, 5, [7])
    assert out.retained == (7,) and new.fed == [7] and old.fed == [1, 2, 3]
    assert ledger.consumed("r") == 6
    # The same object skipping positions is still a gap.
    with pytest.raises(LedgerGapError):
        ledger.advance("r", new, 9, [8])


def test_reset_keeps_the_grammar_identity():
    ledger = AcceptLedger()
    g = Recorder()
    ledger.advance("r", g, 0, [1, 2])
    ledger.reset("r", 1)  # host rolled the matcher back one token
    ledger.advance("r", g, 1, [5])
    assert g.fed == [1, 2, 5] and ledger.consumed("r") == 2
