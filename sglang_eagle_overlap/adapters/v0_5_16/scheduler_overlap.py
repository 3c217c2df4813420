"""Hook: ``sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch`` (AROUND).

Why: in 0.5.16 this returns True for every speculative decode batch with a grammar (``need_grammar_sync``), so the
overlap loop processes the previous result before launching the next batch: the GPU idles while the CPU advances
grammars and builds the next mask.

How: when :func:`~.band.keeps_overlap` says the batch's verify will advance the previous batch's grammars itself,
ask the original again with ``batch.has_grammar`` hidden, which drops only the grammar-sync reason and keeps every
other one (consecutive prefill). ``keeps_overlap`` also records the scheduler's ``result_queue`` on the runtime, and
for a grammar batch of an algorithm outside the family (NGRAM) says once that the plugin stands aside.

Upstream state: 0.5.17 has ``ScheduleBatch.grammar_needs_sync()`` / ``supports_grammar_overlap()`` (SG#31488).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch"


# ``self`` (SGLang's Scheduler), ``batch`` and the return value are SGLang's objects: Any (SGLang ships no types).
def is_disable_overlap_for_batch(original: Callable[..., Any], self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    if rt is None or not band.keeps_overlap(rt, batch, getattr(self, "result_queue", None)):
        return original(self, batch, *args, **kwargs)
    batch.has_grammar = False
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        batch.has_grammar = True


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=is_disable_overlap_for_batch,
    why="drop the grammar-sync reason for EAGLE-family grammar decode batches",
)
