"""Let a CUDA-built torchvision wheel import against the CPU torch of the test venv.

Why: ``import sglang`` imports transformers' image utilities, which import torchvision; the PyPI torchvision wheel's
native ops do not load against a CPU torch, and its ``_meta_registrations`` then fails with "operator torchvision::nms
does not exist". Defining the two operator schemas it registers fake kernels for (``nms``, ``qnms``) before torchvision
is imported is enough; SGLang never runs them on a text model.

How: :func:`install_import_hook` adds a ``sys.meta_path`` finder that defines the schemas the first time torchvision
is imported (torch is only imported then), unless torchvision's own native library loads against this torch (a
torchvision built for it, as on a CUDA host): that library defines the same operators when torchvision imports it, and
a second definition of an operator is a C++ error that aborts the process (SIGABRT inside ``dlopen``: seen on the
H200 host, 2026-11-27, where the CUDA tests' pair builder died of it). Spawned SGLang subprocesses get the hook through the ``sitecustomize`` in
``_site/``, which the engine helpers put on ``PYTHONPATH``; the test process calls it directly.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__all__ = ["define_torchvision_schemas", "install_import_hook"]

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIB = None


def define_torchvision_schemas() -> None:
    """Define ``torchvision::nms`` / ``qnms`` if torchvision's native library did not and cannot (idempotent)."""
    global _LIB
    import torch

    if _load_torchvision_library():  # a torchvision built for this torch defines them itself
        return
    missing = [name for name in _SCHEMAS if not _schema_exists(name)]
    if not missing:
        return
    if _LIB is None:
        _LIB = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        _LIB.define(_SCHEMAS[name])


def _load_torchvision_library() -> bool:
    """Load torchvision's native operator library (``torchvision/_C.*``) now, without importing torchvision: True if it
    loads and defines ``nms`` (torchvision's own import then finds it loaded and defines nothing twice), False if there
    is no torchvision, no library, or it does not load against this torch (the CPU venvs' CUDA-built wheel)."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name.startswith("_C.") and name.endswith((".so", ".pyd")):
                try:
                    torch.ops.load_library(os.path.join(folder, name))
                except (OSError, RuntimeError):
                    return False
                return _schema_exists("nms")
    return False


def _schema_exists(name: str) -> bool:
    import torch

    try:
        return bool(torch._C._jit_get_schemas_for_operator(f"torchvision::{name}"))
    except RuntimeError:
        return False


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    """Runs :func:`define_torchvision_schemas` just before ``torchvision`` is first imported; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib protocol
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            try:
                define_torchvision_schemas()
            except Exception:  # pragma: no cover - never block the import itself
                pass
        return None


def install_import_hook() -> None:
    """Install the finder once; if torchvision is already imported there is nothing left to fix."""
    if "torchvision" in sys.modules:
        return
    if any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionFinder())
