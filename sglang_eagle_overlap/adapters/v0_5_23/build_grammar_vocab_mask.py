"""AROUND ``sglang.srt.speculative.spec_utils.build_grammar_vocab_mask``.

Why: SGLang builds the verify-tree bitmask with ``generate_token_bitmask``, a recursive Python DFS that calls
``XGrammarGrammar.accept_token`` / ``fill_vocab_mask`` / ``rollback(1)`` per node; that ``rollback`` slices the
request's ``accepted_tokens`` list, so its cost grows with the output length (SG#38863), and the DFS itself is 4-28x
slower than xgrammar's native walk (``../shared/notes/landscape.md``).

How (keyword-only signature of 0.5.23: ``reqs, tree, sampling_info, device, barrier``): trees the plugin made
(:class:`~.band.PluginGrammarTree`) go to :func:`~.band.build_grammar_vocab_mask`; SGLang's own trees, or a runtime
that is off, go to SGLang's function unchanged.

Upstream state: 0.5.23 still uses the Python DFS (SG#15465, native traversal, open).

When to remove: when upstream builds tree masks natively without per-node ``rollback`` list slicing.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_23 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.spec_utils.build_grammar_vocab_mask"


# SGLang's arguments (requests, tree, sampling info) and its GrammarMask result: Any (SGLang ships no types).
def build_grammar_vocab_mask_around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    rt = runtime.active()
    tree = kwargs.get("tree")
    if args or rt is None or not isinstance(tree, band.PluginGrammarTree):
        return original(*args, **kwargs)
    return band.build_grammar_vocab_mask(rt, **kwargs)


# Modules that do ``from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask``.
HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=build_grammar_vocab_mask_around,
    callers=(
        ("sglang.srt.speculative.eagle_worker_common", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.ngram_worker", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.dspark_components.dspark_worker_v2", "build_grammar_vocab_mask"),
        ("sglang.srt.speculative.dflash_worker_v2", "build_grammar_vocab_mask"),
    ),
    why="native tree mask (GrammarStep.build_mask) after the barrier, unmasked drafts neutralised",
)
