"""Benchmark and test plumbing: import a file that is not in a package (a benchmark script) as a module, for tests of
its pure functions; unpack the product package as a git revision of this checkout had it (before/after benchmarks)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

__all__ = ["loaded_script", "package_at"]

ROOT = Path(__file__).resolve().parents[3]  # the checkout: dev/sglang_eo_dev/helpers/ -> repo root


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


def package_at(rev: str, dest: Path) -> Path:
    """``sglang_eagle_overlap/`` as git revision ``rev`` of this checkout had it, unpacked (``git archive``) into
    ``dest/<rev>``; returns that folder: put it first on ``PYTHONPATH`` to import the revision's package, or read one
    of its modules from it."""
    out = Path(dest) / rev
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "sglang_eagle_overlap"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out
