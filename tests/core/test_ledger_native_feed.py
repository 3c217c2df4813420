"""AcceptLedger's native feed (``advance(..., matcher=, on_feed=)``): a run fed straight to the matcher
inside a grammar wrapper has the outcome the wrapper path has, never offers a token to a terminated matcher (xgrammar
logs a warning for each), checks termination once per token, and reports each fresh feed -- never a replay -- to
``on_feed``."""

from __future__ import annotations

import random

import pytest

from sglang_eagle_overlap.core.ledger import AcceptLedger
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.steps import feed_one

VOCAB = 32000


class CountingMatcher:
    """A real xgrammar matcher that counts its calls and fails the test on an accept after termination."""

    def __init__(self, m) -> None:
        self.m, self.accepts, self.checks = m, 0, 0

    def accept_token(self, token: int) -> bool:
        assert not self.m.is_terminated(), f"token {token} offered to a terminated matcher"
        self.accepts += 1
        return bool(self.m.accept_token(token))

    def is_terminated(self) -> bool:
        self.checks += 1
        return bool(self.m.is_terminated())


class Wrapper:
    """A grammar object over a matcher, as SGLang's XGrammarGrammar: its accept raises on a rejected token."""

    def __init__(self, m) -> None:
        self.matcher = m

    def accept_token(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise ValueError(f"Tokens not accepted: {token}")

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def _doc(seed: int = 5):
    return list(G.doc_tokens("regex", random.Random(seed), VOCAB))  # ends with EOS: the grammar terminates on it


def _runs(doc, cut):
    """``doc`` split at the positions ``cut``, plus a run past the end (tokens after termination)."""
    bounds = [0] + list(cut) + [len(doc)]
    return [doc[a:b] for a, b in zip(bounds, bounds[1:]) if b > a] + [[doc[0], doc[1]]]


@pytest.mark.parametrize("cut", [(1, 3, 6), (2,), (4, 5)])
def test_native_feed_has_the_wrapper_paths_outcomes(cut):
    doc = _doc()
    cut = tuple(c for c in cut if c < len(doc) - 1) + (len(doc) - 2,)  # the EOS ends a run of two, one token early
    via_wrapper, native = AcceptLedger(), AcceptLedger()
    w = Wrapper(G.matcher("regex", VOCAB))
    m = CountingMatcher(G.matcher("regex", VOCAB))
    seen = []
    pos = 0
    for run in _runs(doc, cut):
        want = feed_one(via_wrapper, "r", w, pos, run)
        got = feed_one(native, "r", object(), pos, run, matcher=m, on_feed=lambda g, o: seen.append(o))
        assert got == want, (pos, run)
        assert seen[-1] is got
        pos += len(got.retained)
    assert native.tokens_fed == via_wrapper.tokens_fed == len(doc)
    assert m.m.is_terminated()


def test_termination_is_checked_once_per_token_and_once_per_fresh_entry():
    doc = _doc()
    m = CountingMatcher(G.matcher("regex", VOCAB))
    grammar = object()
    ledger = AcceptLedger()
    feed_one(ledger, "r", grammar, 0, doc[:3], matcher=m)
    assert (m.accepts, m.checks) == (3, 1 + 3)  # first sight: one check before the run
    feed_one(ledger, "r", grammar, 3, doc[3:5], matcher=m)
    assert (m.accepts, m.checks) == (5, 4 + 2)  # the ledger's own last run left it live: no check before
    feed_one(ledger, "r", grammar, 3, doc[3:5], matcher=m)  # a replay calls nothing
    assert (m.accepts, m.checks) == (5, 6)
    other = object()  # the host rebuilt the grammar object: its state is unknown again
    feed_one(ledger, "r", other, 5, doc[5:6], matcher=m)
    assert (m.accepts, m.checks) == (6, 6 + 1 + 1)


def test_a_rejected_token_stops_the_run_and_the_next_run_checks_again():
    doc = _doc()
    m = CountingMatcher(G.matcher("regex", VOCAB))
    grammar = object()
    fed = []
    ledger = AcceptLedger()
    bad = 0 if doc[2] != 0 else 1
    out = feed_one(ledger, "r", grammar, 0, [doc[0], doc[1], bad, doc[2]], matcher=m,
                         on_feed=lambda g, o: fed.append((g, o)))
    assert out.retained == (doc[0], doc[1]) and not out.terminated
    assert out.error == f"grammar rejected token {bad} at output position 2"
    assert fed == [(grammar, out)] and ledger.consumed("r") == 2
    checks = m.checks
    again = feed_one(ledger, "r", grammar, 2, [doc[2]], matcher=m)  # after a rejection the state is re-checked
    assert again.retained == (doc[2],) and m.checks == checks + 2


def test_a_grammar_terminated_before_the_run_is_offered_nothing():
    doc = _doc()
    m = CountingMatcher(G.matcher("regex", VOCAB, doc))
    assert m.m.is_terminated()
    fed = []
    out = feed_one(AcceptLedger(), "r", object(), len(doc), [doc[0]], matcher=m, on_feed=lambda g, o: fed.append(o))
    assert out.retained == () and out.terminated and out.error is None and m.accepts == 0
    assert fed == [out]


def test_a_matcher_terminated_behind_the_ledgers_back_is_terminated_not_rejected():
    """The live shortcut trusts the ledger's own last run; if something else fed the matcher to its end meanwhile,
    the refused first token is found terminated (as the wrapper path would report it), not a rejection that aborts."""
    doc = _doc()
    raw = G.matcher("regex", VOCAB)
    ledger = AcceptLedger()
    feed_one(ledger, "r", object(), 0, doc[:2], matcher=raw)
    for t in doc[2:]:  # fed elsewhere, same positions not reported to the ledger
        assert raw.accept_token(t)
    assert raw.is_terminated()
    out = feed_one(ledger, "r", object(), 2, [doc[2]], matcher=raw)  # a rebuilt grammar object: checked first anyway
    assert out.terminated and out.error is None
    grammar = object()
    ledger2 = AcceptLedger()
    raw2 = G.matcher("regex", VOCAB)
    feed_one(ledger2, "s", grammar, 0, doc[:2], matcher=raw2)
    for t in doc[2:]:
        assert raw2.accept_token(t)
    out2 = feed_one(ledger2, "s", grammar, 2, [doc[2]], matcher=raw2)  # live shortcut taken: the refusal is examined
    assert out2.retained == () and out2.terminated and out2.error is None
