"""Import a file that is not in a package (a benchmark script) as a module, for tests of its pure functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

__all__ = ["loaded_script"]


def loaded_script(path: Path, name: str) -> Iterator[ModuleType]:
    """Generator for a pytest fixture: ``yield from loaded_script(path, name)``. The module is registered in
    ``sys.modules`` while in use (dataclasses resolve annotations through it) and removed afterwards."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(name, None)
