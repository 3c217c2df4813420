"""Pending-accept ledger: feed each request's grammar matcher its accepted tokens exactly once.

Under the overlap scheduler, batch N's accepted tokens are still unprocessed when batch N+1's verify runs. Two places
then want to feed them to the grammar: the verify of N+1 (so its tree mask starts from the right state, while the GPU
runs the forward) and the post-processing of N (which also needs to know where the grammar terminated). The ledger
makes the second ask free and keeps the matcher exact however the asks interleave.

Keying: a request's *identity* (its id string) plus the *position* of the first token of the run, i.e. how many
output tokens the request had before that step. Batch rows never enter the key, so requests that finished, aborted,
were retracted or filtered out between two batches cannot shift another request's tokens.

Invariants, per request key:

* ``consumed`` is the output position the matcher has been advanced to (tokens before it are in the matcher).
* ``feed`` of a :class:`Run` ``(key, grammar, matcher, start, tokens)`` with ``start == consumed`` feeds the
  tokens, stopping after the one that terminates the grammar, and records the outcome under ``start``.
* The same run again (``start`` < ``consumed``) replays the recorded outcome and touches nothing; the tokens must be
  the same ones, or :class:`LedgerConflictError` is raised (two callers disagreeing on what was accepted is a bug).
* ``start > consumed`` means tokens would be skipped: :class:`LedgerGapError`.
* A different grammar object under a known key means the host rebuilt the request's matcher: the entry is
  re-anchored at ``start`` (its history belongs to the old object).
* A token the grammar rejects stops the run and is reported in ``FeedOutcome.error``; the request must be aborted
  by the caller (its matcher state is still consistent: the rejected token was not consumed).

The ledger never imports SGLang: a "grammar" is anything with ``accept_token(int)`` (raising ``ValueError`` or
returning ``False`` on rejection) and ``is_terminated() -> bool``.

Native feed (a run with a ``matcher``, ``feed(runs, on_feed=f)``): when the grammar object is a thin wrapper over a
native matcher (SGLang's ``XGrammarGrammar`` over xgrammar's ``GrammarMatcher``), the ledger feeds the matcher itself
-- one ``accept_token`` and one ``is_terminated`` per token instead of the wrapper's extra termination check and
Python frame -- and skips the check before the run when its own last run of that matcher left it not terminated
(nothing else feeds a matcher the ledger owns; a re-anchor or a rebuilt grammar forgets that knowledge). The matcher
is never asked to accept a token once the ledger knows it terminated; if something fed it to its end behind the
ledger's back, the refused first token is found terminated (as through the wrapper), not reported as a rejection.
After a fresh feed (never on a replay) it calls ``f(grammar, outcome)``, so the caller can record the run on the
wrapper as the wrapper itself would have. The outcome is the same as through the wrapper, but for a rejection's
message (the wrapper's exception text is not there to quote).

Batched native feed (``AcceptLedger(native=...)``, :mod:`sglang_eagle_overlap.core.native`): the fresh runs of one
:meth:`AcceptLedger.feed` whose matcher is a plain ``xgrammar.GrammarMatcher`` are fed in one C++ call after
the batch is checked, with the outcomes of the per-run feed above (a second run of the same request in one call is
fed after the first). Checks, replays, errors and the bookkeeping stay here, run by run. :class:`LedgerPlan` splits
``feed`` at that native call, so that its caller can make the call together with other native work (the
step's tree walk) and on another thread; runs can be queued by row of a :class:`ResultRuns` whose host copy may still
be in flight (the native call reads their tokens).
"""

from __future__ import annotations

import functools
from typing import (Any, Callable, Collection, Dict, Hashable, Iterable, List, Mapping, NamedTuple, Optional, Protocol,
                    Sequence, Tuple, Union)

from sglang_eagle_overlap.core.native import (FEED_ERROR, FED, REJECTED, TERMINATED, TERMINATED_BEFORE,
                                              NativeGrammar, StepResult)

__all__ = [
    "FeedOutcome",
    "AcceptLedger",
    "FeedResult",
    "GrammarLike",
    "LedgerConflictError",
    "LedgerEntry",
    "LedgerError",
    "LedgerGapError",
    "LedgerPlan",
    "ResultRuns",
    "RowRun",
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


class FeedOutcome(NamedTuple):
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


class Run(NamedTuple):
    """One run of accepted tokens for :meth:`AcceptLedger.feed`: the request's ``key``, its ``grammar``, the native
    ``matcher`` inside it (None: fed through the grammar object), the output position ``start`` of the run's first
    token and its ``tokens``. The first four fields are :class:`RowRun`'s (a named tuple: one is made per request per
    step)."""

    key: Hashable
    grammar: GrammarLike
    matcher: Optional[MatcherLike]
    start: int
    tokens: Sequence[int]


class RowRun(NamedTuple):
    """A :class:`Run` whose tokens are ``row`` of a :class:`ResultRuns` (:meth:`LedgerPlan.add_rows`): the same first
    four fields in the same order, then the result row instead of the tokens."""

    key: Hashable
    grammar: GrammarLike
    matcher: Optional[MatcherLike]
    start: int
    row: int


FeedResult = Union[FeedOutcome, LedgerError]


_PENDING = FeedOutcome(-1, (), (), False, "pending native feed")  # a slot of a plan's result, filled later
# ``FeedOutcome`` from one tuple of its five fields, without the named tuple's Python ``__new__`` frame (the
# per-run loop of ``LedgerPlan.fill``)
_outcome = functools.partial(tuple.__new__, FeedOutcome)


class LedgerEntry:
    """One request's place in the ledger (made by :meth:`AcceptLedger.entry`, booked by :meth:`AcceptLedger.record`).
    ``history`` maps a run's start to its outcome, in insertion order, which is increasing start order (a request
    only moves forward; a re-anchor makes a new entry), so the oldest run is always the first key. ``last`` is the
    start of the newest (-1: none), which the history always keeps: a run asked at ``consumed`` can only be in the
    history as the newest one (every older run started before it, and ``consumed`` is at least the newest start), so
    ``start == consumed and start != last`` says "a fresh run" without a look into the history."""

    __slots__ = ("consumed", "grammar", "history", "live", "handle", "last")

    def __init__(self, consumed: int, grammar: object = None) -> None:
        self.consumed = consumed
        self.grammar = grammar
        self.history: Dict[int, FeedOutcome] = {}
        self.last = -1
        self.live = False  # the last run this entry fed left its grammar not terminated (False: unknown or terminated)
        self.handle: Any = None  # the native handle of the grammar's matcher, once a plan queued a run of it


class AcceptLedger:
    """Exactly-once grammar feed keyed by (request identity, output position). Not thread-safe: one scheduler."""

    def __init__(self, history: int = 8, native: Optional[NativeGrammar] = None) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.depth = history  # runs remembered per request (read-only)
        # Native batch feed (core/native.py): the fresh runs of one ``feed`` through plain xgrammar matchers
        # are fed in one native call ("Native feed", module docstring); None: one Python feed per run.
        self.native = native
        self._entries: Dict[Hashable, LedgerEntry] = {}
        self.tokens_fed = 0  # observable: total tokens fed to matchers by this ledger
        self.replays = 0  # observable: runs asked again and answered from the history (nothing fed)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def consumed(self, key: Hashable) -> Optional[int]:
        entry = self._entries.get(key)
        return None if entry is None else entry.consumed

    def outcome(self, key: Hashable, start: int) -> Optional[FeedOutcome]:
        """The recorded outcome of the run that started at ``start``, if it was fed (and is still remembered)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.history.get(start)

    def replay_whole(self, key: Hashable, start: int, tokens: Sequence[int]) -> Optional[Tuple[int, ...]]:
        """The run of ``key`` at ``start``'s tokens when it was fed with these ``tokens``, kept them all and raised
        nothing; else None -- not fed, cut, rejected or asked with other tokens --, and the caller asks
        :meth:`outcome` / :meth:`feed`. Post-processing's common case in one look; reads only (the caller counts its
        replays)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        past = entry.history.get(start)
        if past is None or past.error is not None:
            return None
        toks = past.tokens
        if len(past.retained) != len(toks) or toks != tuple(tokens):  # tuple equality: numpy / torch ints as ints
            return None
        return toks

    def feed(self, runs: Iterable[Run],
             on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None) -> List[FeedResult]:
        """Feed each :class:`Run` (its ``tokens``, accepted at output position ``start``) to its grammar exactly once,
        in order, in one call -- through ``matcher``, the native matcher inside it, when given (module docstring,
        "Native feed"). One result per run: the outcome, or the :class:`LedgerGapError` / :class:`LedgerConflictError`
        of a run the ledger disagrees with (a run in error changes nothing, the others go on). A run asked again is
        replayed from the history (nothing fed). A whole batch's runs go through here: per run it is one loop body
        instead of a stack of calls (the barrier's Python time per request is the scheduler thread's largest grammar
        cost). It is :meth:`plan` fed at once."""
        plan = self.plan()
        slots = plan.add(runs, on_feed)
        plan.feed()
        return plan.out[slots.start : slots.stop]

    def plan(self) -> LedgerPlan:
        """An empty :class:`LedgerPlan` on this ledger: runs added to it are checked and answered at once, but its
        fresh runs through plain xgrammar matchers wait for one native feed, which the caller may fuse with other
        native work (``GrammarStep``: the step's tree walk in the same call)."""
        return LedgerPlan(self)

    @property
    def entries(self) -> Mapping[Hashable, LedgerEntry]:
        """Every request's entry by key, read-only (:class:`LedgerPlan`'s per-row loop looks entries up here and makes
        them with :meth:`entry`)."""
        return self._entries

    def entry(self, key: Hashable, grammar: object, start: int) -> LedgerEntry:
        """``key``'s entry for ``grammar`` (:class:`LedgerPlan`'s checks read and book it): the known one, or -- at the
        first sight of the request or of its rebuilt grammar -- a new one that has consumed exactly the tokens before
        ``start``."""
        entries = self._entries
        entry = entries.get(key)
        if entry is None or entry.grammar is not grammar:
            entry = entries[key] = LedgerEntry(consumed=start, grammar=grammar)
        return entry

    def record(self, entry: LedgerEntry, start: int, outcome: FeedOutcome) -> FeedOutcome:
        """Book a fresh run's outcome on its entry (consumed, liveness, history) and return it."""
        retained = len(outcome.retained)
        entry.live = not outcome.terminated and outcome.error is None
        self.tokens_fed += retained
        # A run that was cut (termination / rejection) moves ``consumed`` only past what the matcher really took.
        entry.consumed = start + retained
        history = entry.history
        history[start] = outcome
        entry.last = start
        if len(history) > self.depth:  # one run in, at most one out (the oldest: LedgerEntry)
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
        self._entries[key] = LedgerEntry(consumed=consumed, grammar=None if old is None else old.grammar)


class ResultRuns:
    """The accepted runs of one result of the host (a verify: ``ids[row * stride : row * stride + lens[row]]``; a
    prefill, ``lens`` None: the one token ``ids[row]``), whose host copy may still be in flight until ``ready`` (a
    device event, or None: already on the host) has been waited for. Lets a ledger plan queue a run before its tokens
    are on the host (:meth:`LedgerPlan.add_rows`): the native feed reads them itself, after :meth:`wait`. Tensors that
    are not host tensors (``on_host`` False: a result whose copy the host has not made) are only ever read through
    :meth:`run`."""

    __slots__ = ("ids", "lens", "stride", "ready", "on_host", "_ids", "_lens")

    def __init__(self, ids: Any, lens: Any, stride: int, ready: Optional[Any] = None) -> None:
        self.ids = ids  # integer tensor (int32 / int64), normally on the host
        self.lens = lens  # integer tensor, or None (prefill)
        self.stride = stride
        self.ready = ready  # object with synchronize(): the host copy's event
        self.on_host = _on_host(ids) and (lens is None or _on_host(lens))  # what the native call can read
        self._ids: Optional[List[int]] = None
        self._lens: Optional[List[int]] = None

    def wait(self) -> None:
        """Block until the host copy is done (a device event's ``synchronize``, which releases the GIL)."""
        if self.ready is not None:
            self.ready.synchronize()

    def lists(self) -> Tuple[List[int], Optional[List[int]]]:
        """``ids`` and ``lens`` (None: a prefill) as host lists, made once (waits for the host copy the first time)."""
        if self._ids is None:
            self.wait()
            self._lens = None if self.lens is None else self.lens.tolist()
            self._ids = self.ids.tolist()
        return self._ids, self._lens

    def run(self, row: int) -> Tuple[int, ...]:
        """The run of ``row`` (waits for the host copy the first time)."""
        ids, lens = self.lists()
        if lens is None:
            return (ids[row],)
        a = row * self.stride
        return tuple(ids[a : a + lens[row]])


def _on_host(t: Any) -> bool:
    """Data in host memory: a torch tensor by its ``is_cpu`` flag (one attribute read, no ``torch.device`` object
    made), anything else by its device's type (numpy 2's is the string ``"cpu"``); without a device (lists, numpy 1),
    host."""
    is_cpu = getattr(t, "is_cpu", None)
    if is_cpu is not None:
        return bool(is_cpu)
    device = getattr(t, "device", None)
    return device is None or getattr(device, "type", device) == "cpu"


class LedgerPlan:
    """:meth:`AcceptLedger.feed` in two halves, so that its native feed can be one call with other native work.

    :meth:`add` takes a call's runs and does all of ``feed`` but the native feed: keys are checked, replays
    and errors answered, runs through a grammar object or a matcher subclass fed in Python; the fresh runs through
    plain ``xgrammar.GrammarMatcher`` objects (with ``AcceptLedger.native`` set) wait, each with a placeholder in
    :attr:`out`. :meth:`add_rows` does the same for runs given as rows of a :class:`ResultRuns` whose host copy may
    still be in flight: a fresh run through a plain matcher waits without its tokens (the native feed reads them from
    the result); any other run needs its tokens at once, and waits for the copy there. The waiting runs are then fed
    either by :meth:`feed` (the ledger's own native call) or by the caller, who hands the outcomes to :meth:`fill`
    (:meth:`pending` lists what to feed, in order, and :meth:`sources` the results it reads). A run of a key that
    already waits makes the waiting ones be fed first (its check needs their outcome), exactly as in
    ``AcceptLedger.feed``.

    Invariants: every waiting run is fed exactly once, by :meth:`feed` or by whoever calls :meth:`fill`; nothing else
    may feed these matchers or use this ledger in between; :meth:`feed` after a :meth:`fill` is a no-op, so calling it
    in a ``finally`` makes sure no run is left unfed. Not thread-safe (the ledger is not): :meth:`pending` and
    :meth:`fill` belong to the thread that added the runs, only the native call in between may run elsewhere."""

    __slots__ = ("ledger", "out", "errors", "_batch", "_batched", "_handles", "_packed", "_results", "_result_at")

    def __init__(self, ledger: AcceptLedger) -> None:
        self.ledger = ledger
        self.out: List[FeedResult] = []  # one result per added run, in order; waiting runs hold a placeholder
        self.errors = 0  # ledger errors among the results added so far
        # Waiting runs: (index in out, entry, start, grammar, on_feed) -- their tokens come back from the native call
        # that feeds them (``fill``) --; and, kept in step with them, what that call takes: their matchers' handles,
        # the packed runs, the results they read.
        self._batch: List[Tuple[int, LedgerEntry, int, Any, Optional[Callable[[Any, FeedOutcome], None]]]] = []
        self._batched: set[Hashable] = set()
        self._handles: List[Any] = []
        self._packed: List[int] = []
        self._results: List[ResultRuns] = []
        self._result_at: Dict[int, int] = {}

    def __len__(self) -> int:
        """The waiting runs."""
        return len(self._batch)

    def add(self, runs: Iterable[Run], on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None) -> range:
        """Check, answer or queue every :class:`Run`; returns their slots in
        :attr:`out`. ``on_feed(grammar, outcome)`` is called after each fresh feed of these runs (never on a
        replay), as ``AcceptLedger.feed`` calls it."""
        first = len(self.out)
        for run in runs:
            self._add(run.key, run.grammar, run.start, tuple(map(int, run.tokens)), run.matcher, on_feed)
        return range(first, len(self.out))

    def add_rows(self, rows: Iterable[RowRun], result: ResultRuns,
                 on_feed: Optional[Callable[[Any, FeedOutcome], None]] = None) -> range:
        """:meth:`add` of :class:`RowRun` records: the run of ``row`` in ``result``. A fresh run
        through a plain xgrammar matcher of a result on the host waits without reading its tokens; every other run
        reads them at once (waiting for the result's host copy)."""
        out = self.out
        first = len(out)
        native = self.ledger.native
        if native is None or not result.on_host:  # runs the native call cannot read: tokens read here, at once
            for r in rows:
                self._add(r.key, r.grammar, r.start, result.run(r.row), r.matcher, on_feed)
            return range(first, len(out))
        entries, entry_of = self.ledger.entries, self.ledger.entry
        batch, batched, handles, packed = self._batch, self._batched, self._handles, self._packed
        mtype, handle = native.matcher_type, native.handle
        k = self._result_at.get(id(result))
        for key, grammar, matcher, start, row in rows:
            if type(matcher) is mtype and key not in batched:
                entry = entries.get(key)  # the known entry without a call (the per-row loop); else entry()
                if entry is None or entry.grammar is not grammar:
                    entry = entry_of(key, grammar, start)
                if start == entry.consumed and start != entry.last:  # a fresh run (LedgerEntry)
                    if k is None:
                        k = self._result_at[id(result)] = len(self._results)
                        self._results.append(result)
                    batch.append((len(out), entry, start, grammar, on_feed))
                    batched.add(key)
                    h = entry.handle
                    if h is None:  # the entry's grammar is fixed (a rebuilt one makes a new entry): so is its matcher
                        h = entry.handle = handle(matcher)
                    handles.append(h)
                    packed += (1 if entry.live else 0, k, row)
                    out.append(_PENDING)
                    continue
            self._add(key, grammar, start, result.run(row), matcher, on_feed)
            if self._batch is not batch:
                # _add fed the waiting runs first (a second run of a queued request): ``fill`` started new lists, so
                # the rows after this one queue into those, and the result gets a new index when next queued
                batch, batched, handles, packed = self._batch, self._batched, self._handles, self._packed
                k = None
        return range(first, len(out))

    def _add(self, key: Hashable, grammar: Any, start: int, toks: Tuple[int, ...], matcher: Any,
             on_feed: Optional[Callable[[Any, FeedOutcome], None]]) -> None:
        """One run of :meth:`add` (``AcceptLedger.feed``'s checks, then a Python feed or a wait)."""
        ledger = self.ledger
        out = self.out
        if key in self._batched:  # a second run of a request: its first must be fed before it is checked
            self.feed()
        entry = ledger.entry(key, grammar, start)
        history = entry.history
        past = history.get(start)
        if past is not None:
            if past.tokens != toks:
                self.errors += 1
                out.append(LedgerConflictError(
                    f"request {key!r}: run at position {start} was advanced with {list(past.tokens)} "
                    f"and is now asked with {list(toks)}"))
            else:
                ledger.replays += 1
                out.append(past)
            return
        if start != entry.consumed:
            self.errors += 1
            out.append(_mismatch(key, start, entry.consumed))
            return
        native = ledger.native
        if matcher is None:
            outcome = _feed(grammar, start, toks)
        elif native is not None and type(matcher) is native.matcher_type:
            self._batch.append((len(out), entry, start, grammar, on_feed))
            self._batched.add(key)
            self._handles.append(native.handle(matcher))
            self._packed += (1 if entry.live else 0, -1, len(toks))
            self._packed.extend(toks)
            out.append(_PENDING)
            return
        else:
            outcome = _feed_matcher(matcher, entry.live, start, toks)
            if on_feed is not None:
                on_feed(grammar, outcome)
        out.append(ledger.record(entry, start, outcome))

    def sources(self) -> List[ResultRuns]:
        """The results the waiting runs read their tokens from (each once): wait for them before the native feed."""
        return list(self._results)

    def pending(self) -> Tuple[List[Any], List[int], List[Tuple[Any, Any, int]]]:
        """The waiting runs, in feed order, as ``NativeGrammar.step_batch`` takes them: their matchers' handles, the
        packed runs (``live``, then ``-1, len, tokens`` or ``result, row``) and the results those read (``(ids, lens,
        stride)``). ``live``: the ledger's own last run left that matcher not terminated ("Native feed")."""
        return self._handles, self._packed, [(r.ids, r.lens, r.stride) for r in self._results]

    def fill(self, feeds: Sequence[int], errors: Mapping[Tuple[str, int], str], run_lens: Sequence[int],
             run_tokens: Sequence[int]) -> None:
        """Record the waiting runs' outcomes, from what the native call that fed them hands back (``StepResult``):
        ``feeds[2 i]``, ``feeds[2 i + 1]`` are the retained tokens and the state of the i-th run of :meth:`pending`
        (``core/native.py``'s states), ``errors`` its messages (``errors[("f", i)]`` for a run whose matcher raised),
        ``run_lens[i]`` the i-th run's length and ``run_tokens`` all the runs' tokens in that order, as the call read
        them (packed, or from their result's tensors: a run queued by row is never read here)."""
        batch = self._batch
        self._batch, self._batched, self._handles, self._packed = [], set(), [], []
        self._results, self._result_at = [], {}
        if len(feeds) != 2 * len(batch):
            raise ValueError(f"{len(feeds) // 2} feed outcomes for {len(batch)} waiting runs")
        if len(run_lens) != len(batch):
            raise ValueError(f"{len(run_lens)} run lengths for {len(batch)} waiting runs")
        ledger, out = self.ledger, self.out
        record, depth = ledger.record, ledger.depth
        fed = at = 0
        try:
            for f, (slot, entry, start, grammar, on_feed) in enumerate(batch):
                n = run_lens[f]
                toks = tuple(run_tokens[at : at + n])
                at += n
                kept = feeds[2 * f]
                state = feeds[2 * f + 1]
                if state == FED and kept == len(toks):
                    # The common case (the largest per-request loop on the scheduler thread), booked here as
                    # ``AcceptLedger.record`` books it: the whole run consumed, the matcher left live.
                    outcome = _outcome((start, toks, toks, False, None))
                    if on_feed is not None:
                        on_feed(grammar, outcome)
                    entry.live = True
                    fed += kept
                    entry.consumed = start + kept
                    history = entry.history
                    history[start] = outcome
                    entry.last = start
                    if len(history) > depth:
                        del history[next(iter(history))]
                    out[slot] = outcome
                    continue
                outcome = native_outcome(start, toks, kept, state, errors.get(("f", f)))
                if on_feed is not None:
                    on_feed(grammar, outcome)
                out[slot] = record(entry, start, outcome)
        finally:  # the runs booked before a raising ``on_feed`` stay counted, as ``record`` counts them
            ledger.tokens_fed += fed

    def record_native(self, result: StepResult) -> None:
        """Record the waiting runs' outcomes from the result of the native call that fed them (:meth:`fill` of its
        ``feeds``, ``errors``, ``run_lens`` and ``run_tokens``): the one way a native call made outside this plan (the
        mask build's, ``TreeMaskBuilder.native_result``) books its feeds in the ledger."""
        self.fill(result.feeds, result.errors, result.run_lens, result.run_tokens)

    def feed(self) -> None:
        """Feed the waiting runs in one native call (``NativeGrammar.step_batch``, on this thread, after waiting for
        the results they read) and record them; nothing waits afterwards."""
        if not self._batch:
            return
        native = self.ledger.native
        assert native is not None  # runs wait only with a native module
        for result in self._results:
            result.wait()
        handles, packed, results = self.pending()
        res = native.step_batch(handles, packed, results, (), (), None, None, None, None, 0, None)
        self.record_native(res)


def native_outcome(start: int, toks: Tuple[int, ...], kept: int, state: int,
                   message: Optional[str] = None) -> FeedOutcome:
    """The outcome of one run the native module fed (``core/native.py``: ``(retained, state)``, and the message of a
    run whose matcher raised), as :func:`_feed_matcher` reports it for the same matcher calls."""
    if state == FED:  # the whole run (``LedgerPlan.fill`` answers this case itself)
        return FeedOutcome(start, toks, toks[:kept], False, None)
    if state == TERMINATED:
        return FeedOutcome(start, toks, toks[:kept], True, None)
    if state == TERMINATED_BEFORE:
        return FeedOutcome(start, toks, (), True, None)
    if state == REJECTED:
        return FeedOutcome(start, toks, toks[:kept], False,
                              f"grammar rejected token {toks[kept]} at output position {start + kept}")
    if state == FEED_ERROR:
        return FeedOutcome(start, toks, toks[:kept], False,
                              f"grammar raised at token {toks[kept]} at output position {start + kept}: {message}")
    return FeedOutcome(start, toks, (), False, "not fed: an earlier run of the same matcher raised")


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


def _feed(grammar: GrammarLike, start: int, toks: Tuple[int, ...]) -> FeedOutcome:
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
    return FeedOutcome(start, toks, tuple(retained), terminated, error)


def _feed_matcher(m: MatcherLike, live: bool, start: int, toks: Tuple[int, ...]) -> FeedOutcome:
    """:func:`_feed` straight into a native matcher: the same outcome, with one termination check per token (and one
    before the run unless ``live``: the ledger's own last run left this matcher not terminated)."""
    if not live and m.is_terminated():
        return FeedOutcome(start, toks, (), True, None)
    retained: List[int] = []
    for tok in toks:
        if not m.accept_token(tok):
            if not retained and m.is_terminated():  # terminated behind the ledger's back: as _feed, not a rejection
                return FeedOutcome(start, toks, (), True, None)
            return FeedOutcome(start, toks, tuple(retained), False,
                                  f"grammar rejected token {tok} at output position {start + len(retained)}")
        retained.append(tok)
        if m.is_terminated():
            return FeedOutcome(start, toks, tuple(retained), True, None)
    return FeedOutcome(start, toks, tuple(retained), False, None)
