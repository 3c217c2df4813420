"""Adapter for SGLang 0.5.23: the plugin's core replaces upstream's grammar-overlap path (see each module's docstring).

| module | target | type |
|---|---|---|
| ``grammar_tree`` | ``spec_utils.GrammarTree`` | REPLACE (class) |
| ``build_grammar_vocab_mask`` | ``spec_utils.build_grammar_vocab_mask`` | AROUND |
| ``advance_grammar_fsm`` | ``SchedulerBatchResultProcessor.advance_grammar_fsm`` | AROUND |
| ``run_eagle_verify`` | ``eagle_worker_common.run_eagle_verify`` | AROUND |
| ``eagle_sample`` | ``eagle_utils.eagle_sample`` | AROUND |
| ``dispatch_json`` | ``XGrammarGrammarBackend.dispatch_json`` | AROUND |

The integration itself is :mod:`.band`, which the vendored patch calls too; the hook modules only translate
SGLang's calls into it. ``dispatch_json`` (JSON schemas' bounded ``maxLength`` strings compiled as patterns, where
``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN`` and the installed xgrammar allow it) has no call site in the vendored
patch.

0.5.23 already keeps EAGLE grammar decode batches overlapped (``SpeculativeAlgorithm.supports_grammar_overlap()``,
``ScheduleBatch.grammar_needs_sync()``) and already calls the barrier inside verify, so no scheduler hook is needed;
the contract test pins that behaviour. ``--speculative-algorithm EAGLE3`` is used unchanged.

Other versions: an AST comparison of the released wheels (0.5.17-0.5.23) finds ``GrammarTree``,
``build_grammar_vocab_mask``, ``generate_token_bitmask``, ``Scheduler._advance_pending_grammar`` and
``is_disable_overlap_for_batch`` identical; ``advance_grammar_fsm`` differs only in the stride lookup (0.5.17-0.5.19
read ``speculative_num_draft_tokens``; this adapter falls back to it), and before 0.5.23 a rejected token aborted with a
bare ``FINISH_ABORT()``. ``run_eagle_verify`` changed elsewhere but calls the two spec_utils targets the same way. So
0.5.17-0.5.22 could likely share this adapter, but they are NOT listed in ``BANDS`` until tested.

Every hook passes through to SGLang's code until the runtime is activated (``plugin.load``, only after all hooks
landed).
"""

from __future__ import annotations

from typing import Any, Tuple

from sglang_eagle_overlap.adapters.v0_5_23 import (
    advance_grammar_fsm,
    build_grammar_vocab_mask,
    dispatch_json,
    eagle_sample,
    grammar_tree,
    run_eagle_verify,
)
from sglang_eagle_overlap.integration.hooks import BandAdapter, Hook

__all__ = ["ADAPTER", "HOOKS", "Adapter"]

HOOKS: Tuple[Hook, ...] = (
    grammar_tree.HOOK,
    build_grammar_vocab_mask.HOOK,
    advance_grammar_fsm.HOOK,
    run_eagle_verify.HOOK,
    eagle_sample.HOOK,
    dispatch_json.HOOK,
)


class Adapter(BandAdapter):
    name = "sglang-0.5.23"
    hooks = HOOKS
    compiles_schemas = True

    def register(self, registry: Any) -> None:  # SGLang's HookRegistry class (SGLang ships no types)
        grammar_tree.capture_original()
        super().register(registry)


ADAPTER = Adapter()
