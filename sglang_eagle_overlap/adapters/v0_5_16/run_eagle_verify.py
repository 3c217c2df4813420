"""Hook: ``sglang.srt.speculative.eagle_worker_common.run_eagle_verify`` (AROUND).

Why: 0.5.16 copies the verify tree to the host with a blocking ``.cpu()`` before the target-verify launch and builds
the grammar mask with a Python DFS after it, both guarded by ``batch.has_grammar``.

How: on entry (before the launch) start the asynchronous host copy of the tree (``STATE.copier``) and stash a
per-step context; ``eagle_prepare_for_verify``'s hook then hides ``has_grammar`` so upstream skips its blocking copy
and its own mask, and ``eagle_sample``'s hook builds our mask. The ``finally`` restores ``has_grammar`` whatever
happens. Steps with a non-xgrammar backend, idle batches and non-EAGLE-family algorithms pass straight through.

Upstream state: 0.5.17 has ``GrammarTree.from_device`` (async D2H before launch).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.common import STATE, Hook
from sglang_eagle_overlap.adapters.v0_5_16 import _runtime

TARGET = "sglang.srt.speculative.eagle_worker_common.run_eagle_verify"


def run_eagle_verify(original, batch, *args, **kwargs):
    if not STATE.active:
        return original(batch, *args, **kwargs)
    ctx = _runtime.begin_step(batch)
    try:
        return original(batch, *args, **kwargs)
    finally:
        _runtime.end_step(ctx)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=run_eagle_verify,
    callers=(
        ("sglang.srt.speculative.eagle_worker_v2", "run_eagle_verify"),
        ("sglang.srt.speculative.multi_layer_eagle_worker_v2", "run_eagle_verify"),
    ),
    why="start the async verify-tree host copy before the target-verify launch",
)
