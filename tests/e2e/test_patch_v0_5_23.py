"""The vendored 0.5.23 patch, end to end: the CPU engine's scheduler imports a patched COPY of SGLang (first on
``PYTHONPATH``; the installed files are never touched), product plugin off, and greedy EAGLE3 topk 4 under the
overlap scheduler writes exactly what non-speculative greedy writes for JSON-schema / regex / mixed batches.

The copy's ``build_grammar_vocab_mask`` is wrapped (test-only, in the copy) to append to a marker file, which proves
the patched mask path ran in the scheduler process. Two engine starts (an in-process non-spec engine for the
reference, then ``python -m sglang.launch_server`` with the copy first on ``PYTHONPATH``).
"""

from __future__ import annotations

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.helpers.patched_sglang import patched_sglang_copy

from .common import run_cases_on_patched_server
from .test_plugin_equivalence import CASES, _run

pytestmark = [pytest.mark.engine, pytest.mark.sglang_0_5_23]

_MARK = '''

# --- test-only instrumentation appended by tests/e2e/test_patch_v0_5_23.py ---
_eo_patched_build_grammar_vocab_mask = build_grammar_vocab_mask


def build_grammar_vocab_mask(**kwargs):
    with open(os.environ["SGLANG_EO_PATCH_MARK"], "a") as _f:
        _f.write("x")
    return _eo_patched_build_grammar_vocab_mask(**kwargs)
'''


def test_patched_copy_engine_token_identical(engine_pool, tmp_path):
    root = patched_sglang_copy(tmp_path / "patched", "0.5.23")
    with open(root / "sglang" / "srt" / "speculative" / "spec_utils.py", "a") as f:
        f.write(_MARK)
    mark = tmp_path / "mark"

    # the same non-spec reference test_plugin_equivalence compares with (one engine start for both)
    want = _run(engine_pool, EngineConfig(pair="random", spec=None))[0]

    engine_pool.close()  # one engine at a time
    got, stats, log_tail = run_cases_on_patched_server(root, tmp_path, CASES,
                                                       {"SGLANG_EO_PATCH_MARK": str(mark)})
    assert mark.exists() and len(mark.read_text()) > 0, f"the patched build_grammar_vocab_mask never ran:\n{log_tail}"
    assert stats.get("runtime_errors") == [], stats
    for case in CASES:
        assert len(got[case]) == len(want[case]), case
        for i, (g, w) in enumerate(zip(got[case], want[case])):
            assert g[1] and g[1] == w[1], f"patched topk4 {case}[{i}]: {g[0]!r} vs non-spec {w[0]!r}"
            assert g[0] == w[0] and g[2] == w[2], f"patched topk4 {case}[{i}]: {g!r} vs non-spec {w!r}"
