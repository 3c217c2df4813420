"""One thin adapter per supported SGLang band over the engine-agnostic core.

Each band package has a ``band`` module (the integration itself, called by the hooks and by the vendored patch
alike) and one module per hooked target that only translates SGLang's call into ``band``.

``adapter_for(version)`` is the single version gate. An adapter module exposes ``ADAPTER`` with:

* ``name: str``
* ``register(registry)`` -- register every hook with SGLang's ``HookRegistry`` (no SGLang import at module level);
* ``verify() -> list[str]`` -- after ``apply_hooks()``, the descriptions of hooks that did NOT land (empty = all ok);
* ``activate(runtime)`` -- switch the hooks from pass-through to the plugin's behaviour;
* ``compiles_schemas: bool`` (``BandAdapter``'s default False) -- whether it hooks SGLang's JSON-schema compile (the
  ``maxLength``-pattern rewrite, :mod:`sglang_eagle_overlap.integration.schemas`).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from sglang_eagle_overlap.integration.hooks import BandAdapter

__all__ = ["adapter_for", "BANDS"]

# sglang version -> adapter module. Only versions that are tested are listed.
BANDS = {
    "0.5.16": "sglang_eagle_overlap.adapters.v0_5_16",
    "0.5.23": "sglang_eagle_overlap.adapters.v0_5_23",
}


@functools.lru_cache(maxsize=None)
def adapter_for(version: Optional[str]) -> Optional[BandAdapter]:
    module = BANDS.get(version or "")
    if module is None:
        return None
    adapter: BandAdapter = importlib.import_module(module).ADAPTER
    return adapter
