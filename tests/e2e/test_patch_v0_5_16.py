"""The vendored 0.5.16 patch, end to end: the CPU engine's scheduler imports a patched COPY of SGLang 0.5.16 (first on
``PYTHONPATH``; the installed files are never touched), product plugin off, and greedy EAGLE3 topk 4 under the
overlap scheduler writes exactly what non-speculative greedy writes for JSON-schema / regex / EBNF / mixed batches,
while no grammar decode batch is forced out of overlap (unpatched 0.5.16 forces every one of them:
``tests/e2e/test_plugin_equivalence.py`` pins that with the plugin off).

The copy's ``grammar_overlap.build_vocab_mask`` is wrapped (test-only, in the copy) to write the module's counters
and its pid to a marker file after every call, which proves the patched verify path (barrier advance, native mask,
post-processing replays) ran in the scheduler process. Two engine starts (the in-process non-spec reference, shared
with test_plugin_equivalence through the pool's cache, then ``python -m sglang.launch_server`` with the copy first on
``PYTHONPATH``).
"""

from __future__ import annotations

import json
import os

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.helpers.patched_sglang import patched_sglang_copy

from .common import run_cases_on_patched_server
from .test_plugin_equivalence import CASES, _run

pytestmark = [pytest.mark.engine, pytest.mark.sglang_0_5_16]

_MARK = '''

# --- test-only instrumentation appended by tests/e2e/test_patch_v0_5_16.py ---
import json as _eo_json  # noqa: E402

_eo_patched_build_vocab_mask = build_vocab_mask


def build_vocab_mask(*args, **kwargs):
    out = _eo_patched_build_vocab_mask(*args, **kwargs)
    with open(os.environ["SGLANG_EO_PATCH_MARK"], "w") as _f:
        _eo_json.dump(dict(COUNTERS, pid=os.getpid()), _f)
    return out
'''


def test_patched_copy_engine_token_identical_and_overlapped(engine_pool, tmp_path):
    root = patched_sglang_copy(tmp_path / "patched", "0.5.16")
    with open(root / "sglang" / "srt" / "speculative" / "grammar_overlap.py", "a") as f:
        f.write(_MARK)
    mark = tmp_path / "mark.json"

    # the same non-spec reference test_plugin_equivalence compares with (one engine start for both)
    want = _run(engine_pool, EngineConfig(pair="random", spec=None))[0]

    engine_pool.close()  # one engine at a time
    got, stats, log_tail = run_cases_on_patched_server(root, tmp_path, CASES,
                                                       {"SGLANG_EO_PATCH_MARK": str(mark)})

    # The patched verify path ran in the scheduler process: barrier fed tokens, post-processing replayed them.
    assert mark.exists(), f"the patched build_vocab_mask never ran:\n{log_tail}"
    marks = json.loads(mark.read_text())
    assert marks["pid"] != os.getpid() and marks["pid"] == stats.get("pid"), (marks, stats)
    assert marks["verify_steps"] > 0 and marks["barrier_tokens"] > 0 and marks["replays"] > 0, marks
    assert marks["aborts"] == 0, marks
    # No grammar decode batch was forced out of overlap.
    assert stats.get("runtime_errors") == [], stats
    assert stats.get("overlap_enabled") is True, stats
    assert stats.get("grammar_decode_batches", 0) > 0, stats
    assert stats.get("overlap_disabled_grammar_decode_batches") == 0, stats
    # Token-identical to non-speculative greedy.
    for case in CASES:
        assert len(got[case]) == len(want[case]), case
        for i, (g, w) in enumerate(zip(got[case], want[case])):
            assert g[1] and g[1] == w[1], f"patched topk4 {case}[{i}]: {g[0]!r} vs non-spec {w[0]!r}"
            assert g[0] == w[0] and g[2] == w[2], f"patched topk4 {case}[{i}]: {g!r} vs non-spec {w!r}"
