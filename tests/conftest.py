"""Shared test configuration. Hardware gating lives here and only here."""

from __future__ import annotations

import pytest

from sglang_eagle_overlap.plugin import sglang_version

try:  # CPU test venvs: let the CUDA-built torchvision wheel import against CPU torch, before any test imports SGLang
    from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

    install_import_hook()
except ImportError:  # the test-only runtime is not installed (e.g. a GPU machine's own environment)
    pass


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


HAS_CUDA = _has_cuda()


SGLANG_VERSION = sglang_version()
# marker -> the SGLang version whose installed sources a test reads (version gating lives here only)
SGLANG_VERSION_MARKERS = {"sglang_0_5_16": "0.5.16", "sglang_0_5_23": "0.5.23"}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (pinned memory, device-to-host copies, events)")


def pytest_collection_modifyitems(config, items) -> None:
    for marker, wanted in SGLANG_VERSION_MARKERS.items():
        if SGLANG_VERSION == wanted:
            continue
        skip_ver = pytest.mark.skip(
            reason=f"needs SGLang {wanted} installed (found {SGLANG_VERSION}); run with that version's venv python"
        )
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip_ver)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
