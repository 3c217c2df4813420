"""Hook: ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._apply_prefill_grammar`` (AROUND).

Why: at the extend -> decode boundary the prefill result is still in ``result_queue`` when the first verify runs, so
the plugin's barrier feeds the prefill token to the grammar first; upstream would feed it again here.

How: for EAGLE-family servers, route through ``STATE.ledger`` at output position ``len(req.output_ids) - 1``
(upstream calls this after appending the token). Keeps upstream's behaviour: a rejected token aborts the request;
``grammar.finished`` mirrors ``req.finished()``.

Known difference: upstream runs ``req.update_finish_state()`` before this accept, the plugin's barrier before it. If
the very first generated token terminates the grammar, the request finishes at prefill (FINISH_MATCHED_TOKEN)
instead of after one more decode step.

Upstream state: 0.5.17 advances prefill grammar idempotently (``advance_grammar_fsm``).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.common import STATE, Hook
from sglang_eagle_overlap.adapters.v0_5_16 import _runtime
from sglang_eagle_overlap.adapters.v0_5_16.accept_grammar_tokens import replay_or_advance

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._apply_prefill_grammar"
)


def apply_prefill_grammar(original, self, *args, **kwargs):
    req = kwargs.get("req", args[0] if args else None)
    next_token_id = kwargs.get("next_token_id", args[1] if len(args) > 1 else None)
    if (
        not STATE.active
        or req is None
        or req.grammar is None
        or not _runtime.is_eagle_family(getattr(self, "server_args", None))
    ):
        return original(self, *args, **kwargs)
    replay_or_advance(req, len(req.output_ids) - 1, [int(next_token_id)])
    req.grammar.finished = req.finished()
    return None


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=apply_prefill_grammar,
    why="prefill grammar accept replays the ledger",
)
