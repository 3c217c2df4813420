"""Scheduler-side evidence for the constrained stress tests: SGLang's decode retractions and the product plugin's
accept ledger, seen from inside the scheduler process (TEST ONLY).

:func:`record_retraction` is an AFTER hook on SGLang's ``ScheduleBatch.retract_decode`` (registered by
:mod:`.plugin`); :func:`install` wraps the scheduler instance's ``process_batch_result`` (called from
``plugin._after_scheduler_init``, like the overlap-decision counter). Both write into :mod:`.stats`:

* ``retracted_requests`` / ``retracted_constrained``: requests ``retract_decode`` took out of the running batch
  (KV pool full), and those of them with a grammar; ``retracted_constrained_rids``: their ids (last 256).
* ``ledger_max_entries``: the most requests the plugin's ledger held after a batch result was processed.
* ``ledger_prefills_over_64``: prefill (extend) results processed while the ledger held more than 64 requests: the
  case in which the ledger is pruned while a small result -- a prefill of a few rows -- arrives and the other
  requests keep decoding.
* ``ledger_live_misses``: constrained requests the ledger knew after one batch result, still running after the next
  one (in the scheduler's running batch or the batch just processed, not finished, not retracted), but no longer in
  the ledger. The ledger may only forget requests that left the engine; a miss means gap and conflict detection was
  lost for a request that is still decoding. ``ledger_live_miss_rids``: the first 32 of them.

Read-only towards SGLang and the plugin: the probe only looks at request fields and ledger membership (a dict
lookup; the grammar thread never adds or removes ledger entries, the scheduler thread does, and the probe runs on the
scheduler thread). Inert when the product plugin is not active in the process.
"""

from __future__ import annotations

from typing import Any, Iterable, Set

__all__ = ["PRUNE_FLOOR", "install", "record_retraction"]

# The ledger's prune threshold for small batches (GrammarStep.ledger_outgrows: more than max(64, 4 x batch)).
PRUNE_FLOOR = 64


def record_retraction(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``ScheduleBatch.retract_decode``: its result is ``(retracted_reqs, new_token_ratio,
    reqs_to_abort)`` on every supported SGLang."""
    from sglang_eo_dev.cpu_runtime import stats

    retracted = list(result[0]) if isinstance(result, tuple) and result else []
    if not retracted:
        return None
    constrained = [str(r.rid) for r in retracted if getattr(r, "grammar", None) is not None]

    def note(s: dict) -> None:
        s["retracted_requests"] = s.get("retracted_requests", 0) + len(retracted)
        s["retracted_constrained"] = s.get("retracted_constrained", 0) + len(constrained)
        s["retracted_constrained_rids"] = (s.get("retracted_constrained_rids", []) + constrained)[-256:]

    stats.update(note)
    return None


def _live_constrained(reqs: Iterable[Any]) -> Set[str]:
    return {str(r.rid) for r in reqs
            if getattr(r, "grammar", None) is not None and not r.finished() and not getattr(r, "is_retracted", False)}


def install(scheduler: Any) -> None:
    """Wrap ``scheduler.process_batch_result`` (the overlap loop calls it through the instance) with the ledger
    checks of the module docstring."""
    from sglang_eo_dev.cpu_runtime import stats

    process = scheduler.process_batch_result
    known: Set[str] = set()  # constrained running requests the ledger held after the previous result

    def probed(batch: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang_eagle_overlap.integration import runtime

        rt = runtime.active()
        if rt is None:
            return process(batch, result, *args, **kwargs)
        ledger = rt.step.ledger
        prefill_over = bool(batch is not None and batch.forward_mode.is_extend() and len(ledger) > PRUNE_FLOOR)
        out = process(batch, result, *args, **kwargs)
        running = getattr(scheduler, "running_batch", None)
        reqs = list(getattr(running, "reqs", None) or []) + list(getattr(batch, "reqs", None) or [])
        live = _live_constrained(reqs)
        present = {rid for rid in live if rid in ledger}
        missed = sorted((known & live) - present)
        known.clear()
        known.update(present)
        size = len(ledger)

        def note(s: dict) -> None:
            s["ledger_max_entries"] = max(s.get("ledger_max_entries", 0), size)
            if prefill_over:
                s["ledger_prefills_over_64"] = s.get("ledger_prefills_over_64", 0) + 1
            if missed:
                s["ledger_live_misses"] = s.get("ledger_live_misses", 0) + len(missed)
                s["ledger_live_miss_rids"] = (s.get("ledger_live_miss_rids", []) + missed)[:32]

        if prefill_over or missed or size > stats.peek("ledger_max_entries", 0):
            stats.update(note)
        return out

    scheduler.process_batch_result = probed
