"""Adapter for SGLang 0.5.16: one module per hooked target (see each module's docstring).

| module | target | type |
|---|---|---|
| ``scheduler_overlap`` | ``Scheduler.is_disable_overlap_for_batch`` | AROUND |
| ``run_eagle_verify`` | ``eagle_worker_common.run_eagle_verify`` | AROUND |
| ``eagle_prepare_for_verify`` | ``eagle_utils.eagle_prepare_for_verify`` | AROUND |
| ``eagle_sample`` | ``eagle_utils.eagle_sample`` | AROUND |
| ``accept_grammar_tokens`` | ``SchedulerBatchResultProcessor._accept_grammar_tokens`` | AROUND |
| ``apply_prefill_grammar`` | ``SchedulerBatchResultProcessor._apply_prefill_grammar`` | AROUND |

The integration itself is :mod:`.band`, which the vendored patch calls too; the hook modules only translate
SGLang's calls into it. Every hook passes through until the runtime is activated (``plugin.load``, only after all
hooks landed).
"""

from __future__ import annotations

from typing import Tuple

from sglang_eagle_overlap.integration.hooks import BandAdapter, Hook
from sglang_eagle_overlap.adapters.v0_5_16 import (
    accept_grammar_tokens,
    apply_prefill_grammar,
    eagle_prepare_for_verify,
    eagle_sample,
    run_eagle_verify,
    scheduler_overlap,
)

__all__ = ["ADAPTER", "HOOKS", "Adapter"]

HOOKS: Tuple[Hook, ...] = (
    scheduler_overlap.HOOK,
    run_eagle_verify.HOOK,
    eagle_prepare_for_verify.HOOK,
    eagle_sample.HOOK,
    accept_grammar_tokens.HOOK,
    apply_prefill_grammar.HOOK,
)


class Adapter(BandAdapter):
    name = "sglang-0.5.16"
    hooks = HOOKS


ADAPTER = Adapter()
