"""Hook: ``sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch`` (AROUND).

Why: in 0.5.16 this returns True for every speculative decode batch with a grammar (``need_grammar_sync``), so the
overlap loop processes the previous result before launching the next batch: the GPU idles while the CPU advances
grammars and builds the next mask.

How: for EAGLE / EAGLE3 / STANDALONE grammar decode batches (NEXTN arrives as EAGLE; the list is
``sglang_eagle_overlap.support``), ask the original again with ``batch.has_grammar``
hidden, which drops only the grammar-sync reason and keeps every other one (consecutive prefill). It is safe because
the plugin's verify path advances the previous batch's grammars itself (via the ledger) before it needs the mask.
This hook also records the scheduler, which the worker-side hooks need to reach ``result_queue``. For other algorithms
(NGRAM) it passes through and logs once that the plugin stands aside.

Upstream state: 0.5.17 has ``ScheduleBatch.grammar_needs_sync()`` / ``supports_grammar_overlap()`` (SG#31488).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.common import STATE, Hook
from sglang_eagle_overlap.adapters.v0_5_16 import _runtime

TARGET = "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch"


def is_disable_overlap_for_batch(original, self, batch, *args, **kwargs):
    if not STATE.active:
        return original(self, batch, *args, **kwargs)
    _runtime.remember_scheduler(self)
    if not (
        batch is not None
        and getattr(batch, "has_grammar", False)
        and batch.forward_mode.is_decode()
    ):
        return original(self, batch, *args, **kwargs)
    if not _runtime.is_eagle_family(batch):
        _runtime.announce_stand_aside(batch)  # e.g. NGRAM: SGLang's synchronous grammar path, said once
        return original(self, batch, *args, **kwargs)
    if not _runtime.plugin_can_mask(batch):
        return original(self, batch, *args, **kwargs)
    batch.has_grammar = False
    try:
        result = original(self, batch, *args, **kwargs)
    finally:
        batch.has_grammar = True
    if len(getattr(self, "result_queue", ()) or ()) > 0:
        STATE.stats.count("overlap_kept")
    return result


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=is_disable_overlap_for_batch,
    why="drop the grammar-sync reason for EAGLE-family grammar decode batches",
)
