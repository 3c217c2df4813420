"""Adapter for SGLang 0.5.16: one module per hooked target (see each module's docstring).

| module | target | type |
|---|---|---|
| ``scheduler_overlap`` | ``Scheduler.is_disable_overlap_for_batch`` | AROUND |
| ``run_eagle_verify`` | ``eagle_worker_common.run_eagle_verify`` | AROUND |
| ``eagle_prepare_for_verify`` | ``eagle_utils.eagle_prepare_for_verify`` | AROUND |
| ``eagle_sample`` | ``eagle_utils.eagle_sample`` | AROUND |
| ``accept_grammar_tokens`` | ``SchedulerBatchResultProcessor._accept_grammar_tokens`` | AROUND |
| ``apply_prefill_grammar`` | ``SchedulerBatchResultProcessor._apply_prefill_grammar`` | AROUND |

Every hook passes through until :meth:`Adapter.activate` (called by ``plugin.load`` only after all hooks landed).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, List, Tuple

from sglang_eagle_overlap.adapters.common import STATE, Hook, register_hooks, verify_hooks
from sglang_eagle_overlap.adapters.v0_5_16 import (
    accept_grammar_tokens,
    apply_prefill_grammar,
    eagle_prepare_for_verify,
    eagle_sample,
    run_eagle_verify,
    scheduler_overlap,
)

__all__ = ["ADAPTER", "HOOKS", "Adapter", "importable_callers"]

logger = logging.getLogger("sglang_eagle_overlap")

HOOKS: Tuple[Hook, ...] = (
    scheduler_overlap.HOOK,
    run_eagle_verify.HOOK,
    eagle_prepare_for_verify.HOOK,
    eagle_sample.HOOK,
    accept_grammar_tokens.HOOK,
    apply_prefill_grammar.HOOK,
)


def importable_callers(hooks: Tuple[Hook, ...]) -> Tuple[Hook, ...]:
    """Drop caller modules that cannot be imported in this process (e.g. ``ngram_worker`` needs CUDA-only kernels).

    A module that cannot be imported cannot call the target either; one imported later does ``from X import Y``
    against the already patched ``X`` and so gets the hook. Only an imported module with a stale binding is a miss.
    """
    out = []
    for h in hooks:
        keep = []
        for mod_name, attr in h.callers:
            try:
                importlib.import_module(mod_name)
            except ImportError as exc:
                logger.debug("sglang-eagle-overlap: caller %s not importable here (%s); not checked", mod_name, exc)
                continue
            keep.append((mod_name, attr))
        out.append(dataclasses.replace(h, callers=tuple(keep)))
    return tuple(out)


class Adapter:
    name = "sglang-0.5.16"
    hooks = HOOKS

    def register(self, registry: Any) -> None:
        register_hooks(registry, self.hooks)

    def verify(self) -> List[str]:
        return verify_hooks(importable_callers(self.hooks))

    def activate(self) -> None:
        STATE.active = True

    def deactivate(self) -> None:
        """For tests: back to pass-through."""
        STATE.active = False


ADAPTER = Adapter()
