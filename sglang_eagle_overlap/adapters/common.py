"""Glue shared by the SGLang adapters: hook bookkeeping, the per-process plugin state, request -> core mapping.

Nothing here is imported by SGLang at import time; SGLang objects are only touched through duck typing, so this
module itself imports no SGLang.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from sglang_eagle_overlap.core import AcceptLedger, HostTreeCopier, MaskRequest, TreeMaskBuilder

__all__ = [
    "BandAdapter",
    "Hook",
    "PluginState",
    "STATE",
    "importable_callers",
    "mask_request_for",
    "register_hooks",
    "resolve_attr",
    "verify_hooks",
]

logger = logging.getLogger("sglang_eagle_overlap")


@dataclass(frozen=True)
class Hook:
    """One hooked SGLang target.

    ``callers`` are ``(module, attribute)`` pairs that must see the patched object after ``apply_hooks()`` (modules
    that did ``from X import name``), checked by :func:`verify_hooks`.
    """

    target: str
    hook_type: str  # "AROUND" | "AFTER" | "BEFORE" | "REPLACE"
    fn: Callable[..., Any]
    callers: Tuple[Tuple[str, str], ...] = ()
    why: str = ""


def resolve_attr(path: str) -> Any:
    import pkgutil

    obj_path, attr = path.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    if isinstance(obj, type) and attr in obj.__dict__:
        raw = obj.__dict__[attr]
        if isinstance(raw, (classmethod, staticmethod)):
            return raw.__func__
    return getattr(obj, attr)


def _contains_hook(obj: Any, fn: Callable[..., Any]) -> bool:
    """True if ``obj`` is ``fn`` or a HookRegistry wrapper chain that calls ``fn``."""
    seen = 0
    while obj is not None and seen < 32:
        if obj is fn:
            return True
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is fn:
                    return True
            except ValueError:
                continue
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return False


def register_hooks(registry: Any, hooks: Sequence[Hook]) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    for h in hooks:
        registry.register(h.target, h.fn, getattr(HookType, h.hook_type))


def verify_hooks(hooks: Sequence[Hook]) -> List[str]:
    """Return a description of every hook that did not land (target or a caller binding)."""
    import importlib

    missing: List[str] = []
    for h in hooks:
        try:
            current = resolve_attr(h.target)
        except Exception as exc:  # target renamed or removed
            missing.append(f"{h.target} ({type(exc).__name__}: {exc})")
            continue
        if not _contains_hook(current, h.fn):
            missing.append(f"{h.target} (not patched)")
            continue
        for mod_name, attr in h.callers:
            try:
                bound = getattr(importlib.import_module(mod_name), attr)
            except Exception as exc:
                missing.append(f"{mod_name}.{attr} ({type(exc).__name__}: {exc})")
                continue
            if not _contains_hook(bound, h.fn):
                missing.append(f"{mod_name}.{attr} (stale binding, still SGLang's own {h.target})")
    return missing


@dataclass
class StepStats:
    """Operator-facing counters of the plugin's grammar work (per process)."""

    steps: int = 0
    grammar_s: float = 0.0  # ledger advance + tree wait + mask build, summed
    advance_s: float = 0.0
    tree_wait_s: float = 0.0
    mask_s: float = 0.0
    mask_timeouts: int = 0
    tokens_advanced: int = 0
    last: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, float]:
        return {
            "steps": self.steps,
            "grammar_s": self.grammar_s,
            "advance_s": self.advance_s,
            "tree_wait_s": self.tree_wait_s,
            "mask_s": self.mask_s,
            "mask_timeouts": self.mask_timeouts,
            "tokens_advanced": self.tokens_advanced,
        }


class PluginState:
    """Per-process state: one scheduler / one worker per process in SGLang, so one of each object."""

    def __init__(self) -> None:
        self.active = False
        self.copier = HostTreeCopier()
        self.ledger = AcceptLedger()
        limit_ms = float(os.environ.get("SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS", "50"))
        self._builder: Optional[TreeMaskBuilder] = None
        self._limit_s = None if limit_ms <= 0 else limit_ms / 1e3
        self.stats = StepStats()

    @property
    def builder(self) -> TreeMaskBuilder:
        if self._builder is None:
            import torch

            pin = bool(torch.cuda.is_available())
            self._builder = TreeMaskBuilder(time_limit_s=self._limit_s, pin_memory=pin)
        return self._builder

    def timed(self) -> float:
        return time.perf_counter()


STATE = PluginState()


def mask_request_for(req: Any) -> MaskRequest:
    """Map an SGLang ``Req`` to the core's mask input.

    * no grammar, or a request that already finished (SG#28986: a finished request must not be masked again) ->
      unconstrained, costs nothing;
    * SGLang's ``XGrammarGrammar`` (exact class, not a wrapper such as the reasoning wrapper) -> native matcher;
    * anything else (llguidance, outlines, reasoning wrapper) -> the generic walk through the grammar object API.
    """
    grammar = getattr(req, "grammar", None)
    rid = str(getattr(req, "rid", ""))
    if grammar is None:
        return MaskRequest(request_id=rid)
    finished = getattr(req, "finished", None)
    if callable(finished) and finished():
        return MaskRequest(request_id=rid)
    if type(grammar).__name__ == "XGrammarGrammar" and hasattr(grammar, "matcher"):
        return MaskRequest(matcher=grammar.matcher, request_id=rid)
    return MaskRequest(grammar=grammar, request_id=rid)


def importable_callers(hooks: Tuple[Hook, ...]) -> Tuple[Hook, ...]:
    """Drop caller modules that cannot be imported in this process (e.g. CUDA-only kernels on a CPU host).

    A module that cannot be imported cannot call the target; one imported later does ``from X import Y`` against the
    already patched ``X`` and so gets the hook. Only an imported module with a stale binding is a miss.
    """
    import dataclasses
    import importlib

    out = []
    for h in hooks:
        keep = []
        for mod_name, attr in h.callers:
            try:
                importlib.import_module(mod_name)
            except Exception as exc:  # ImportError, or a kernel registration failing on this host
                logger.debug("sglang-eagle-overlap: caller %s not importable here (%s); not checked", mod_name, exc)
                continue
            keep.append((mod_name, attr))
        out.append(dataclasses.replace(h, callers=tuple(keep)))
    return tuple(out)


class BandAdapter:
    """The adapter contract (see ``adapters/__init__.py``) shared by every SGLang band; a band sets name + hooks."""

    name: str = ""
    hooks: Tuple[Hook, ...] = ()

    def register(self, registry: Any) -> None:
        register_hooks(registry, self.hooks)

    def verify(self) -> List[str]:
        return verify_hooks(importable_callers(self.hooks))

    def activate(self) -> None:
        STATE.active = True

    def deactivate(self) -> None:
        """For tests: back to pass-through."""
        STATE.active = False
