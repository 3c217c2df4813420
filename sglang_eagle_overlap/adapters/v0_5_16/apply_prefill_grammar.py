"""Hook: ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._apply_prefill_grammar`` (AROUND).

Why: at the extend -> decode boundary the prefill result is still in ``result_queue`` when the first verify runs, so
the plugin's barrier feeds the prefill token to the grammar first; SGLang would feed it again here.

How: for EAGLE-family servers, :func:`~.band.feed_prefill_token` (ledger at output position
``len(req.output_ids) - 1``: SGLang calls this after appending the token); a rejected token aborts the request;
``grammar.finished`` mirrors ``req.finished()``. Known difference: see that function.

Upstream state: 0.5.17 advances prefill grammar idempotently (``advance_grammar_fsm``).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._apply_prefill_grammar"
)


# ``self`` (SGLang's SchedulerBatchResultProcessor) and ``req`` are SGLang's objects: Any (SGLang ships no types).
def apply_prefill_grammar(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    req = kwargs.get("req", args[0] if args else None)
    next_token_id = kwargs.get("next_token_id", args[1] if len(args) > 1 else None)
    rt = runtime.active()
    if (rt is None or req is None or next_token_id is None or req.grammar is None
            or not band.is_eagle_server(rt, getattr(self, "server_args", None))):
        return original(self, *args, **kwargs)
    band.feed_prefill_token(rt, req, next_token_id)
    return None


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=apply_prefill_grammar,
    why="prefill grammar accept replays the ledger",
)
