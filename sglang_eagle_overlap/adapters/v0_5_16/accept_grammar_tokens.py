"""Hook: ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._accept_grammar_tokens`` (AROUND).

Why: under the plugin the previous batch's accepted tokens may already have been fed to the grammar by the verify
of the next batch (the barrier). SGLang would feed them a second time here.

How: for EAGLE-family servers, :func:`~.band.feed_tokens`: the ledger feeds the run once per (``req.rid``, output
position ``len(req.output_ids)``; ``_resolve_spec_v2_tokens`` calls this before appending) and replays afterwards,
with SGLang's semantics (retained prefix stops after the terminating token; a rejected token aborts the request).

Upstream state: 0.5.17 makes ``advance_grammar_fsm`` idempotent (``result.grammar_advanced``).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._accept_grammar_tokens"
)


# ``self`` (SGLang's SchedulerBatchResultProcessor), ``req`` and ``tokens`` are SGLang's objects: Any (SGLang ships no
# types).
def accept_grammar_tokens(original: Callable[..., Any], self: Any, req: Any, tokens: Any, *args: Any,
                          **kwargs: Any) -> Any:
    rt = runtime.active()
    # the band keeps the server's decision: this runs once per request and step
    if rt is None or req.grammar is None or not band.is_eagle_server(rt, getattr(self, "server_args", None)):
        return original(self, req, tokens, *args, **kwargs)
    return band.feed_tokens(rt, req, tokens)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=accept_grammar_tokens,
    why="post-processing replays the ledger instead of feeding the grammar a second time",
)
