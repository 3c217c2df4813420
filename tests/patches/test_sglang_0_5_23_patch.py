"""``patches/sglang-0.5.23/*.patch`` applies to a copy of the installed SGLang 0.5.23 and its mask path runs.

The copy is made under a temporary directory (the installed files are never touched), checked with
``git apply --check`` first (a stale patch fails hard), applied, and then imported in a fresh interpreter that has the
copy first on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.patched_sglang import REPO as _REPO
from tests.helpers.patched_sglang import patch_files, patched_sglang_copy

pytestmark = pytest.mark.sglang_0_5_23

_PATCHES = patch_files("0.5.23")


@pytest.fixture(scope="module")
def patched_copy(tmp_path_factory) -> Path:
    return patched_sglang_copy(tmp_path_factory.mktemp("sglang-0.5.23-patched"), "0.5.23")


def test_patch_files_exist():
    assert _PATCHES, "no patch under patches/sglang-0.5.23/"
    assert _PATCHES[0].name.startswith("0001-")


def test_patch_does_not_apply_twice(patched_copy):
    # Once applied, --check fails: the patch is tied to the exact 0.5.23 sources.
    proc = subprocess.run(["git", "apply", "--check", "-p1", str(_PATCHES[0])], cwd=patched_copy, capture_output=True)
    assert proc.returncode != 0


def test_patched_modules_import_and_mask_path_runs(patched_copy):
    env = dict(os.environ)
    env["SGLANG_EO_CPU_RUNTIME"] = "1"
    site = _REPO / "tests" / "cpu_runtime" / "sglang_eo_cpu_runtime" / "_site"
    env["PYTHONPATH"] = os.pathsep.join([str(patched_copy), str(site), str(_REPO), env.get("PYTHONPATH", "")])
    env["SGLANG_EAGLE_OVERLAP"] = "0"  # the patched engine needs no plugin
    proc = subprocess.run([sys.executable, "-m", "tests.patches._patched_probe", str(patched_copy)], cwd=_REPO,
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE-JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-5000:]
    facts = json.loads(lines[-1][len("PROBE-JSON "):])
    assert facts["from_copy"], facts["sglang_file"]
    assert facts["mask_equal"] and facts["barrier_called"] and facts["grammar_mask_reset"] and facts["has_draft_device"]
    assert facts["fed_once"] and facts["ledger_used"]
    assert facts["mask_failure_aborts_alone"] and facts["mask_failure_drafts_neutralised"], facts


def test_patch_has_no_binary_or_cache_files():
    text = _PATCHES[0].read_text()
    assert "GIT binary patch" not in text and "__pycache__" not in text and ".pyc" not in text
