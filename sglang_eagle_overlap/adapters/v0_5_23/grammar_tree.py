"""REPLACE ``sglang.srt.speculative.spec_utils.GrammarTree`` (class) with :class:`~.band.PluginGrammarTree`.

Why: SGLang's ``GrammarTree.from_device`` starts the verify-tree device-to-host copy with ``_async_d2h``, which
allocates fresh pinned host tensors every verify step (a slow, serialising driver call); the plugin reuses two slots
of pinned buffers and remembers the device draft tensor for neutralising unmasked drafts.

How: the class REPLACE is rebound by ``HookRegistry`` in every module that did ``from spec_utils import GrammarTree``.
SGLang's own class is captured at ``register`` (before the REPLACE lands); while the runtime is off every constructor
delegates to it. Call order (``run_eagle_verify``): ``from_device`` before the target verify launch; ``resolve``
inside ``build_grammar_vocab_mask``, after the launch.

Upstream state: SGLang 0.5.17-0.5.23 allocate pinned memory per step in ``_async_d2h``; no open PR to pool it.

When to remove: when upstream reuses the pinned tree buffers (and exposes the device draft tensor for timeouts).
"""

from __future__ import annotations

from sglang_eagle_overlap.adapters.v0_5_23.band import PluginGrammarTree, capture_sglang_tree
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.speculative.spec_utils.GrammarTree"


def capture_original() -> None:
    from sglang.srt.speculative import spec_utils

    capture_sglang_tree(spec_utils.GrammarTree)


HOOK = Hook(
    target=TARGET,
    hook_type="REPLACE",
    fn=PluginGrammarTree,
    callers=(
        ("sglang.srt.speculative.eagle_worker_common", "GrammarTree"),
        ("sglang.srt.speculative.ngram_worker", "GrammarTree"),
        ("sglang.srt.speculative.dspark_components.dspark_worker_v2", "GrammarTree"),
        ("sglang.srt.speculative.dflash_worker_v2", "GrammarTree"),
    ),
    why="verify-tree host copy through reusable pinned buffers (HostTreeCopier)",
)
