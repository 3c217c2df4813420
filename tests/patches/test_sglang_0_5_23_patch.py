"""``patches/sglang-0.5.23/*.patch`` applies to a copy of the installed SGLang 0.5.23 and its mask path runs.

The copy is made under a temporary directory (the installed files are never touched), checked with
``git apply --check`` first (a stale patch fails hard), applied, and then imported in a fresh interpreter that has the
copy first on ``sys.path``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sglang_eo_dev.helpers.patched_sglang import patch_files, patched_sglang_copy, run_probe

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
    # the probe imports the copy directly: no plugin hooks in that interpreter
    facts = run_probe(["-m", "sglang_eo_dev.probes.patched_v0_5_23", str(patched_copy)], [patched_copy],
                      SGLANG_EAGLE_OVERLAP=None)
    assert facts["from_copy"], facts["sglang_file"]
    assert facts["calls_the_package"], facts  # the copy runs the package's band, not a vendored copy of it
    assert facts["mask_equal"] and facts["barrier_called"] and facts["grammar_mask_reset"] and facts["has_draft_device"]
    assert facts["fed_once"] and facts["ledger_used"]
    # ... over a non-empty run (an empty retained run would make both checks hold trivially)
    (retained,) = facts["retained"]
    assert retained and retained == facts["run"][: len(retained)], facts
    assert facts["mask_failure_aborts_alone"] and facts["mask_failure_drafts_neutralised"], facts


def test_patch_has_no_binary_or_cache_files():
    text = _PATCHES[0].read_text()
    assert "GIT binary patch" not in text and "__pycache__" not in text and ".pyc" not in text
