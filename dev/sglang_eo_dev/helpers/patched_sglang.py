"""A patched COPY of the installed SGLang: ``patches/sglang-<version>/*.patch`` applied with ``git apply --check``
first (a stale patch fails hard). The installed files are never touched; put the returned root first on
``PYTHONPATH`` / ``sys.path`` to import the copy (:func:`run_probe` does, in a fresh interpreter)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Optional

__all__ = ["REPO", "patch_files", "patched_sglang_copy", "run_probe"]

REPO = Path(__file__).resolve().parents[3]
_CPU_SITE = Path(__file__).resolve().parents[1] / "cpu_runtime" / "_site"  # torchvision shim (sitecustomize)


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


def run_probe(args: List[str], first_on_path: Iterable[Path] = (), **env: Optional[str]) -> dict:
    """Run ``python <args>`` in a fresh interpreter from the repository root, with ``first_on_path`` (e.g. a patched
    copy) then the CPU runtime's torchvision shim and the repository first on ``PYTHONPATH``, and ``env`` set (``None``
    removes a variable). Returns the JSON of the probe's last ``PROBE-JSON `` line; a failed probe fails the test with
    its output."""
    full = dict(os.environ, SGLANG_EO_CPU_RUNTIME="1")
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    full["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*first_on_path, _CPU_SITE, REPO, full.get("PYTHONPATH", ""))
                                         if str(p))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, env=full, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-JSON ")]
    assert proc.returncode == 0 and lines, f"probe {args} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("PROBE-JSON "):])
