"""The flow every SGLang band shares, owned once: :class:`Band`, subclassed by each band module (``adapters/v0_5_*/
band.py``), which keeps only what differs in its SGLang (which rows a result commits, what a fed result hands back,
how the ledger is bounded, how SGLang's leftover mask is cleared).

Call order of one plugin-owned verify step, on the scheduler thread:

1. :meth:`Band.run_verify` -- the hooked ``run_eagle_verify`` runs SGLang's original with the step in flight
   (:class:`InFlight`, one per call) and clears it whatever happens;
2. :meth:`Band.start` -- before the target-verify launch: ``GrammarStep.start_build`` of the batch's mask requests,
   with the band's barrier (:meth:`Band.feed_results` over the results still to be fed);
3. :meth:`Band.finish` -- after the launch, before sampling: ``GrammarStep.finish_build`` (or a step's own
   ``build_mask``, :meth:`Band.settled`), per-request aborts (``requests.settle_mask``), then the band clears SGLang's
   leftover extend-stage mask (:meth:`Band.leftover`) and returns what SGLang's sampler takes;
4. :meth:`Band.feed_results` -- the barrier loop: every result's committed rows (:meth:`Band.rows_to_feed`) into
   ``GrammarStep.feed_later`` exactly once, what a fed result hands back (:meth:`Band.when_fed`), then the ledger
   bounded (:meth:`Band.bound_ledger`).

Each method calls the core directly (no pass-through frame between a hook and ``GrammarStep``): the path from the
SGLang call that hands over a verify step's tokens to the core is "the walk" of docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from sglang_eagle_overlap.core import FeedOutcome, GrammarStep, MaskJob, PendingTree, ResultRuns, RowRun, StepMask
from sglang_eagle_overlap.integration.requests import mask_requests, record_on_xgrammar, settle_mask

__all__ = ["Band", "InFlight"]

# Every ``Any`` below is one of SGLang's objects (ScheduleBatch, Req, results, sampling info, EagleVerifyInput):
# SGLang ships no types.

OnDone = Callable[[List[FeedOutcome]], None]


@dataclass(slots=True)
class InFlight:
    """The verify step of the ``run_eagle_verify`` call in progress: its ``batch``, the ``barrier`` its mask build runs
    first, the host ``tree`` and the ``job`` once started (:meth:`Band.start`). ``hidden``: ``batch.has_grammar`` is
    False for SGLang's own grammar block (0.5.16), restored by :meth:`restore`."""

    batch: Any
    barrier: Optional[Callable[[], object]] = None
    tree: Optional[PendingTree] = None
    allow_timeout: bool = True
    job: Optional[MaskJob] = None
    hidden: bool = False

    def hide(self) -> None:
        if not self.hidden:
            self.hidden = True
            self.batch.has_grammar = False

    def restore(self) -> None:
        if self.hidden:
            self.batch.has_grammar = True
            self.hidden = False


class Band:
    """One SGLang band's integration over the process's ``GrammarStep`` (one per runtime: ``Runtime.band``). Owns the
    in-flight verify step (:attr:`in_flight`); a subclass overrides the four hooks (:meth:`rows_to_feed`,
    :meth:`when_fed`, :meth:`bound_ledger`, :meth:`leftover`) and adds its SGLang-specific state and entry points."""

    counts_replays = False  # whether runs the ledger answers from its history count as ``replays`` here

    def __init__(self, step: GrammarStep) -> None:
        self.step = step
        self.in_flight: Optional[InFlight] = None

    # -- the in-flight step ----------------------------------------------------------------------------------------
    def in_flight_for(self, batch: Any) -> Optional[InFlight]:
        """The step in flight for this very ``batch``, if any."""
        cur = self.in_flight
        return cur if cur is not None and cur.batch is batch else None

    def run_verify(self, cur: Optional[InFlight], original: Callable[..., Any], batch: Any, *args: Any,
                   **kwargs: Any) -> Any:
        """SGLang's ``run_eagle_verify`` with ``cur`` in flight (None: nothing handed over); afterwards, whatever
        happens, ``has_grammar`` is restored and the hand-off cleared (unless a later step replaced it)."""
        self.in_flight = cur
        try:
            return original(batch, *args, **kwargs)
        finally:
            if cur is not None:
                cur.restore()
            if self.in_flight is cur:
                self.in_flight = None

    # -- the mask build ---------------------------------------------------------------------------------------------
    def start(self, cur: Optional[InFlight]) -> Optional[InFlight]:
        """Start ``cur``'s grammar work before the target-verify launch (``GrammarStep.start_build`` of its batch's
        mask requests over ``cur.tree``, with ``cur.barrier``; inline, just recorded for :meth:`finish`). None: none."""
        if cur is None or cur.tree is None:
            return None
        batch = cur.batch
        cur.job = self.step.start_build(mask_requests(batch.reqs), cur.tree, vocab_size=batch.sampling_info.vocab_size,
                                        barrier=cur.barrier, allow_timeout=cur.allow_timeout)
        return cur

    def finish(self, job: MaskJob, reqs: Sequence[Any], sampling: Any, *, device: Any, draft_device: Any = None,
               verify_input: Any = None) -> Any:
        """After the launch, before sampling: join ``job`` (``GrammarStep.finish_build``), then :meth:`settled`."""
        return self.settled(self.step.finish_build(job, device=device, draft_device=draft_device), reqs, sampling,
                            verify_input)

    def settled(self, step_mask: StepMask, reqs: Sequence[Any], sampling: Any, verify_input: Any = None) -> Any:
        """Abort every request whose grammar raised during the build (alone), then what SGLang's sampler takes
        (:meth:`leftover`)."""
        return self.leftover(settle_mask(step_mask, reqs), step_mask, sampling, verify_input)

    def leftover(self, grammar: Any, step_mask: StepMask, sampling: Any, verify_input: Any) -> Any:
        """Band hook: clear SGLang's leftover extend-stage mask so it is not applied to the verify logits, and return
        what the sampler takes. ``grammar``: the batch's first grammar object (None: no request constrained)."""
        raise NotImplementedError

    # -- the barrier loop -------------------------------------------------------------------------------------------
    def feed_results(self, results: Optional[Iterable[Tuple[Any, Any]]], current_reqs: Sequence[Any] = ()) -> None:
        """Feed every ``(batch, result)``'s committed runs to their grammars exactly once, as its post-processing
        will (``GrammarStep.feed_later``: inside a mask build's barrier queued by row and fed by that build's
        native call; elsewhere at once), then bound the ledger (:meth:`bound_ledger`; ``current_reqs``: the batch
        being verified). Nothing to do for no results."""
        if not results:
            return
        queued = list(results)
        step = self.step
        for batch, result in queued:
            finished: List[str] = []  # the constrained requests already finished: the ledger forgets them
            got = self.rows_to_feed(batch, result, finished)
            if got is None:
                continue
            rows, runs = got
            step.feed_later(rows, runs, self.when_fed(batch, result, rows, finished), record_on_xgrammar,
                            count_replays=self.counts_replays)
        self.bound_ledger(queued, current_reqs)

    def rows_to_feed(self, batch: Any, result: Any, finished: List[str]
                     ) -> Optional[Tuple[List[RowRun], ResultRuns]]:
        """Band hook: the rows ``result`` commits and its runs (``requests.result_rows``), or None (nothing to feed);
        ``finished`` collects the constrained requests already finished."""
        raise NotImplementedError

    def when_fed(self, batch: Any, result: Any, rows: List[RowRun], finished: List[str]) -> Optional[OnDone]:
        """Band hook: what runs once ``result``'s outcomes are known (None: nobody waits; the ledger keeps them)."""
        return None

    def bound_ledger(self, queued: List[Tuple[Any, Any]], current_reqs: Sequence[Any]) -> None:
        """Band hook: keep the ledger bounded after a barrier (default: the band bounds it elsewhere)."""
