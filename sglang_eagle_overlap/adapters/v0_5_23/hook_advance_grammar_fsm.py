"""AROUND ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.advance_grammar_fsm``.

Why: this is the single place SGLang 0.5.23 advances grammar FSMs over committed tokens, called both from the grammar
barrier (``Scheduler._advance_pending_grammar``, inside the next batch's verify, overlapping its forward) and lazily
from the result processors. Upstream makes it idempotent with a per-result flag only; the plugin routes every advance
through ``STATE.ledger`` (:class:`~sglang_eagle_overlap.core.AcceptLedger`), keyed by (request id, output position),
so a token run is fed to a matcher exactly once whichever caller gets there first, and two callers that disagree on
the accepted tokens are caught.

How: same gating and semantics as upstream --

* skip when ``result.grammar_advanced`` or the batch has no grammar, or the mode is neither decode nor extend;
* extend results advance the single prefill token; requests with in-flight chunked-prefill chunks are skipped;
* decode results advance ``next_token_ids[i*stride : i*stride + accept_lens[i]]`` and store the retained run in
  ``result.grammar_retained_tokens`` (stop after the terminating token; if the grammar was already terminated the
  first token is retained, as upstream does);
* retracted / finished requests are skipped (SG#28986);
* a rejected token aborts the request with ``FINISH_ABORT("Grammar accept_token failed: ...")``
  (:func:`~sglang_eagle_overlap.adapters.common.advance_or_abort`).

The output position is ``len(req.output_ids)`` at advance time: the result being advanced is not yet appended. If the
ledger and SGLang disagree about the position (a request re-anchored by SGLang, e.g. its grammar was rebuilt), the
entry is re-anchored at SGLang's position and a warning is logged.

Upstream state: 0.5.23 (``result.grammar_advanced``, ``grammar_retained_tokens``).

When to remove: together with the other hooks, when upstream's grammar path no longer needs the plugin's mask step.
"""

from __future__ import annotations

from typing import Any, List, Optional

from sglang_eagle_overlap.adapters.common import STATE, Hook, advance_or_abort, prune_ledger

__all__ = ["HOOK", "TARGET", "advance_grammar_fsm_around", "advance_request"]

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "advance_grammar_fsm"
)


def _output_stride(result: Any) -> int:
    stride = getattr(result, "speculative_output_stride", None)
    if stride is None:
        stride = getattr(result, "speculative_num_draft_tokens", None)
    if stride is None or stride < 1:
        raise RuntimeError(
            f"speculative result is missing a positive output row stride (speculative_output_stride="
            f"{getattr(result, 'speculative_output_stride', None)!r})"
        )
    return int(stride)


def advance_request(req: Any, tokens: List[int]) -> List[int]:
    """Advance ``req.grammar`` over ``tokens`` (committed at output position ``len(req.output_ids)``) exactly once.

    Returns the retained prefix (upstream's ``_accept_grammar_tokens`` contract).
    """
    outcome = advance_or_abort(req, len(req.output_ids), tokens)
    retained = list(outcome.retained)
    if outcome.error is None and not retained and outcome.terminated and tokens:
        # Upstream: accept_token on a terminated grammar is a no-op, the first token is kept, then it stops.
        retained = [int(tokens[0])]
    return retained


def advance_grammar_fsm_around(original: Any, self: Any, result: Any, batch: Any) -> None:
    if not STATE.active:
        return original(self, result, batch)
    if result.grammar_advanced or not batch.has_grammar:
        return None
    is_decode = batch.forward_mode.is_decode()
    if not (is_decode or batch.forward_mode.is_extend()):
        return None
    if is_decode and result.accept_lens is None:
        return None
    if result.copy_done is not None:
        result.copy_done.synchronize()
    next_token_ids = result.next_token_ids.tolist()
    if is_decode:
        accept_lens = result.accept_lens.tolist()
        stride = _output_stride(result)
    finished: List[str] = []
    live = set()
    retained: List[Optional[List[int]]] = [None] * len(batch.reqs)
    for i, req in enumerate(batch.reqs):
        if req.grammar is None:
            continue
        if req.finished():
            finished.append(str(req.rid))
            continue
        if req.is_retracted or (not is_decode and req.inflight_middle_chunks > 0):
            continue
        live.add(str(req.rid))
        run = next_token_ids[i * stride : i * stride + accept_lens[i]] if is_decode else [next_token_ids[i]]
        retained[i] = advance_request(req, run)
    if is_decode:
        result.grammar_retained_tokens = retained
    result.grammar_advanced = True
    prune_ledger(live, finished)
    return None


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=advance_grammar_fsm_around,
    callers=(),  # a method: every caller goes through the class attribute
    why="exactly-once grammar advance through the AcceptLedger (barrier and result processors)",
)
