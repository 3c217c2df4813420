"""Hook: ``sglang.srt.speculative.eagle_worker_common.run_eagle_verify`` (AROUND).

Why: 0.5.16 copies the verify tree to the host with a blocking ``.cpu()`` before the target-verify launch and builds
the grammar mask with a Python DFS after it, both guarded by ``batch.has_grammar``.

How: on entry (before the launch) :func:`~.band.before_verify` puts the grammar-forced drafts into the tree, then
:func:`~.band.begin_verify` starts the asynchronous host copy; the step is kept on
the runtime (``rt.in_flight``) for the two inner hooks of this same call: ``eagle_prepare_for_verify`` hides
``has_grammar`` so SGLang skips its blocking copy and its own mask, and ``eagle_sample`` builds the plugin's mask
(:func:`~.band.build_vocab_mask`). The ``finally`` restores ``has_grammar`` and clears the hand-off whatever happens.
Steps with a non-xgrammar backend, idle batches and non-EAGLE-family algorithms pass straight through.

Upstream state: 0.5.17 has ``GrammarTree.from_device`` (async D2H before launch).

When to remove: when 0.5.16 is no longer supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_eagle_overlap.adapters.v0_5_16 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.eagle_worker_common.run_eagle_verify"


@dataclass(slots=True)
class InFlight:
    """The verify step of the ``run_eagle_verify`` call in progress; ``hidden``: ``batch.has_grammar`` is False."""

    verify: band.VerifyStep
    hidden: bool = False

    def hide(self) -> None:
        if not self.hidden:
            self.hidden = True
            self.verify.batch.has_grammar = False

    def restore(self) -> None:
        if self.hidden:
            self.verify.batch.has_grammar = True
            self.hidden = False


def in_flight_for(rt: Optional[runtime.Runtime], batch: Any) -> Optional[InFlight]:
    """The in-flight step of ``batch``, if the plugin owns this verify."""
    cur = None if rt is None else rt.in_flight
    return cur if isinstance(cur, InFlight) and cur.verify.batch is batch else None


# ``batch`` (SGLang's ScheduleBatch) and the return value are SGLang's objects: Any (SGLang ships no types).
def run_eagle_verify(original: Callable[..., Any], batch: Any, *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    if rt is None:
        return original(batch, *args, **kwargs)
    owned = band.before_verify(rt, batch, batch.spec_info)  # grammar-forced drafts, before the verify input is built
    verify = band.begin_verify(rt, batch, batch.spec_info, owned=owned)
    if verify is None:
        return original(batch, *args, **kwargs)
    cur = rt.in_flight = InFlight(verify)
    try:
        return original(batch, *args, **kwargs)
    finally:
        cur.restore()
        if rt.in_flight is cur:
            rt.in_flight = None


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
