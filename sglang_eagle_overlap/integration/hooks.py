"""``HookRegistry`` bookkeeping shared by the bands: declare each hooked target, register, and check it landed.

SGLang's loader only logs a plugin's errors and skips targets that no longer exist, so :func:`verify_hooks` checks,
after ``apply_hooks()``, that every target and every module that did ``from X import name`` now reaches the plugin's
function; :class:`BandAdapter` switches the runtime on only then (all-or-nothing).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, List, Sequence, Tuple

from sglang_eagle_overlap.integration import runtime as runtime_mod

__all__ = ["BandAdapter", "Hook", "contains_hook", "importable_callers", "register_hooks", "resolve_attr",
           "verify_hooks"]

logger = logging.getLogger("sglang_eagle_overlap")


@dataclass(frozen=True)
class Hook:
    """One hooked SGLang target. ``callers`` are ``(module, attribute)`` pairs that must see the patched object after
    ``apply_hooks()`` (modules that did ``from X import name``), checked by :func:`verify_hooks`."""

    target: str
    hook_type: str  # "AROUND" | "AFTER" | "BEFORE" | "REPLACE"
    fn: Callable[..., Any]
    callers: Tuple[Tuple[str, str], ...] = ()
    why: str = ""


def resolve_attr(path: str) -> object:
    import pkgutil

    obj_path, attr = path.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    if isinstance(obj, type) and attr in obj.__dict__:
        raw = obj.__dict__[attr]
        if isinstance(raw, (classmethod, staticmethod)):
            return raw.__func__
    return getattr(obj, attr)


def contains_hook(obj: object, fn: Callable[..., Any]) -> bool:
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


# ``registry`` is SGLang's ``HookRegistry`` class and a hook's ``fn`` takes and returns SGLang's objects: Any (SGLang
# ships no types).
def register_hooks(registry: Any, hooks: Sequence[Hook]) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    for h in hooks:
        registry.register(h.target, h.fn, getattr(HookType, h.hook_type))


def verify_hooks(hooks: Sequence[Hook]) -> List[str]:
    """Return a description of every hook that did not land (target or a caller binding)."""
    missing: List[str] = []
    for h in hooks:
        try:
            current = resolve_attr(h.target)
        except Exception as exc:  # target renamed or removed
            missing.append(f"{h.target} ({type(exc).__name__}: {exc})")
            continue
        if not contains_hook(current, h.fn):
            missing.append(f"{h.target} (not patched)")
            continue
        for mod_name, attr in h.callers:
            try:
                bound = getattr(importlib.import_module(mod_name), attr)
            except Exception as exc:
                missing.append(f"{mod_name}.{attr} ({type(exc).__name__}: {exc})")
                continue
            if not contains_hook(bound, h.fn):
                missing.append(f"{mod_name}.{attr} (stale binding, still SGLang's own {h.target})")
    return missing


def importable_callers(hooks: Tuple[Hook, ...]) -> Tuple[Hook, ...]:
    """Drop caller modules that cannot be imported in this process (e.g. CUDA-only kernels on a CPU host).

    A module that cannot be imported cannot call the target; one imported later does ``from X import Y`` against the
    already patched ``X`` and so gets the hook. Only an imported module with a stale binding is a miss.
    """
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
    compiles_schemas: bool = False  # hooks SGLang's JSON-schema compile (integration.schemas: maxLength patterns)

    def register(self, registry: Any) -> None:
        register_hooks(registry, self.hooks)

    def verify(self) -> List[str]:
        return verify_hooks(importable_callers(self.hooks))

    def activate(self, rt: "runtime_mod.Runtime | None" = None) -> None:
        """Switch ``rt`` (default: this process's runtime) on: the hooks stop passing through."""
        rt = rt if rt is not None else runtime_mod.current()
        if rt is None:
            raise RuntimeError("sglang-eagle-overlap: no runtime to activate in this process (plugin.load() not run)")
        rt.active = True
