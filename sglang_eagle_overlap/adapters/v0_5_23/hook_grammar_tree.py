"""REPLACE ``sglang.srt.speculative.spec_utils.GrammarTree`` (class).

Why: upstream's ``GrammarTree.from_device`` starts the verify-tree device-to-host copy with ``_async_d2h``, which
allocates fresh pinned host tensors every verify step (pinned allocation is a slow, serialising driver call). The
plugin's :class:`~sglang_eagle_overlap.core.HostTreeCopier` reuses two slots of pinned buffers instead, and remembers
the device draft-token tensor so that the mask step can neutralise the drafts of requests whose mask build timed out.

How: a duck-compatible class (``from_device`` / ``from_host`` / ``from_linear_chain`` / ``resolve``). The class
REPLACE is rebound by ``HookRegistry`` in every module that did ``from spec_utils import GrammarTree``. While the
plugin is not active every constructor delegates to SGLang's original class (captured in ``register``), so the
objects and behaviour are SGLang's own.

Call order (``run_eagle_verify``): ``from_device`` before the target verify launch; ``resolve`` inside
``build_grammar_vocab_mask`` (see ``hook_build_grammar_vocab_mask``), after the launch.

Upstream state: SGLang 0.5.17-0.5.23 allocate pinned memory per step in ``_async_d2h``; no open PR to pool it.

When to remove: when upstream reuses the pinned tree buffers (and exposes the device draft tensor for timeouts).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from sglang_eagle_overlap.adapters.common import STATE, Hook, mark_verify_launch
from sglang_eagle_overlap.core import PendingTree

__all__ = ["HOOK", "PluginGrammarTree", "TARGET", "capture_original", "original"]

TARGET = "sglang.srt.speculative.spec_utils.GrammarTree"
_orig: dict = {"cls": None}


def capture_original() -> None:
    """Remember SGLang's class before the REPLACE lands (called from ``Adapter.register``)."""
    if _orig["cls"] is not None:
        return
    from sglang.srt.speculative import spec_utils

    cls = spec_utils.GrammarTree
    if cls is not PluginGrammarTree:
        _orig["cls"] = cls


def original() -> Any:
    if _orig["cls"] is None:
        capture_original()
    if _orig["cls"] is None:
        raise RuntimeError("sglang-eagle-overlap: SGLang's original GrammarTree was not captured")
    return _orig["cls"]


class PluginGrammarTree:
    """The verify tree on the host, copied through the plugin's reusable pinned buffers.

    ``draft_device`` is the caller's draft-token tensor (a view of ``EagleVerifyInput.draft_token``) for EAGLE trees,
    which the mask step may overwrite to neutralise timed-out requests; it is None for trees whose candidates the plugin
    does not own (``from_host``, ``from_linear_chain``).
    """

    __slots__ = ("pending", "draft_device")

    def __init__(self, pending: PendingTree, draft_device: Optional[torch.Tensor] = None) -> None:
        self.pending = pending
        self.draft_device = draft_device

    @classmethod
    def from_device(cls, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                    draft_token: torch.Tensor) -> Any:
        if not STATE.active:
            return original().from_device(retrieve_next_token, retrieve_next_sibling, draft_token)
        mark_verify_launch(retrieve_next_token.device)  # just before the verify launch: timeline + un-hidden probe
        return cls(STATE.copier.start(retrieve_next_token, retrieve_next_sibling, draft_token), draft_token)

    @classmethod
    def from_host(cls, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                  draft_token: torch.Tensor) -> Any:
        if not STATE.active:
            return original().from_host(retrieve_next_token, retrieve_next_sibling, draft_token)
        return cls(STATE.copier.start(retrieve_next_token, retrieve_next_sibling, draft_token))

    @classmethod
    def from_linear_chain(cls, verify_ids_2d: torch.Tensor) -> Any:
        if not STATE.active:
            return original().from_linear_chain(verify_ids_2d)
        bs, chain_len = verify_ids_2d.shape
        nxt = torch.full((bs, chain_len), -1, dtype=torch.int64)
        nxt[:, :-1] = torch.arange(1, chain_len, dtype=torch.int64)
        sib = torch.full((bs, chain_len), -1, dtype=torch.int64)
        return cls(STATE.copier.start(nxt, sib, verify_ids_2d))  # chain algorithms own their candidate tensors

    def resolve(self) -> Tuple[torch.Tensor, ...]:
        """Wait for the host copy (one event) and return ``(next_token, next_sibling, draft_tokens)``."""
        return self.pending.resolve()


# Modules that do ``from sglang.srt.speculative.spec_utils import GrammarTree``.
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
