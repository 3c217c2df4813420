"""Hook: ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._accept_grammar_tokens`` (AROUND).

Why: under the plugin the previous batch's accepted tokens may already have been fed to the grammar by the verify
of the next batch (the barrier in ``eagle_sample``'s hook). Upstream would feed them a second time here.

How: for EAGLE-family servers, route the advance through ``STATE.ledger`` keyed by (``req.rid``, output position =
``len(req.output_ids)``, since ``_resolve_spec_v2_tokens`` calls this before appending). The ledger advances once
and replays the recorded outcome afterwards. Upstream's semantics are kept: the returned prefix stops after the
token that terminated the grammar (the rest is never committed nor emitted); a rejected token aborts the request
with an error naming the request, the token and its position.

Upstream state: 0.5.17 makes ``advance_grammar_fsm`` idempotent (``result.grammar_advanced``).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.common import STATE, Hook, advance_or_abort
from sglang_eagle_overlap.adapters.v0_5_16 import _runtime

TARGET = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._accept_grammar_tokens"
)


def replay_or_advance(req, start: int, tokens) -> list:
    """Post-processing's ask: the ledger replays what the barrier fed (or feeds it now); aborts on a rejected token."""
    if STATE.ledger.outcome(str(req.rid), start) is not None:
        STATE.stats.count("replays")
    return list(advance_or_abort(req, start, tokens).retained)


def accept_grammar_tokens(original, self, req, tokens, *args, **kwargs):
    if not STATE.active or req.grammar is None or not _runtime.is_eagle_family(getattr(self, "server_args", None)):
        return original(self, req, tokens, *args, **kwargs)
    toks = [tokens] if isinstance(tokens, int) else list(tokens)
    return replay_or_advance(req, len(req.output_ids), toks)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=accept_grammar_tokens,
    why="post-processing replays the ledger instead of advancing the grammar a second time",
)
