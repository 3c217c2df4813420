"""SGLang 0.5.16: the grammar-overlap integration itself. The hook modules next to this one and the vendored patch
(``patches/sglang-0.5.16``) both call these functions, so one code path serves plugin and patch users.

SGLang 0.5.16 forces every speculative grammar decode batch out of overlap (``need_grammar_sync``). With this band,
EAGLE / EAGLE3 / STANDALONE decode batches whose grammars are all xgrammar stay overlapped; one verify step is:

1. ``Scheduler.is_disable_overlap_for_batch`` -> :func:`keeps_overlap`: drop the grammar-sync reason (only that one);
   it also records the overlap loop's ``result_queue`` on the runtime (the verify barrier reads it).
2. ``run_eagle_verify``, before the target-verify launch -> :func:`begin_verify`: the verify tree's async host copy
   (``GrammarStep.copy_tree``) replaces the blocking ``.cpu()``, then ``GrammarStep.start_build`` with
   :func:`advance_queued_results` as the barrier (the previous batch's accepted runs, still in ``result_queue``,
   checked by the ledger and queued by row) and the step's one native call handed to the grammar thread (inline, with
   the grammar thread off: recorded for 3).
3. ``run_eagle_verify``, after the launch -> :func:`build_vocab_mask`: ``GrammarStep.finish_build`` joins the job (or
   runs it), then the SGLang side: abort failed requests alone, ``verify_input.grammar``, clear the extend stage's
   ``sampling_info.vocab_mask``.
4. Post-processing ``_accept_grammar_tokens`` / ``_apply_prefill_grammar`` -> :func:`accept_tokens` /
   :func:`accept_prefill_token`: replay what 2-3 fed (``GrammarStep.replay_whole``, one call per request), or feed it
   now, with SGLang's retained-run and abort semantics
   (:func:`~sglang_eagle_overlap.integration.requests.accept_run`).

From "the verify result arrives" to ``accept_token``: the barrier (:func:`advance_queued_results`) ->
``requests.result_rows`` -> ``requests.advance_rows_later`` -> ``GrammarStep.feed_later`` -> ``LedgerPlan.add_rows``
(checks at once; a fresh run through a bare xgrammar matcher queued by row, its tokens read in C++ by the build's
native call, ``LedgerPlan.fill`` records the outcomes and ``record_on_xgrammar`` SGLang's own record); a run the
barrier did not see (post-processing first: :func:`accept_tokens` -> ``accept_run`` -> ``GrammarStep.feed``)
is fed at once through the same ledger, ``grammar.accept_token`` for grammar objects other than ``XGrammarGrammar``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

from sglang_eagle_overlap import support
from sglang_eagle_overlap.core import MaskJob
from sglang_eagle_overlap.integration import drafts
from sglang_eagle_overlap.integration.requests import (
    accept_run,
    advance_rows_later,
    algorithm_name,
    innermost_grammar,
    is_xgrammar,
    mask_requests,
    result_rows,
    settle_mask,
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
    "announce_stand_aside",
    "VerifyStep",
    "accept_prefill_token",
    "accept_tokens",
    "advance_queued_results",
    "after_sample",
    "algorithm_name",
    "before_verify",
    "begin_verify",
    "build_vocab_mask",
    "can_mask",
    "mask_verdict",
    "owns_verify",
    "eagle_server",
    "is_eagle_family",
    "keeps_overlap",
]

BAND = "0.5.16"
# Algorithms whose grammar decode batches stay in the overlap: those whose verify runs through
# ``eagle_worker_common.run_eagle_verify`` (EAGLE, EAGLE3, STANDALONE; NEXTN arrives resolved to EAGLE). The decision
# per algorithm, with its reason, is data in :mod:`sglang_eagle_overlap.support`.
EAGLE_FAMILY = support.kept_algorithms(BAND)


@dataclass(slots=True)
class VerifyStep:
    """One plugin-owned verify step between :func:`begin_verify` and :func:`build_vocab_mask`; ``job`` is its
    grammar work (started on the grammar thread by :func:`begin_verify`, or recorded there to run inline)."""

    batch: Any
    job: MaskJob


def is_eagle_family(obj: Any) -> bool:
    return algorithm_name(obj) in EAGLE_FAMILY


def eagle_server(rt: Runtime, server_args: Any) -> bool:
    """:func:`is_eagle_family` of the server's arguments, decided at the first ask for that ``server_args`` object and
    kept on the runtime (the post-processing hooks ask once per request and step)."""
    known = rt.eagle_server
    if known is None or known[0] is not server_args:
        known = rt.eagle_server = (server_args, is_eagle_family(server_args))
    return known[1]


def can_mask(batch: Any) -> bool:
    """The native mask uses xgrammar's bitmask layout: a batch with another backend (llguidance, outlines) keeps
    SGLang's own path. A reasoning wrapper around xgrammar (or around nothing) is fine: it takes the generic walk."""
    for req in batch.reqs:
        grammar = getattr(req, "grammar", None)
        if grammar is None or type(grammar).__name__ == "XGrammarGrammar":  # no grammar, or xgrammar itself
            continue
        inner = innermost_grammar(grammar)
        if inner is not None and not is_xgrammar(inner):
            return False
    return True


def mask_verdict(rt: Runtime, batch: Any, *, keep: bool = False) -> bool:
    """:func:`can_mask` of ``batch``, looked at once per step. The scheduler's overlap decision (:func:`keeps_overlap`,
    ``keep=True``) looks and keeps the verdict on the runtime with the request list it was made for; the same batch's
    verify entry (:func:`owns_verify`) comes next, with nothing in between that changes its requests or their grammars
    (a request's grammar is set before it joins a running batch), and takes it -- for that same list object, of the
    same length -- instead of looking again; any other batch (filtered into a new list, merged into a longer one, a
    verify without an overlap decision) is looked at."""
    reqs = batch.reqs
    if not keep:
        known = rt.mask_verdict
        if known is not None and known[0] is reqs and known[1] == len(reqs):
            rt.mask_verdict = None
            return known[2]
        return can_mask(batch)
    verdict = can_mask(batch)
    rt.mask_verdict = (reqs, len(reqs), verdict)
    return verdict


# -- scheduler side -------------------------------------------------------------------------------------------------
def keeps_overlap(rt: Runtime, batch: Any, result_queue: Any) -> bool:
    """True: this grammar decode batch may overlap the previous one, because its verify advances the previous batch's
    grammars itself (:func:`advance_queued_results`) before it needs the mask. Records ``result_queue``."""
    rt.result_queue = result_queue
    if batch is None or not getattr(batch, "has_grammar", False) or not batch.forward_mode.is_decode():
        return False
    if not is_eagle_family(batch):
        announce_stand_aside(rt, batch)  # e.g. NGRAM: SGLang's synchronous grammar path, said once
        return False
    keep = mask_verdict(rt, batch, keep=True)
    if keep and len(result_queue or ()) > 0:
        rt.step.count("overlap_kept")
    return keep


def announce_stand_aside(rt: Runtime, batch: Any) -> None:
    """Log once per process and algorithm that grammar batches of an algorithm outside the family keep SGLang's own
    path (counted as ``stand_aside_algorithms``)."""
    name = algorithm_name(batch)
    if name and name != "NONE" and name not in rt.announced:
        rt.announced.add(name)
        rt.step.count("stand_aside_algorithms")
        logger.info(support.stand_aside_message(BAND, name))
        rt.step.telemetry.write_stats()


# -- worker side (run_eagle_verify) ---------------------------------------------------------------------------------
def owns_verify(rt: Runtime, batch: Any) -> bool:
    """Whether the plugin owns this verify step: a non-idle EAGLE-family grammar batch whose grammars it can mask (a
    batch with another backend is counted as ``fallback_steps`` and left to SGLang). Decided once per step, at the
    ``run_eagle_verify`` entry (:func:`before_verify`), and handed to :func:`begin_verify`."""
    if not getattr(batch, "has_grammar", False) or not is_eagle_family(batch) or batch.forward_mode.is_idle():
        return False
    if not mask_verdict(rt, batch):
        rt.step.count("fallback_steps")
        return False
    return True


def begin_verify(rt: Runtime, batch: Any, verify_input: Any, owned: Optional[bool] = None) -> Optional[VerifyStep]:
    """Before the target-verify launch: start the verify tree's async host copy. None: SGLang's own path. ``owned``:
    :func:`before_verify`'s decision for this step (None: decide here)."""
    if not (owns_verify(rt, batch) if owned is None else owned):
        return None
    pending = rt.step.copy_tree(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling,
                                verify_input.draft_token)
    # Grammar thread on: the barrier and the mask build start now and run while the scheduler thread prepares and
    # launches the target verify (which touches neither the matchers nor the previous result); off: recorded here,
    # run in build_vocab_mask after the launch. GrammarStep decides which.
    queue, reqs = rt.result_queue, batch.reqs
    job = rt.step.start_build(mask_requests(reqs), pending, vocab_size=batch.sampling_info.vocab_size,
                              barrier=lambda: advance_queued_results(rt, queue, reqs), allow_timeout=True)
    return VerifyStep(batch=batch, job=job)


def before_verify(rt: Runtime, batch: Any, verify_input: Any) -> bool:
    """``run_eagle_verify`` entry, before ``eagle_prepare_for_verify`` builds the target's input from the draft tokens
    (and before :func:`begin_verify`): decides whether the plugin owns this step (:func:`owns_verify`, returned for
    :func:`begin_verify`); grammar-forced drafts replace the top-path drafts of an owned step
    (:func:`~sglang_eagle_overlap.integration.drafts.before_verify`); any other verify drops the previous picks."""
    owned = owns_verify(rt, batch)
    drafts.before_verify(rt, batch, verify_input, owned=owned)
    return owned


def after_sample(rt: Runtime, batch: Any, sample_result: Any) -> None:
    """Right after ``eagle_sample`` of a plugin-owned step: the accepted node's forced tokens, picked on the device."""
    drafts.after_sample(rt, batch, sample_result)


def build_vocab_mask(rt: Runtime, verify: VerifyStep, verify_input: Any, batch: Any) -> Optional[torch.Tensor]:
    """After the target-verify launch, before sampling. Returns the device mask (None: no row constrained)."""
    step_mask = rt.step.finish_build(verify.job, device=verify_input.retrieve_next_token.device,
                                     draft_device=verify_input.draft_token)
    grammar = settle_mask(step_mask, batch.reqs)
    if grammar is not None:
        # As SGLang: the sampler checks ``verify_input.grammar``, and the extend stage's leftover vocab mask must not
        # be applied to the verify logits.
        verify_input.grammar = grammar
        batch.sampling_info.vocab_mask = None
    return step_mask.device_mask


def advance_queued_results(rt: Runtime, queue: Any, current_reqs: Sequence[Any] = ()) -> int:
    """The barrier: feed the results still in ``queue`` to their grammars exactly as post-processing will (same rows
    skipped: finished / retracted / still-chunked; same output positions, ``len(req.output_ids)`` before the run is
    appended). Called as a mask build's barrier, the runs are fed by that build, with its tree walk, in one native
    call (``GrammarStep.feed_later``); called on its own, at once. Returns the tokens fed by this call (0 when the
    build feeds them; replays feed nothing)."""
    step = rt.step
    if not queue:
        return 0
    fed_before = step.tokens_fed
    queued = list(queue)
    for b, r in queued:
        reqs = getattr(b, "reqs", None) or []
        if not any(req.grammar is not None for req in reqs):
            continue
        got = result_rows(b, r)
        if got is None:
            continue
        step.count("barrier_runs")
        advance_rows_later(step, *got)
    # Bound the ledger by the requests SGLang can still hand back (this batch's and the queued results'), computed
    # only when the ledger could be pruned: it holds more than a few times this batch.
    if step.ledger_outgrows(len(current_reqs)):
        live = {str(req.rid) for req in current_reqs}
        for b, _ in queued:
            live.update(str(req.rid) for req in getattr(b, "reqs", None) or [])
        step.prune(live)
    return step.tokens_fed - fed_before


# -- post-processing ------------------------------------------------------------------------------------------------
def accept_tokens(rt: Runtime, req: Any, tokens: Any) -> List[int]:
    """``_accept_grammar_tokens``: the run is not yet appended, so it starts at ``len(req.output_ids)``. The common
    case -- the barrier fed this run and it was kept whole -- is answered in one call (once per request and step)."""
    toks = (tokens,) if isinstance(tokens, int) else tokens
    start = len(req.output_ids)
    kept = rt.step.replay_whole(str(req.rid), start, toks)
    return kept if kept is not None else accept_run(rt.step, req, start, toks)


def accept_prefill_token(rt: Runtime, req: Any, next_token_id: int) -> None:
    """``_apply_prefill_grammar``: the token was appended already. ``grammar.finished`` mirrors ``req.finished()``.

    Known difference from SGLang (documented in docs/compatibility.md): the barrier may feed the first token before
    SGLang's ``update_finish_state``, so a request whose very first token terminates the grammar finishes at prefill."""
    accept_run(rt.step, req, len(req.output_ids) - 1, [int(next_token_id)])
    req.grammar.finished = req.finished()
