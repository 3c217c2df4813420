"""A patched COPY of the installed SGLang: ``patches/sglang-<version>/*.patch`` applied with ``git apply --check``
first (a stale patch fails hard). The installed files are never touched; put the returned root first on
``PYTHONPATH`` / ``sys.path`` to import the copy."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path
from typing import List

__all__ = ["REPO", "patch_files", "patched_sglang_copy"]

REPO = Path(__file__).resolve().parents[2]


def patch_files(version: str) -> List[Path]:
    return sorted((REPO / "patches" / f"sglang-{version}").glob("*.patch"))


def patched_sglang_copy(root: Path, version: str) -> Path:
    """Copy the installed ``sglang`` package to ``root/sglang``, apply the vendored patches there, return ``root``."""
    src = Path(importlib.util.find_spec("sglang").origin).parent
    shutil.copytree(src, root / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in patch_files(version):
        for check in (["--check"], []):
            proc = subprocess.run(["git", "apply", *check, "-p1", str(patch)], cwd=root, capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"git apply {' '.join(check)} {patch.name} failed in {root}: {proc.stderr}")
    return root
