"""``AcceptLedger.feed`` / ``GrammarStep.feed`` (a whole result's runs in one ledger call).

The batch call must do, run by run and in order, what an independent reference of the ledger's rules does: the same
outcomes, the same errors (returned for the run in error, raised by ``advance``), the same matcher states, the same
counters -- whatever the batch mixes: fresh runs, replays, conflicting replays, gaps, runs the grammar terminates or rejects,
runs after termination, native and wrapper feeds, rebuilt grammars. ``GrammarStep.feed`` re-anchors only the
runs in error and counts replays only when asked.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Tuple

import pytest

from sglang_eagle_overlap.core import Run
from sglang_eagle_overlap.core import GrammarStep

from sglang_eagle_overlap.core.ledger import AcceptLedger
from sglang_eagle_overlap.core.ledger import FeedOutcome, LedgerConflictError, LedgerError, LedgerGapError
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.steps import feed_one, make_step

VOCAB = 32000


class Wrapper:
    """A grammar object over a matcher, as SGLang's XGrammarGrammar (raises on a rejected token)."""

    def __init__(self, m: Any) -> None:
        self.matcher = m
        self.fed: List[Tuple[int, ...]] = []

    def accept_token(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise ValueError(f"Tokens not accepted: {token}")

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def _record(grammar: Wrapper, outcome: FeedOutcome) -> None:
    grammar.fed.append(outcome.retained)


class World:
    """Requests with a document each, and the same requests twinned for the reference ledger."""

    def __init__(self, seed: int, n: int = 6) -> None:
        self.rng = random.Random(seed)
        self.docs: Dict[str, List[int]] = {}
        self.grammars: Dict[str, Tuple[Wrapper, Wrapper]] = {}
        self.native: Dict[str, bool] = {}
        self.pos: Dict[str, int] = {}
        self.history: Dict[str, List[Tuple[int, List[int]]]] = {}
        for i in range(n):
            kind = ("regex", "nested")[i % 2]
            rid = f"r{i}"
            self.docs[rid] = list(G.doc_tokens(kind, self.rng, VOCAB))
            self.grammars[rid] = (Wrapper(G.matcher(kind, VOCAB)), Wrapper(G.matcher(kind, VOCAB)))
            self.native[rid] = i % 3 != 0
            self.pos[rid] = 0
            self.history[rid] = []

    def batch(self) -> List[Tuple[str, int, List[int]]]:
        """One batch of (rid, start, tokens): mostly the next run of each request, with every kind of odd ask."""
        out = []
        for rid in self.rng.sample(sorted(self.docs), k=len(self.docs)):
            doc, pos, roll = self.docs[rid], self.pos[rid], self.rng.random()
            if roll < 0.12 and self.history[rid]:
                start, toks = self.rng.choice(self.history[rid])
                out.append((rid, start, toks))  # a replay
            elif roll < 0.18 and self.history[rid]:
                start, toks = self.history[rid][-1]
                out.append((rid, start, toks + [7]))  # a conflicting replay
            elif roll < 0.22:
                out.append((rid, pos + 2, doc[pos:pos + 1] or [5]))  # a gap
            elif roll < 0.27:
                bad = next(t for t in range(3, VOCAB) if t not in doc)
                out.append((rid, pos, [bad]))  # a rejected token (the request is aborted by its host)
            else:
                k = self.rng.randint(1, 4)
                toks = doc[pos:pos + k] or [doc[0]]  # past the end: tokens after termination
                out.append((rid, pos, toks))
                self.history[rid].append((pos, toks))
                self.pos[rid] = pos + len(toks)
        return out

    def runs(self, batch, twin: int):
        return [Run(rid, self.grammars[rid][twin], self.grammars[rid][twin].matcher if self.native[rid] else None,
                    start, toks) for rid, start, toks in batch]


class Reference:
    """What the ledger must do, written out directly: per request the position its matcher has consumed and the
    outcomes of its last ``history`` runs; a fresh run at that position is fed token by token to the matcher
    (stopping after termination, or before a rejected token); a repeated run is answered from the history."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.entries: Dict[str, Dict[str, Any]] = {}
        self.fed = self.replays = 0

    def advance(self, key: str, grammar: Wrapper, start: int, toks: List[int], native: bool) -> Any:
        e = self.entries.get(key)
        if e is None or e["grammar"] is not grammar:
            e = self.entries[key] = {"grammar": grammar, "consumed": start, "runs": {}}
        if start in e["runs"]:
            past = e["runs"][start]
            if past[0] != tuple(toks):
                return LedgerConflictError
            self.replays += 1
            return past
        if start != e["consumed"]:
            return LedgerConflictError if start < e["consumed"] else LedgerGapError
        m, kept, terminated, rejected = grammar.matcher, [], grammar.matcher.is_terminated(), False
        for t in toks if not terminated else ():
            if not m.accept_token(t):
                rejected = True
                break
            kept.append(t)
            if m.is_terminated():
                terminated = True
                break
        outcome = (tuple(toks), tuple(kept), terminated, rejected)
        if native:
            grammar.fed.append(tuple(kept))
        self.fed += len(kept)
        e["consumed"] = start + len(kept)
        e["runs"][start] = outcome
        if len(e["runs"]) > self.history:
            del e["runs"][next(iter(e["runs"]))]
        return outcome


def _as_reference(result: Any) -> Any:
    if isinstance(result, LedgerError):
        return type(result)
    return (result.tokens, result.retained, result.terminated, result.error is not None)


@pytest.mark.parametrize("seed", range(6))
def test_feed_does_what_the_reference_does_run_by_run(seed):
    world = World(seed)
    ledger, ref = AcceptLedger(history=3), Reference(history=3)
    kinds = set()
    for _ in range(14):
        batch = world.batch()
        got = ledger.feed(world.runs(batch, 0), _record)
        want = [ref.advance(rid, world.grammars[rid][1], start, toks, world.native[rid]) for rid, start, toks in batch]
        assert [_as_reference(g) for g in got] == want
        kinds.update(w.__name__ if isinstance(w, type) else "terminated" if w[2] else "rejected" if w[3] else "fed"
                     for w in want)
        assert (ledger.tokens_fed, ledger.replays) == (ref.fed, ref.replays)
        for rid, (a, b) in world.grammars.items():
            assert ledger.consumed(rid) == ref.entries.get(rid, {}).get("consumed")
            assert a.fed == b.fed  # on_feed saw the fresh native feeds, never a replay
            assert G.next_token_bitmask(a.matcher, VOCAB).equal(G.next_token_bitmask(b.matcher, VOCAB))
    assert {"fed", "rejected", "LedgerConflictError", "LedgerGapError"} <= kinds  # the odd asks really happened


def test_advance_raises_what_advance_many_returns():
    ledger = AcceptLedger()
    g = G.Recorder()
    feed_one(ledger, "a", g, 0, [1, 2])
    gap = ledger.feed([Run("a", g, None, 5, [3]), Run("a", g, None, 2, [3])])
    assert isinstance(gap[0], LedgerGapError) and gap[1] == FeedOutcome(2, (3,), (3,), False)
    with pytest.raises(LedgerGapError):
        feed_one(ledger, "a", g, 9, [4])
    with pytest.raises(LedgerConflictError):
        feed_one(ledger, "a", g, 0, [1, 9])
    assert g.fed == [1, 2, 3] and ledger.replays == 0
    assert feed_one(ledger, "a", g, 0, [1, 2]).retained == (1, 2) and ledger.replays == 1


def test_step_feed_re_anchors_only_the_run_in_error_and_counts_replays_when_asked():
    step = make_step()
    a, b, c = G.Recorder(), G.Recorder(), G.Recorder()
    step.feed([Run("a", a, None, 0, [1]), Run("b", b, None, 0, [2])])
    out = step.feed([Run("a", a, None, 0, [1]), Run("b", b, None, 4, [3]), Run("c", c, None, 0, [4, 5])])
    assert [o.retained for o in out] == [(1,), (3,), (4, 5)]
    assert a.fed == [1] and b.fed == [2, 3] and c.fed == [4, 5]  # a replayed, b re-anchored at 4, c fed
    assert step.telemetry.stats.counters["ledger_resets"] == 1
    assert step.telemetry.stats.counters.get("replays", 0) == 0  # a barrier's second ask is not a replay
    step.feed([Run("a", a, None, 0, [1]), Run("c", c, None, 0, [4, 5]), Run("c", c, None, 2, [6])],
                      count_replays=True)
    assert step.telemetry.stats.counters["replays"] == 2 and c.fed == [4, 5, 6]
