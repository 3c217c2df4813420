"""SGLang 0.5.16: the grammar-overlap integration itself (:class:`Band016` over the shared
:class:`~sglang_eagle_overlap.integration.band.Band`). The hook modules next to this one and the vendored patch
(``patches/sglang-0.5.16``) both call it, so one code path serves plugin and patch users.

SGLang 0.5.16 forces every speculative grammar decode batch out of overlap (``need_grammar_sync``). With this band,
EAGLE / EAGLE3 / STANDALONE decode batches whose grammars are all xgrammar or llguidance stay overlapped; one verify
step is:

1. ``Scheduler.is_disable_overlap_for_batch`` -> :func:`keeps_overlap`: drop the grammar-sync reason (only that one);
   it also records the overlap loop's ``result_queue`` on the band (the verify barrier reads it).
2. ``run_eagle_verify``, before the target-verify launch -> :func:`begin_verify` (the hook: ``Band016.verify_step``
   then ``Band.start``): the verify tree's async host copy (``GrammarStep.copy_tree``) replaces the blocking
   ``.cpu()``, then ``GrammarStep.start_build`` with ``Band.feed_results`` over the queued results as the barrier
   (the previous batch's accepted runs, still in ``result_queue``, checked by the ledger and queued by row) and the
   step's one native call handed to the grammar thread (inline, with the grammar thread off: recorded for 3).
3. ``run_eagle_verify``, after the launch -> :func:`build_vocab_mask` (the hook: ``Band.finish``):
   ``GrammarStep.finish_build`` joins the job (or runs it), then the SGLang side: abort failed requests alone,
   ``verify_input.grammar``, clear the extend stage's ``sampling_info.vocab_mask`` (:meth:`Band016.leftover`).
4. Post-processing ``_accept_grammar_tokens`` / ``_apply_prefill_grammar`` -> :func:`feed_tokens` /
   :func:`feed_prefill_token`: replay what 2-3 fed (``GrammarStep.replay_whole``, one call per request), or feed it
   now, with SGLang's retained-run and abort semantics (:func:`~sglang_eagle_overlap.integration.requests.feed_run`).

The walk (docs/architecture.md) from SGLang's call to the core: barrier ``run_eagle_verify`` hook -> ``Band.start`` ->
``GrammarStep.start_build`` -> (its barrier) ``Band.feed_results`` -> ``GrammarStep.feed_later``; post-processing
``_accept_grammar_tokens`` hook -> :func:`feed_tokens` -> ``GrammarStep.replay_whole`` (a run the barrier did not see:
``requests.feed_run`` -> ``GrammarStep.feed``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Set, Tuple

from sglang_eagle_overlap import support
from sglang_eagle_overlap.core import GrammarStep, ResultRuns, RowRun, StepMask
from sglang_eagle_overlap.integration import drafts
from sglang_eagle_overlap.integration.band import Band, InFlight
from sglang_eagle_overlap.integration.requests import (
    algorithm_name,
    feed_run,
    innermost_grammar,
    is_llguidance,
    is_xgrammar,
    result_rows,
)
from sglang_eagle_overlap.integration.runtime import Runtime

if TYPE_CHECKING:
    import torch

# Every ``Any`` below is one of SGLang's objects (ScheduleBatch, Req, EagleVerifyInput, results, server args):
# SGLang ships no types.

logger = logging.getLogger("sglang_eagle_overlap")

__all__ = [
    "BAND",
    "EAGLE_FAMILY",
    "Band016",
    "announce_stand_aside",
    "after_sample",
    "algorithm_name",
    "band_of",
    "before_verify",
    "begin_verify",
    "build_vocab_mask",
    "can_mask",
    "feed_prefill_token",
    "feed_tokens",
    "is_eagle_family",
    "is_eagle_server",
    "keeps_overlap",
]

BAND = "0.5.16"
# Algorithms whose grammar decode batches stay in the overlap: those whose verify runs through
# ``eagle_worker_common.run_eagle_verify`` (EAGLE, EAGLE3, STANDALONE; NEXTN arrives resolved to EAGLE). The decision
# per algorithm, with its reason, is data in :mod:`sglang_eagle_overlap.support`.
EAGLE_FAMILY = support.kept_algorithms(BAND)


def is_eagle_family(obj: Any) -> bool:
    return algorithm_name(obj) in EAGLE_FAMILY


def can_mask(batch: Any) -> bool:
    """The tree mask is xgrammar's bitmask layout, which llguidance shares: a batch whose grammars are all xgrammar or
    llguidance (or a reasoning wrapper around either, or around nothing: the generic walk) is the plugin's; one with
    another backend (outlines: a boolean mask of its own) keeps SGLang's own path."""
    for req in batch.reqs:
        grammar = getattr(req, "grammar", None)
        if grammar is None or type(grammar).__name__ == "XGrammarGrammar":  # no grammar, or xgrammar itself
            continue
        inner = innermost_grammar(grammar)
        if inner is not None and not (is_xgrammar(inner) or is_llguidance(inner)):
            return False
    return True


class Band016(Band):
    """The 0.5.16 band's state besides the shared in-flight step: the overlap loop's ``result_queue`` (the verify
    barrier feeds what is still in it), the server's family decision (``eagle_server``) and the last overlap
    decision's mask verdict (``verdict``), and the algorithms already said to keep SGLang's own path
    (``announced``)."""

    def __init__(self, step: GrammarStep) -> None:
        super().__init__(step)
        self.result_queue: Any = None  # SGLang's own deque of (ScheduleBatch, result)
        # whether the server's algorithm is one the band keeps, decided at the first ask per server_args object
        self.eagle_server: Optional[Tuple[Any, bool]] = None
        # a batch's ``can_mask`` verdict, as (its request list, that list's length, verdict), handed from the
        # scheduler's overlap decision to the same batch's verify entry (:meth:`mask_verdict`)
        self.verdict: Optional[Tuple[Any, int, bool]] = None
        self.announced: Set[str] = set()  # stand-aside algorithms, said once per process (announce_stand_aside)

    def is_eagle_server(self, server_args: Any) -> bool:
        """:func:`is_eagle_family` of the server's arguments, decided at the first ask for that ``server_args`` object
        and kept (the post-processing hooks ask once per request and step)."""
        known = self.eagle_server
        if known is None or known[0] is not server_args:
            known = self.eagle_server = (server_args, is_eagle_family(server_args))
        return known[1]

    def mask_verdict(self, batch: Any, *, keep: bool = False) -> bool:
        """:func:`can_mask` of ``batch``, looked at once per step. The scheduler's overlap decision
        (:func:`keeps_overlap`, ``keep=True``) looks and keeps the verdict with the request list it was made for; the
        same batch's verify entry (:meth:`owns_verify`) comes next, with nothing in between that changes its requests
        or their grammars (a request's grammar is set before it joins a running batch), and takes it -- for that same
        list object, of the same length -- instead of looking again; any other batch (filtered into a new list, merged
        into a longer one, a verify without an overlap decision) is looked at."""
        reqs = batch.reqs
        if not keep:
            known = self.verdict
            if known is not None and known[0] is reqs and known[1] == len(reqs):
                self.verdict = None
                return known[2]
            return can_mask(batch)
        verdict = can_mask(batch)
        self.verdict = (reqs, len(reqs), verdict)
        return verdict

    def owns_verify(self, batch: Any) -> bool:
        """Whether the plugin owns this verify step: a non-idle EAGLE-family grammar batch whose grammars it can mask
        (a batch with another backend is counted as ``fallback_steps`` and left to SGLang). Decided once per step, at
        the ``run_eagle_verify`` entry (:func:`before_verify`), and handed to :meth:`verify_step`."""
        if not getattr(batch, "has_grammar", False) or not is_eagle_family(batch) or batch.forward_mode.is_idle():
            return False
        if not self.mask_verdict(batch):
            self.step.count("fallback_steps")
            return False
        return True

    def verify_step(self, batch: Any, verify_input: Any, owned: Optional[bool] = None) -> Optional[InFlight]:
        """Before the target-verify launch: the step to start (``Band.start``), its tree's async host copy started,
        its barrier the results still queued. None: SGLang's own path. ``owned``: :func:`before_verify`'s decision
        for this step (None: decide here)."""
        if not (self.owns_verify(batch) if owned is None else owned):
            return None
        tree = self.step.copy_tree(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling,
                                   verify_input.draft_token)
        # Grammar thread on: the barrier and the mask build start now and run while the scheduler thread prepares
        # and launches the target verify (which touches neither the matchers nor the previous result); off: recorded,
        # run in build_vocab_mask after the launch. GrammarStep decides which.
        return InFlight(batch, barrier=functools.partial(self.feed_results, self.result_queue, batch.reqs), tree=tree)

    def rows_to_feed(self, batch: Any, result: Any, finished: List[str]
                     ) -> Optional[Tuple[List[RowRun], ResultRuns]]:
        """A queued result's rows, exactly as post-processing will commit them (same rows skipped: finished /
        retracted / still-chunked; same output positions, ``len(req.output_ids)`` before the run is appended);
        counted as ``barrier_runs``. None for a batch without a grammar."""
        reqs = getattr(batch, "reqs", None) or []
        if not any(req.grammar is not None for req in reqs):
            return None
        got = result_rows(batch, result)
        if got is not None:
            self.step.count("barrier_runs")
        return got

    def bound_ledger(self, queued: List[Tuple[Any, Any]], current_reqs: Sequence[Any]) -> None:
        """Bound the ledger by the requests SGLang can still hand back (this batch's and the queued results'),
        computed only when the ledger could be pruned: it holds more than a few times this batch."""
        step = self.step
        if step.ledger_outgrows(len(current_reqs)):
            live = {str(req.rid) for req in current_reqs}
            for b, _ in queued:
                live.update(str(req.rid) for req in getattr(b, "reqs", None) or [])
            step.prune(live)

    def leftover(self, grammar: Any, step_mask: StepMask, sampling: Any, verify_input: Any) -> Any:
        """As SGLang: the sampler checks ``verify_input.grammar``, and the extend stage's leftover vocab mask must not
        be applied to the verify logits. Returns the device mask (None: no row constrained)."""
        if grammar is not None:
            verify_input.grammar = grammar
            sampling.vocab_mask = None
        return step_mask.device_mask


def band_of(rt: Runtime) -> Band016:
    """``rt``'s band, made at the first call in this process (plugin and patched SGLang alike)."""
    b = rt.band
    if not isinstance(b, Band016):
        b = rt.band = Band016(rt.step)
    return b


# -- scheduler side -------------------------------------------------------------------------------------------------
def keeps_overlap(rt: Runtime, batch: Any, result_queue: Any) -> bool:
    """True: this grammar decode batch may overlap the previous one, because its verify feeds the previous batch's
    grammars itself (the barrier, ``Band.feed_results``) before it needs the mask. Records ``result_queue``."""
    b = band_of(rt)
    b.result_queue = result_queue
    if batch is None or not getattr(batch, "has_grammar", False) or not batch.forward_mode.is_decode():
        return False
    if not is_eagle_family(batch):
        announce_stand_aside(rt, batch)  # e.g. NGRAM: SGLang's synchronous grammar path, said once
        return False
    keep = b.mask_verdict(batch, keep=True)
    if keep and len(result_queue or ()) > 0:
        rt.step.count("overlap_kept")
    return keep


def announce_stand_aside(rt: Runtime, batch: Any) -> None:
    """Log once per process and algorithm that grammar batches of an algorithm outside the family keep SGLang's own
    path (counted as ``stand_aside_algorithms``)."""
    name = algorithm_name(batch)
    announced = band_of(rt).announced
    if name and name != "NONE" and name not in announced:
        announced.add(name)
        rt.step.count("stand_aside_algorithms")
        logger.info(support.stand_aside_message(BAND, name))
        rt.step.telemetry.write_stats()


# -- worker side (run_eagle_verify) ---------------------------------------------------------------------------------
def begin_verify(rt: Runtime, batch: Any, verify_input: Any, owned: Optional[bool] = None) -> Optional[InFlight]:
    """Before the target-verify launch (patched SGLang): :meth:`Band016.verify_step` started (``Band.start``).
    None: SGLang's own path."""
    b = band_of(rt)
    return b.start(b.verify_step(batch, verify_input, owned))


def before_verify(rt: Runtime, batch: Any, verify_input: Any) -> bool:
    """``run_eagle_verify`` entry, before ``eagle_prepare_for_verify`` builds the target's input from the draft tokens
    (and before :func:`begin_verify`): decides whether the plugin owns this step (:meth:`Band016.owns_verify`,
    returned for :func:`begin_verify`); grammar-forced drafts replace the top-path drafts of an owned step
    (:func:`~sglang_eagle_overlap.integration.drafts.before_verify`); any other verify drops the previous picks."""
    owned = band_of(rt).owns_verify(batch)
    drafts.before_verify(rt, batch, verify_input, owned=owned)
    return owned


def after_sample(rt: Runtime, batch: Any, sample_result: Any) -> None:
    """Right after ``eagle_sample`` of a plugin-owned step: the accepted node's forced tokens, picked on the device."""
    drafts.after_sample(rt, batch, sample_result)


def build_vocab_mask(rt: Runtime, verify: InFlight, verify_input: Any, batch: Any) -> Optional[torch.Tensor]:
    """After the target-verify launch, before sampling (patched SGLang; the hook calls ``Band.finish`` itself).
    Returns the device mask (None: no row constrained)."""
    assert verify.job is not None  # started by begin_verify
    mask: Optional[torch.Tensor] = band_of(rt).finish(
        verify.job, batch.reqs, batch.sampling_info, device=verify_input.retrieve_next_token.device,
        draft_device=verify_input.draft_token, verify_input=verify_input)
    return mask


# -- post-processing ------------------------------------------------------------------------------------------------
def feed_tokens(rt: Runtime, req: Any, tokens: Any) -> List[int]:
    """``_accept_grammar_tokens``: the run is not yet appended, so it starts at ``len(req.output_ids)``. The common
    case -- the barrier fed this run and it was kept whole -- is answered in one call (once per request and step)."""
    toks = (tokens,) if isinstance(tokens, int) else tokens
    start = len(req.output_ids)
    kept = rt.step.replay_whole(str(req.rid), start, toks)
    return kept if kept is not None else feed_run(rt.step, req, start, toks)


def feed_prefill_token(rt: Runtime, req: Any, next_token_id: int) -> None:
    """``_apply_prefill_grammar``: the token was appended already. ``grammar.finished`` mirrors ``req.finished()``.

    Known difference from SGLang (documented in docs/compatibility.md): the barrier may feed the first token before
    SGLang's ``update_finish_state``, so a request whose very first token terminates the grammar finishes at prefill."""
    feed_run(rt.step, req, len(req.output_ids) - 1, [int(next_token_id)])
    req.grammar.finished = req.finished()


def is_eagle_server(rt: Runtime, server_args: Any) -> bool:
    """:meth:`Band016.is_eagle_server` of ``rt``'s band (the post-processing hooks' gate, once per request and step:
    the kept decision is read here, without a call)."""
    known = getattr(rt.band, "eagle_server", None)
    if known is not None and known[0] is server_args:
        return bool(known[1])
    return band_of(rt).is_eagle_server(server_args)
