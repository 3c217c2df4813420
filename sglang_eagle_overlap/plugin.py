"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``eagle_overlap``).

Call order, per process (main, scheduler subprocess, ...): SGLang's ``load_plugins()`` calls :func:`load` once, then
``HookRegistry.apply_hooks()``. :func:`load` reads the switches once (:class:`~sglang_eagle_overlap.settings.Settings`),
picks the adapter of the installed SGLang band, registers its hooks, applies them itself (``apply_hooks`` is
idempotent), checks that every hook landed, and only then creates and activates the process's runtime
(:mod:`sglang_eagle_overlap.integration.runtime`). Until then every hook passes straight through to SGLang's own
code, so a partial installation can never mix the plugin's grammar path with SGLang's.

An SGLang patched with ``patches/`` already runs the same integration from its own source: the plugin then stands
aside (says so once) instead of hooking it a second time.

SGLang only logs exceptions raised by plugins, so every refusal is also logged here at ERROR level, with the reason
and what to do. Switches: see :mod:`sglang_eagle_overlap.settings`.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from typing import Any, Dict, List, NoReturn, Optional

__all__ = ["PluginLoadError", "is_active", "load", "sglang_version"]

logger = logging.getLogger("sglang_eagle_overlap")

_state: Dict[str, Any] = {"loaded": False, "adapter": None, "error": None}

# The module every vendored patch (``patches/sglang-<v>``) adds to SGLang: its call sites' link to this package.
PATCH_MODULE = "sglang.srt.speculative.grammar_overlap"


class PluginLoadError(RuntimeError):
    """The plugin refused to load (no or an unsupported SGLang, a bad switch, or a hook that did not land)."""


def sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def is_active() -> bool:
    """True once every hook of this process's adapter landed and the plugin is switched on."""
    from sglang_eagle_overlap.integration import runtime

    rt = runtime.current()
    return bool(rt is not None and rt.active and rt.origin == "plugin")


def _is_patched() -> bool:
    try:
        return importlib.util.find_spec(PATCH_MODULE) is not None
    except ImportError:
        return False


def load() -> None:
    """Entry point. Idempotent and cheap: the second call in a process returns at once (or raises the same refusal)."""
    if _state["loaded"]:
        if _state["error"] is not None:
            raise PluginLoadError(_state["error"])
        return
    _state["loaded"] = True
    from sglang_eagle_overlap import SUPPORTED_SGLANG_VERSIONS
    from sglang_eagle_overlap.settings import ENV, Settings, SettingsError

    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        _refuse(f"sglang-eagle-overlap: {exc}. The plugin stays off; fix the variable or unset it.")
    if not settings.enabled:
        logger.info("sglang-eagle-overlap: disabled by %s=0", ENV["enabled"])
        return
    from sglang_eagle_overlap.adapters import adapter_for

    ver = sglang_version()
    supported = ", ".join(SUPPORTED_SGLANG_VERSIONS)
    if ver is None:
        _refuse(f"sglang-eagle-overlap: SGLang is not installed in this environment ({sys.executable}). "
                f"Install a supported SGLang next to the plugin (`pip install sglang==<one of {supported}>`).")
    adapter = adapter_for(ver)
    if adapter is None:
        _refuse(
            f"sglang-eagle-overlap: SGLang {ver} is not supported (supported: {supported}). Install a supported "
            f"SGLang, or turn the plugin off with {ENV['enabled']}=0 (or `pip uninstall sglang-eagle-overlap`)."
        )
    if _is_patched():
        logger.info("sglang-eagle-overlap: SGLang %s is patched with patches/sglang-%s; its own source runs the same "
                    "integration, so the plugin adds no hooks", ver, ver)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    adapter.register(HookRegistry)
    HookRegistry.apply_hooks()
    missing: List[str] = adapter.verify()
    if missing:
        _refuse(
            f"sglang-eagle-overlap: {len(missing)} hook(s) did not land on SGLang {ver}: {'; '.join(missing)}. "
            f"The plugin stays off (SGLang's own grammar path is used). Report this with your SGLang version, or set "
            f"{ENV['enabled']}=0 to silence it."
        )
    from sglang_eagle_overlap.integration import runtime, schemas

    adapter.activate(runtime.create(settings))
    _state["adapter"] = adapter
    logger.info("sglang-eagle-overlap: active on SGLang %s (%s)", ver, adapter.name)
    logger.info("sglang-eagle-overlap: %s",
                schemas.describe(settings, runtime.installed_xgrammar(), adapter.compiles_schemas))


def _refuse(message: str) -> NoReturn:
    _state["error"] = message
    logger.error(message)
    raise PluginLoadError(message)
