"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``eagle_overlap``).

Call order, per process (main, scheduler subprocess, ...): SGLang's ``load_plugins()`` calls :func:`load` once, then
``HookRegistry.apply_hooks()``. :func:`load` registers the hooks of the adapter for the installed SGLang band, applies
them itself (``apply_hooks`` is idempotent) and checks that every hook landed. Only then does it switch the adapter
on: until :func:`load` succeeds completely, every hook passes straight through to SGLang's own code, so a partial
installation can never mix the plugin's grammar path with SGLang's.

Switches (environment):

* ``SGLANG_EAGLE_OVERLAP=0`` -- turn the plugin off without uninstalling it.
* ``SGLANG_EAGLE_OVERLAP_MASK_THREADS=N`` -- threads for the tree-mask build (default: 1 on <= 2 cores, else half the cores, at most 8).
* ``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS=X`` -- per-step mask time limit (default 50 ms; 0 disables).

SGLang only logs exceptions raised by plugins, so this module also logs every refusal at ERROR level itself, with
the reason and what to do.
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

__all__ = ["PluginLoadError", "is_active", "load", "sglang_version"]

logger = logging.getLogger("sglang_eagle_overlap")

ENV_SWITCH = "SGLANG_EAGLE_OVERLAP"
_state: dict = {"loaded": False, "active": False, "adapter": None, "error": None}


class PluginLoadError(RuntimeError):
    """The plugin refused to load (unsupported SGLang, or a hook that did not land)."""


def sglang_version() -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def is_active() -> bool:
    """True once every hook of this process's adapter landed and the plugin is switched on."""
    return bool(_state["active"])


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def load() -> None:
    """Entry point. Idempotent and cheap: the second call in a process returns at once."""
    if _state["loaded"]:
        if _state["error"] is not None:
            raise PluginLoadError(_state["error"])
        return
    _state["loaded"] = True
    if _disabled_by_env():
        logger.info("sglang-eagle-overlap: disabled by %s=%s", ENV_SWITCH, os.environ.get(ENV_SWITCH))
        return
    from sglang_eagle_overlap import SUPPORTED_SGLANG_VERSIONS
    from sglang_eagle_overlap.adapters import adapter_for

    ver = sglang_version()
    adapter = adapter_for(ver)
    if adapter is None:
        _refuse(
            f"SGLang {ver} is not supported by sglang-eagle-overlap (supported: "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)}). Install a supported SGLang, or turn the plugin off with "
            f"{ENV_SWITCH}=0 (or `pip uninstall sglang-eagle-overlap`)."
        )
    from sglang.srt.plugins.hook_registry import HookRegistry

    adapter.register(HookRegistry)
    HookRegistry.apply_hooks()
    missing: List[str] = adapter.verify()
    if missing:
        _refuse(
            f"sglang-eagle-overlap: {len(missing)} hook(s) did not land on SGLang {ver}: {'; '.join(missing)}. "
            f"The plugin stays off (SGLang's own grammar path is used). Report this with your SGLang version, or set "
            f"{ENV_SWITCH}=0 to silence it."
        )
    adapter.activate()
    _state["adapter"] = adapter
    _state["active"] = True
    logger.info("sglang-eagle-overlap: active on SGLang %s (%s)", ver, adapter.name)


def _refuse(message: str) -> None:
    _state["error"] = message
    logger.error(message)
    raise PluginLoadError(message)
