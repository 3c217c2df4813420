"""AROUND ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.advance_grammar_fsm``.

Why: this is the single place SGLang 0.5.23 advances grammar FSMs over committed tokens, called both from the grammar
barrier (``Scheduler._advance_pending_grammar``, inside the next batch's verify, overlapping its forward) and lazily
from the result processors. SGLang makes it idempotent with a per-result flag only; the plugin routes every advance
through the ledger, keyed by (request id, output position), so a run is fed exactly once whichever caller gets there
first, and two callers that disagree on the accepted tokens are caught.

How: :func:`~.band.advance_grammar_fsm` (same gating and semantics as SGLang, see there).

Upstream state: 0.5.23 (``result.grammar_advanced``, ``grammar_retained_tokens``).

When to remove: together with the other hooks, when upstream's grammar path no longer needs the plugin's mask step.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_23 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "advance_grammar_fsm"
)


# ``self`` (SGLang's SchedulerBatchResultProcessor), ``result`` and ``batch`` are SGLang's objects: Any (SGLang ships
# no types).
def advance_grammar_fsm_around(original: Callable[..., Any], self: Any, result: Any, batch: Any) -> Any:
    rt = runtime.active()
    if rt is None:
        return original(self, result, batch)
    return band.advance_grammar_fsm(rt, result, batch)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=advance_grammar_fsm_around,
    callers=(),  # a method: every caller goes through the class attribute
    why="exactly-once grammar advance through the AcceptLedger (barrier and result processors)",
)
