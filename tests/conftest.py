"""Shared test configuration. Hardware gating lives here and only here."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from sglang_eagle_overlap.plugin import sglang_version

# SGLANG_EO_REQUIRE_ENGINE=1 (scripts/test.sh): a skip outside tests/skip_guard.py's ALLOWED_SKIPS fails the run.
pytest_plugins = ("tests.skip_guard",)

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


_TMP_STATE: dict = {}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (pinned memory, device-to-host copies, events)")
    # Leave nothing in /tmp: SGLang names its ZMQ ipc sockets with tempfile.NamedTemporaryFile(delete=False) and never
    # removes them (~5-7 files per engine or server start, ~230 per suite run). Every temporary file of this session,
    # pytest's own tmp_path folders included, goes into one private directory (TMPDIR is inherited by SGLang's
    # spawned processes and by servers started with subprocess), removed when the session ends.
    # SGLANG_EO_KEEP_TMP=1 keeps it (its path is printed) for debugging a failure.
    path = tempfile.mkdtemp(prefix="sglang-eo-tests-")
    _TMP_STATE.update(path=path, env=os.environ.get("TMPDIR"), default=tempfile.tempdir)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path  # gettempdir() caches its first answer (pytest's capture already asked for it)


def pytest_unconfigure(config) -> None:
    path = _TMP_STATE.pop("path", None)
    if path is None:
        return
    tempfile.tempdir = _TMP_STATE.pop("default", None)
    old = _TMP_STATE.pop("env", None)
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    if os.environ.get("SGLANG_EO_KEEP_TMP") == "1":
        print(f"\n[tests] temporary files kept in {path} (SGLANG_EO_KEEP_TMP=1)")
    else:
        shutil.rmtree(path, ignore_errors=True)


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
