"""Hook: ``sglang.srt.speculative.eagle_worker_common.run_eagle_verify`` (AROUND).

Why: 0.5.16 copies the verify tree to the host with a blocking ``.cpu()`` before the target-verify launch and builds
the grammar mask with a Python DFS after it, both guarded by ``batch.has_grammar``.

How: on entry (before the launch) :func:`~.band.before_verify` puts the grammar-forced drafts into the tree, then
``Band016.verify_step`` starts the asynchronous host copy and ``Band.start`` the grammar work; ``Band.run_verify``
keeps the step in flight on the band for the two inner hooks of this same call (``eagle_prepare_for_verify`` hides
``has_grammar`` so SGLang skips its blocking copy and its own mask, and ``eagle_sample`` builds the plugin's mask)
and, whatever happens, restores ``has_grammar`` and clears the hand-off. Steps with a non-xgrammar backend, idle
batches and non-EAGLE-family algorithms pass straight through.

Upstream state: 0.5.17 has ``GrammarTree.from_device`` (async D2H before launch).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.eagle_worker_common.run_eagle_verify"


# ``batch`` (SGLang's ScheduleBatch) and the return value are SGLang's objects: Any (SGLang ships no types).
def run_eagle_verify(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    if rt is None:
        return original(batch, *args, **kwargs)
    b = band.band_of(rt)
    owned = band.before_verify(rt, batch, batch.spec_info)  # grammar-forced drafts, before the verify input is built
    # Band.start itself (not band.begin_verify): no pass-through frame between SGLang's call and the core
    cur = b.start(b.verify_step(batch, batch.spec_info, owned=owned))
    if cur is None:
        return original(batch, *args, **kwargs)
    return b.run_verify(cur, original, batch, *args, **kwargs)


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
