"""Shared test configuration. Hardware gating lives here and only here."""

from __future__ import annotations

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


HAS_CUDA = _has_cuda()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (pinned memory, device-to-host copies, events)")


def pytest_collection_modifyitems(config, items) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
