"""``patches/sglang-0.5.16/*.patch`` applies to a copy of the installed SGLang 0.5.16 and its patched paths behave.

The copy is made under a temporary directory (the installed files are never touched), checked with
``git apply --check`` first (a stale patch fails hard), applied, and then imported in a fresh interpreter that has the
copy first on ``sys.path`` (``sglang_eo_dev.probes.patched_v0_5_16`` reports what it saw).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sglang_eo_dev.helpers.patched_sglang import patch_files, patched_sglang_copy, run_probe

pytestmark = pytest.mark.sglang_0_5_16

_PATCHES = patch_files("0.5.16")


@pytest.fixture(scope="module")
def patched_copy(tmp_path_factory) -> Path:
    return patched_sglang_copy(tmp_path_factory.mktemp("sglang-0.5.16-patched"), "0.5.16")


@pytest.fixture(scope="module")
def facts(patched_copy) -> dict:
    # the probe imports the copy directly: no plugin hooks in that interpreter
    return run_probe(["-m", "sglang_eo_dev.probes.patched_v0_5_16", str(patched_copy)], [patched_copy],
                     SGLANG_EAGLE_OVERLAP=None)


def test_patch_files_exist():
    assert len(_PATCHES) == 1, f"expected one patch under patches/sglang-0.5.16/, got {_PATCHES}"
    assert _PATCHES[0].name.startswith("0001-")
    text = _PATCHES[0].read_text()
    assert "GIT binary patch" not in text and "__pycache__" not in text, "the patch must carry sources only"


def test_patch_does_not_apply_twice(patched_copy):
    # Once applied, --check fails: the patch is tied to the exact 0.5.16 sources.
    proc = subprocess.run(["git", "apply", "--check", "-p1", str(_PATCHES[0])], cwd=patched_copy, capture_output=True)
    assert proc.returncode != 0


def test_patched_modules_import_from_the_copy(facts):
    assert facts["from_copy"], facts["sglang_file"]
    assert facts["calls_the_package"], facts  # the copy runs the package's band, not a vendored copy of it


def test_overlap_decision_keeps_only_eagle_xgrammar_batches(facts):
    # EAGLE-family xgrammar decode batches no longer sync on the previous result ...
    assert facts["sync_eagle3_xgrammar"] is False and facts["sync_eagle_xgrammar"] is False, facts
    # ... every other case keeps upstream's forced sync.
    assert facts["sync_ngram_xgrammar"] is True, facts
    assert facts["sync_eagle3_other_backend"] is True, facts
    assert facts["queue_recorded"], facts


def test_barrier_then_native_mask_equals_upstream(facts):
    assert facts["begin_verify_started"] and facts["ngram_declined"], facts
    # The queued previous result was fed to the grammars before the mask was built ...
    assert facts["barrier_fed_runs"] and facts["barrier_tokens"] == facts["run_tokens"] > 0, facts
    # ... and the mask equals upstream's generate_token_bitmask over grammars at the same state.
    assert facts["mask_equal"], facts
    assert facts["vocab_mask_cleared"] and facts["verify_grammar_set"], facts


def test_mask_build_failure_aborts_that_request_alone(facts):
    assert facts["mask_failures"] == 1, facts
    assert facts["mask_failure_aborts_alone"] and facts["mask_failure_drafts_neutralised"], facts


def test_post_processing_replays_exactly_once(facts):
    assert facts["replay_retained_runs"] and facts["fed_once"], facts
    assert facts["replays"] == 3, facts
    assert facts["prefill_fed_once"], facts


@pytest.mark.parametrize("case", ["terminating", "rejected"])
def test_termination_and_rejection_match_upstream(facts, case):
    assert facts[f"{case}_retained_equal"] and facts[f"{case}_matcher_equal"], facts
    assert facts[f"{case}_abort_equal"], facts
    if case == "rejected":
        assert facts["rejected_aborts"], facts
