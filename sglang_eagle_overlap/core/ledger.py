"""Pending-accept ledger: advance each request's grammar matcher over its accepted tokens exactly once.

Under the overlap scheduler, batch N's accepted tokens are still unprocessed when batch N+1's verify runs. Two places
then want to feed them to the grammar: the verify of N+1 (so its tree mask starts from the right state, while the GPU
runs the forward) and the post-processing of N (which also needs to know where the grammar terminated). The ledger
makes the second ask free and keeps the matcher exact however the asks interleave.

Keying: a request's *identity* (its id string) plus the *position* of the first token of the run, i.e. how many
output tokens the request had before that step. Batch rows never enter the key, so requests that finished, aborted,
were retracted or filtered out between two batches cannot shift another request's tokens.

Invariants, per request key:

* ``consumed`` is the output position the matcher has been advanced to (tokens before it are in the matcher).
* ``advance(key, grammar, start, tokens)`` with ``start == consumed`` feeds the tokens, stopping after the one that
  terminates the grammar, and records the outcome under ``start``.
* The same call again (``start`` < ``consumed``) replays the recorded outcome and touches nothing; the tokens must be
  the same ones, or :class:`LedgerConflictError` is raised (two callers disagreeing on what was accepted is a bug).
* ``start > consumed`` means tokens would be skipped: :class:`LedgerGapError`.
* A different grammar object under a known key means the host rebuilt the request's matcher: the entry is
  re-anchored at ``start`` (its history belongs to the old object).
* A token the grammar rejects stops the run and is reported in ``AdvanceOutcome.error``; the request must be aborted
  by the caller (its matcher state is still consistent: the rejected token was not consumed).

The ledger never imports SGLang: a "grammar" is anything with ``accept_token(int)`` (raising ``ValueError`` or
returning ``False`` on rejection) and ``is_terminated() -> bool``.

Native feed (``advance(..., matcher=m, on_feed=f)``): when the grammar object is a thin wrapper over a native matcher
(SGLang's ``XGrammarGrammar`` over xgrammar's ``GrammarMatcher``), the ledger feeds the matcher itself -- one
``accept_token`` and one ``is_terminated`` per token instead of the wrapper's extra termination check and Python
frame -- and skips the check before the run when its own last run of that matcher left it not terminated (nothing
else feeds a matcher the ledger owns; a re-anchor or a rebuilt grammar forgets that knowledge). The matcher is never
asked to accept a token once the ledger knows it terminated; if something fed it to its end behind the ledger's back,
the refused first token is found terminated (as through the wrapper), not reported as a rejection. After a fresh feed
(never on a replay) it calls ``f(grammar, outcome)``, so the caller can record the run on the wrapper as the wrapper
itself would have. The outcome is the same as through the wrapper, but for a rejection's message (the wrapper's
exception text is not there to quote).

Batched native feed (``AcceptLedger(native=...)``, :mod:`sglang_eagle_overlap.core.native`): the fresh runs of one
:meth:`AcceptLedger.advance_many` whose matcher is a plain ``xgrammar.GrammarMatcher`` are fed in one C++ call after
the batch is checked, with the outcomes of the per-run feed above (a second run of the same request in one call is
fed after the first). Checks, replays, errors and the bookkeeping stay here, run by run.
"""

from __future__ import annotations

from typing import (Any, Callable, Collection, Dict, Hashable, Iterable, List, NamedTuple, Optional, Protocol, Sequence,
                    Tuple, Union)

from sglang_eagle_overlap.core.native import REJECTED, TERMINATED, TERMINATED_BEFORE, NativeGrammar

__all__ = [
    "AdvanceOutcome",
    "AcceptLedger",
    "AdvanceResult",
    "GrammarLike",
    "LedgerConflictError",
    "LedgerError",
    "LedgerGapError",
    "MatcherLike",
    "Run",
]


class GrammarLike(Protocol):
    def accept_token(self, token: int) -> object: ...

    def is_terminated(self) -> bool: ...


class MatcherLike(Protocol):
    """A native matcher: ``accept_token`` returns False on a rejected token (never raises for one)."""

    def accept_token(self, token: int) -> bool: ...

    def is_terminated(self) -> bool: ...


class LedgerError(RuntimeError):
    """The ledger and its caller disagree about a request's position (one of the two below)."""


class LedgerGapError(LedgerError):
    """Asked to advance from a position past what the matcher has consumed: tokens would be lost."""


class LedgerConflictError(LedgerError):
    """The same (request, position) was advanced twice with different tokens."""


class AdvanceOutcome(NamedTuple):
    """What one run of accepted tokens did to a matcher (immutable; a named tuple because one is made per request per
    step, on the grammar thread, and a frozen dataclass costs several times more to build).

    ``retained`` is the prefix of the run the grammar consumed: all of it, or up to and including the token that
    terminated the grammar, or up to (excluding) a rejected token. Tokens past ``retained`` must not be emitted.
    """

    start: int
    tokens: Tuple[int, ...]
    retained: Tuple[int, ...]
    terminated: bool
    error: Optional[str] = None


# One run for :meth:`AcceptLedger.advance_many`: (key, grammar, start, tokens, native matcher or None).
Run = Tuple[Hashable, GrammarLike, int, Sequence[int], Optional[MatcherLike]]
AdvanceResult = Union[AdvanceOutcome, LedgerError]


_PENDING = AdvanceOutcome(-1, (), (), False, "pending native feed")  # a slot of advance_many's result, filled later


class _Entry:
    """``history`` maps a run's start to its outcome, in insertion order, which is increasing start order (a request
    only moves forward; a re-anchor makes a new entry), so the oldest run is always the first key."""

    __slots__ = ("consumed", "grammar", "history", "live")

    def __init__(self, consumed: int, grammar: object = None) -> None:
        self.consumed = consumed
        self.grammar = grammar
        self.history: Dict[int, AdvanceOutcome] = {}
        self.live = False  # the last run this entry fed left its grammar not terminated (False: unknown or terminated)


class AcceptLedger:
    """Exactly-once grammar advance keyed by (request identity, output position). Not thread-safe: one scheduler."""

    def __init__(self, history: int = 8, native: Optional[NativeGrammar] = None) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._history = history
        # Native batch feed (core/native.py): the fresh runs of one ``advance_many`` through plain xgrammar matchers
        # are fed in one native call ("Native feed", module docstring); None: one Python feed per run.
        self.native = native
        self._entries: Dict[Hashable, _Entry] = {}
        self.tokens_fed = 0  # observable: total tokens fed to matchers by this ledger
        self.replays = 0  # observable: runs asked again and answered from the history (nothing fed)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def consumed(self, key: Hashable) -> Optional[int]:
        entry = self._entries.get(key)
        return None if entry is None else entry.consumed

    def outcome(self, key: Hashable, start: int) -> Optional[AdvanceOutcome]:
        """The recorded outcome of the run that started at ``start``, if it was advanced (and is still remembered)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.history.get(start)

    def advance(self, key: Hashable, grammar: GrammarLike, start: int, tokens: Sequence[int],
                matcher: Optional[MatcherLike] = None,
                on_feed: Optional[Callable[[Any, AdvanceOutcome], None]] = None) -> AdvanceOutcome:
        """Feed ``tokens`` (the run accepted at output position ``start``) to ``grammar`` exactly once; through
        ``matcher``, the native matcher inside it, when given (module docstring, "Native feed"). Raises
        :class:`LedgerGapError` / :class:`LedgerConflictError` (:meth:`advance_many` returns them instead)."""
        result = self.advance_many(((key, grammar, start, tokens, matcher),), on_feed)[0]
        if isinstance(result, LedgerError):
            raise result
        return result

    def advance_many(self, runs: Iterable[Run],
                     on_feed: Optional[Callable[[Any, AdvanceOutcome], None]] = None) -> List[AdvanceResult]:
        """:meth:`advance` for each ``(key, grammar, start, tokens, matcher)`` in order, in one call: one result per
        run, the outcome or the :class:`LedgerError` that :meth:`advance` would raise for it (a run in error changes
        nothing, the others go on). A whole batch's runs go through here: per run it is one loop body instead of a
        stack of calls (issue 17: the barrier's Python time per request)."""
        entries = self._entries
        native = self.native
        out: List[AdvanceResult] = []
        # Fresh runs waiting for the one native call: (index in out, key, entry, start, tokens, grammar, matcher).
        batch: List[Tuple[int, Hashable, _Entry, int, Tuple[int, ...], Any, Any]] = []
        batched: set[Hashable] = set()
        for key, grammar, start, tokens, matcher in runs:
            toks = tuple(map(int, tokens))
            if key in batched:  # a second run of a request in one call: its first must be fed before it is checked
                self._feed_batch(batch, out, on_feed)
                batch, batched = [], set()
            entry = entries.get(key)
            if entry is None or entry.grammar is not grammar:
                # First sight of this request (or of its rebuilt matcher): it has consumed exactly the tokens before
                # ``start``.
                entry = entries[key] = _Entry(consumed=start, grammar=grammar)
            history = entry.history
            past = history.get(start)
            if past is not None:
                if past.tokens != toks:
                    out.append(LedgerConflictError(
                        f"request {key!r}: run at position {start} was advanced with {list(past.tokens)} "
                        f"and is now asked with {list(toks)}"))
                else:
                    self.replays += 1
                    out.append(past)
                continue
            if start != entry.consumed:
                out.append(_mismatch(key, start, entry.consumed))
                continue
            if matcher is None:
                outcome = _feed(grammar, start, toks)
            elif native is not None and type(matcher) is native.matcher_type:
                batch.append((len(out), key, entry, start, toks, grammar, matcher))
                batched.add(key)
                out.append(_PENDING)
                continue
            else:
                outcome = _feed_matcher(matcher, entry.live, start, toks)
                if on_feed is not None:
                    on_feed(grammar, outcome)
            out.append(self._record(entry, start, outcome))
        if batch:
            self._feed_batch(batch, out, on_feed)
        return out

    def _feed_batch(self, batch: List[Tuple[int, Hashable, _Entry, int, Tuple[int, ...], Any, Any]],
                    out: List[AdvanceResult], on_feed: Optional[Callable[[Any, AdvanceOutcome], None]]) -> None:
        """Feed the batched fresh runs in one native call and record each outcome in its slot of ``out``."""
        native = self.native
        assert native is not None
        handles = native.handles([b[6] for b in batch])
        assert handles is not None  # every batched matcher's type was checked when it was batched
        results = native.feed_runs(handles, [b[4] for b in batch], [b[2].live for b in batch])
        for (slot, _key, entry, start, toks, grammar, _m), (kept, state) in zip(batch, results):
            if state == TERMINATED_BEFORE:
                outcome = AdvanceOutcome(start, toks, (), True, None)
            elif state == REJECTED:
                outcome = AdvanceOutcome(start, toks, toks[:kept], False,
                                         f"grammar rejected token {toks[kept]} at output position {start + kept}")
            else:
                outcome = AdvanceOutcome(start, toks, toks[:kept], state == TERMINATED, None)
            if on_feed is not None:
                on_feed(grammar, outcome)
            out[slot] = self._record(entry, start, outcome)

    def _record(self, entry: _Entry, start: int, outcome: AdvanceOutcome) -> AdvanceOutcome:
        """Book a fresh run's outcome on its entry (consumed, liveness, history) and return it."""
        retained = len(outcome.retained)
        entry.live = not outcome.terminated and outcome.error is None
        self.tokens_fed += retained
        # A run that was cut (termination / rejection) moves ``consumed`` only past what the matcher really took.
        entry.consumed = start + retained
        history = entry.history
        history[start] = outcome
        if len(history) > self._history:  # one run in, at most one out (the oldest: _Entry)
            del history[next(iter(history))]
        return outcome

    def forget(self, key: Hashable) -> None:
        """Drop a request that left the engine (finished, aborted). Safe to call for unknown keys."""
        self._entries.pop(key, None)

    def retain(self, live: Collection[Hashable]) -> int:
        """Forget every request not in ``live`` (the ones the host can still hand back); returns how many."""
        gone = [k for k in self._entries if k not in live]
        for k in gone:
            del self._entries[k]
        return len(gone)

    def reset(self, key: Hashable, consumed: int) -> None:
        """Re-anchor a request whose matcher was rolled back by the host (e.g. retokenization)."""
        old = self._entries.get(key)
        self._entries[key] = _Entry(consumed=consumed, grammar=None if old is None else old.grammar)


def _mismatch(key: Hashable, start: int, consumed: int) -> LedgerError:
    """The error of a fresh run whose ``start`` is not where the matcher is (``consumed``)."""
    if start < consumed:
        return LedgerConflictError(
            f"request {key!r}: run at position {start} is behind the matcher (consumed {consumed}) "
            "and no outcome is remembered for it"
        )
    return LedgerGapError(
        f"request {key!r}: asked to advance from position {start} but the matcher has consumed only "
        f"{consumed} tokens; tokens {consumed}..{start - 1} were never fed"
    )


def _feed(grammar: GrammarLike, start: int, toks: Tuple[int, ...]) -> AdvanceOutcome:
    retained: List[int] = []
    error: Optional[str] = None
    terminated = grammar.is_terminated()
    if not terminated:
        for tok in toks:
            try:
                ok = grammar.accept_token(tok)
            except ValueError as exc:  # SGLang's XGrammarGrammar raises on a rejected token
                error = f"grammar rejected token {tok} at output position {start + len(retained)}: {exc}"
                break
            if ok is False:  # a bare xgrammar GrammarMatcher returns False instead
                error = f"grammar rejected token {tok} at output position {start + len(retained)}"
                break
            retained.append(tok)
            if grammar.is_terminated():
                terminated = True
                break
    return AdvanceOutcome(start, toks, tuple(retained), terminated, error)


def _feed_matcher(m: MatcherLike, live: bool, start: int, toks: Tuple[int, ...]) -> AdvanceOutcome:
    """:func:`_feed` straight into a native matcher: the same outcome, with one termination check per token (and one
    before the run unless ``live``: the ledger's own last run left this matcher not terminated)."""
    if not live and m.is_terminated():
        return AdvanceOutcome(start, toks, (), True, None)
    retained: List[int] = []
    for tok in toks:
        if not m.accept_token(tok):
            if not retained and m.is_terminated():  # terminated behind the ledger's back: as _feed, not a rejection
                return AdvanceOutcome(start, toks, (), True, None)
            return AdvanceOutcome(start, toks, tuple(retained), False,
                                  f"grammar rejected token {tok} at output position {start + len(retained)}")
        retained.append(tok)
        if m.is_terminated():
            return AdvanceOutcome(start, toks, tuple(retained), True, None)
    return AdvanceOutcome(start, toks, tuple(retained), False, None)
