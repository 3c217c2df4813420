"""SGLang ``Req`` objects -> core inputs, and the core's per-request outcomes back into SGLang (both bands).

Decided once for every integration (hooks and patched SGLang alike):

* the run a request keeps from one verify step is the prefix its grammar consumed, stopping after the token that
  terminated it; if the grammar had already terminated, the first token is kept (SGLang's ``_accept_grammar_tokens``
  does the same: ``accept_token`` on a terminated grammar is a no-op and the token is still committed);
* a rejected token aborts that request alone (HTTP 500 for it, ``Grammar accept_token failed: ...``);
* a grammar that raises during the mask build aborts that request alone (``Grammar mask build failed: ...``);
* finished requests, requests already being aborted (``to_finish`` set: with overlap the next batch is formed before
  the abort lands, so a failed grammar would be built -- and fail -- once more), and requests without a grammar are
  unconstrained in the tree mask (SG#28986).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from sglang_eagle_overlap.core import (FeedOutcome, GrammarStep, MaskBatch, MaskRequest, ResultRuns, RowRun, Run,
                                       StepMask)

__all__ = [
    "abort_mask_failed",
    "algorithm_name",
    "committed_rows",
    "finish_with_error",
    "innermost_grammar",
    "is_llguidance",
    "is_xgrammar",
    "feed_run",
    "kept_tokens",
    "ledger_run",
    "mask_request_for",
    "mask_requests",
    "output_stride",
    "VIEW_ATTR",
    "record_on_xgrammar",
    "RequestView",
    "result_rows",
    "settle_mask",
]

logger = logging.getLogger("sglang_eagle_overlap")
# ``RowRun`` from one tuple of its fields (key, grammar, matcher, start, row), without the named tuple's Python
# ``__new__`` frame: one is made per constrained request per result, on the scheduler thread
_row_run = functools.partial(tuple.__new__, RowRun)

# ``req`` / ``reqs`` are SGLang's ``Req`` objects and ``grammar`` its grammar objects: Any (SGLang ships no types).


def algorithm_name(obj: Any) -> str:
    """The algorithm of a batch (``spec_algorithm``), server args (``speculative_algorithm``), an enum or a string."""
    algo = obj
    if obj is not None and not isinstance(obj, str) and not hasattr(obj, "name"):
        algo = getattr(obj, "spec_algorithm", None)
        if algo is None:
            algo = getattr(obj, "speculative_algorithm", None)
    if algo is None:
        return ""
    return str(getattr(algo, "name", algo)).upper()


def is_xgrammar(grammar: Any) -> bool:
    """SGLang's ``XGrammarGrammar`` itself (not a wrapper such as the reasoning wrapper)."""
    return type(grammar).__name__ == "XGrammarGrammar" and hasattr(grammar, "matcher")


def is_llguidance(grammar: Any) -> bool:
    """SGLang's ``GuidanceGrammar`` itself (not a wrapper): its ``ll_matcher`` shares xgrammar's bitmask layout (int32
    words, token ``t`` at bit ``t % 32`` of word ``t // 32``), so its rows go in the same tree mask."""
    return type(grammar).__name__ == "GuidanceGrammar" and hasattr(grammar, "ll_matcher")


def innermost_grammar(grammar: Any) -> Any:
    """The grammar inside SGLang's reasoning wrapper(s) (``ReasonerGrammarObject``), or ``grammar`` itself."""
    seen = 0
    while type(grammar).__name__ == "ReasonerGrammarObject" and seen < 4:
        grammar = getattr(grammar, "grammar", None)
        seen += 1
    return grammar


class RequestView:
    """A request's two tree-mask rows (constrained / unconstrained: immutable ``MaskRequest``s that every step's batch
    shares), made from its grammar object once instead of at every step (one ``MaskRequest`` per request per
    step was the largest per-request piece before the verify launch), and the grammar they were made from. The
    constrained row holds the bare xgrammar matcher when the grammar is SGLang's ``XGrammarGrammar`` itself, else the
    grammar object, with its bare ``llguidance.LLMatcher`` beside it when the grammar is SGLang's ``GuidanceGrammar``
    itself (batched fills). :func:`committed_rows` reads the request's ledger key (the rows' ``request_id``: its id as a
    string) and its bare matcher (or None) from it instead of deriving them per step. Kept on the ``Req`` (attribute
    :data:`VIEW_ATTR`) by :func:`mask_request_for`, valid while the request holds the same grammar object and that
    grammar the same matcher (a host that rebuilds or swaps either gets a new view at the next step). Holds no
    reference to the ``Req`` (no cycle: it goes with the request)."""

    __slots__ = ("grammar", "row", "free")

    def __init__(self, req: Any, grammar: Any) -> None:
        key = str(getattr(req, "rid", ""))
        self.grammar = grammar
        self.free = MaskRequest(None, None, key)
        if grammar is None:
            self.row = self.free
        elif is_xgrammar(grammar):
            self.row = MaskRequest(grammar.matcher, None, key)
        elif is_llguidance(grammar):
            self.row = MaskRequest(None, grammar, key, grammar.ll_matcher)
        else:
            self.row = MaskRequest(None, grammar, key)


VIEW_ATTR = "_sglang_eo_view"


def mask_request_for(req: Any) -> MaskRequest:
    """One batch row of the tree mask: unconstrained (no grammar, finished: SG#28986, or being aborted: its grammar is
    not called again and its tokens are discarded), the bare xgrammar matcher
    (native fills, never ``XGrammarGrammar.rollback``, SG#38863), an llguidance grammar with its bare matcher (batched
    fills), or the generic walk through the grammar object API
    (reasoning wrapper, other backends). The row is the request's shared :class:`RequestView` row: never mutate it.
    The view kept on the request is used while its grammar and that grammar's matcher (its row's) are the same
    objects; else a new one is made and kept. The one place a request's mask row is chosen: a hook on it (test fault
    injection) sees every row of every build."""
    grammar = getattr(req, "grammar", None)
    view = _view_of(req, grammar)
    if grammar is None:
        return view.free
    finished = getattr(req, "finished", None)
    if (callable(finished) and finished()) or getattr(req, "to_finish", None) is not None:
        return view.free
    return view.row


def _view_of(req: Any, grammar: Any) -> RequestView:
    """``req``'s kept :class:`RequestView` while it was made from ``grammar`` and that grammar's matcher, else a new
    one, kept on the request when it takes the attribute."""
    view: Optional[RequestView] = getattr(req, VIEW_ATTR, None)
    if view is None or view.grammar is not grammar or (view.row.matcher is not None and
                                                        view.row.matcher is not grammar.matcher) or (
            view.row.guidance is not None and view.row.guidance is not grammar.ll_matcher):
        view = RequestView(req, grammar)
        try:
            setattr(req, VIEW_ATTR, view)
        except AttributeError:  # a request object that takes no new attribute: a fresh view each step, same rows
            pass
    return view


def mask_requests(reqs: Iterable[Any]) -> MaskBatch:
    """:func:`mask_request_for` of every request (looked up at each call: test fault injection wraps it), as a
    ``MaskBatch``, which sorts the rows for the build as they are added."""
    return MaskBatch.of(map(mask_request_for, reqs))


def finish_with_error(req: Any, message: str) -> bool:
    """Finish ``req`` alone with ``message`` (HTTP 500 for that request); False if it was already being finished (its
    first, clearer reason is kept)."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if getattr(req, "to_finish", None) is not None:
        return False
    req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    return True


def record_on_xgrammar(grammar: Any, outcome: FeedOutcome) -> None:
    """What SGLang's ``XGrammarGrammar.accept_token`` records on itself besides feeding its matcher, for a run the
    ledger fed to that matcher directly: the last token offered (``current_token``; a rejected one included) and the
    accepted ones (``accepted_tokens``). A grammar terminated before the run was offered nothing."""
    kept = outcome.retained
    if outcome.error is not None:
        grammar.current_token = outcome.tokens[len(kept)]
    elif kept:
        grammar.current_token = kept[-1]
    grammar.accepted_tokens.extend(kept)


def ledger_run(req: Any, start: int, tokens: Sequence[int]) -> Run:
    """The ledger's run for ``req``'s ``tokens`` at output position ``start``: keyed by request id, through the bare
    xgrammar matcher when the grammar is SGLang's ``XGrammarGrammar`` itself (``AcceptLedger``, "Native feed": fewer
    native calls, no wrapper frame; the wrapper's own record is kept by :func:`record_on_xgrammar`), else through the
    grammar object."""
    grammar = req.grammar
    return Run(key=str(req.rid), grammar=grammar, matcher=grammar.matcher if is_xgrammar(grammar) else None,
               start=start, tokens=tokens)


def feed_run(step: GrammarStep, req: Any, start: int, tokens: Sequence[int]) -> List[int]:
    """Feed ``tokens`` (committed by ``req`` at output position ``start``) to its grammar exactly once and return the
    tokens ``req`` keeps (module docstring): replayed from the ledger when a barrier fed the run already
    (``GrammarStep.replay``, counted as ``replays``), else fed now. A rejected token aborts that request alone."""
    o = step.replay(str(req.rid), start, tokens)
    if o is None:
        o = step.feed((ledger_run(req, start, [int(t) for t in tokens]),), record_on_xgrammar, count_replays=True)[0]
    return kept_tokens(step, req, o)


def kept_tokens(step: GrammarStep, req: Any, outcome: FeedOutcome) -> List[int]:
    """The tokens ``req`` keeps from ``outcome`` (module docstring): the retained ones, unless the grammar had already
    terminated (then the first token); a rejection aborts ``req`` alone (once, counted as ``aborts``)."""
    if outcome.error is not None:
        if finish_with_error(req, f"Grammar accept_token failed: request {req.rid}: {outcome.error}"):
            logger.error("Grammar accept_token failed for req %s with tokens %s: %s", req.rid, list(outcome.tokens),
                         outcome.error)
            step.count("aborts")
        return list(outcome.retained)
    if not outcome.retained and outcome.terminated and outcome.tokens:
        return [int(outcome.tokens[0])]
    return list(outcome.retained)


def abort_mask_failed(req: Any, error: str) -> None:
    """Finish ``req`` alone: its grammar raised during the tree mask build (its drafts were neutralised)."""
    logger.error("sglang-eagle-overlap: aborting request %s: its grammar failed during the tree mask build: %s",
                 req.rid, error)
    finish_with_error(req, f"Grammar mask build failed: request {req.rid}: {error}")


def committed_rows(reqs: Sequence[Any], prefill: bool, finished: Optional[List[str]] = None) -> List[RowRun]:
    """The ledger's ``(key, grammar, start, matcher, row)`` for every row of a result whose run SGLang's
    post-processing will commit to a grammar: the request is constrained, not finished (SG#28986), not retracted,
    and -- for a prefill result (one token per row) -- not a chunk that did not finish its prompt. Keyed by request id
    at output position ``len(req.output_ids)`` (the result is not yet appended); through the bare xgrammar matcher
    when the grammar is SGLang's ``XGrammarGrammar`` itself (``AcceptLedger``, "Native feed"), else through the
    grammar object. Reads the requests only, never the result's tokens. ``finished`` collects the ids of the
    constrained requests that are finished (the ledger forgets them)."""
    out: List[RowRun] = []
    for i, req in enumerate(reqs):
        grammar = req.grammar
        if grammar is None or req.is_retracted:
            continue
        if req.finished():
            if finished is not None:
                finished.append(str(req.rid))
            continue
        if prefill and req.inflight_middle_chunks > 0:
            continue  # a chunk that did not finish the prompt emits no token
        row = _view_of(req, grammar).row  # its key and kind, made at its first mask build
        out.append(_row_run((row.request_id, grammar, row.matcher, len(req.output_ids), i)))
    return out


def output_stride(result: Any) -> int:
    """Row stride of a speculative result's ``next_token_ids``: ``speculative_output_stride`` (0.5.20+), else
    ``speculative_num_draft_tokens`` (0.5.16-0.5.19)."""
    stride = getattr(result, "speculative_output_stride", None)
    if stride is None:
        stride = getattr(result, "speculative_num_draft_tokens", None)
    if stride is None or stride < 1:
        raise RuntimeError(
            f"speculative result is missing a positive output row stride (speculative_output_stride="
            f"{getattr(result, 'speculative_output_stride', None)!r})"
        )
    return int(stride)


def result_rows(batch: Any, result: Any, finished: Optional[List[str]] = None
                ) -> Optional[Tuple[List[RowRun], ResultRuns]]:
    """The rows one ``(batch, result)`` of the overlap loop commits to grammars (:func:`committed_rows`; the batch row
    is the last element) and the result's runs (``ResultRuns``: a decode row's run is ``next_token_ids[i * stride :
    i * stride + accept_lens[i]]``, a prefill row's the one token ``next_token_ids[i]``), or None when it commits
    none: no result tokens, an idle batch, neither decode nor extend, or a decode result without accept lengths
    (whether the batch holds a grammar at all, each band asks first, in its own terms). Does not wait for the result's
    host copy: ``ResultRuns`` carries its event (``copy_done``). Both bands' barrier loop (``Band.feed_results``)
    reads a result through this, so they skip and slice the same rows."""
    reqs = getattr(batch, "reqs", None) or []
    mode = batch.forward_mode
    if result is None or result.next_token_ids is None or mode.is_idle():
        return None
    is_decode = mode.is_decode() and result.accept_lens is not None
    if not (is_decode or mode.is_extend()):
        return None
    runs = ResultRuns(result.next_token_ids, result.accept_lens if is_decode else None,
                      output_stride(result) if is_decode else 1, result.copy_done)
    return committed_rows(reqs, not is_decode, finished), runs


def settle_mask(step_mask: StepMask, reqs: Sequence[Any]) -> Any:
    """After ``GrammarStep.finish_build`` / ``build_mask``, before sampling: abort every request whose grammar raised
    during the build (alone), and return the batch's first grammar object (None: no request constrained; the band then
    leaves SGLang's sampler without a grammar, and clears SGLang's leftover extend-stage mask its own way)."""
    for i, error in step_mask.tree.failed:
        abort_mask_failed(reqs[i], error)
    return next((r.grammar for r in reqs if getattr(r, "grammar", None) is not None), None)
