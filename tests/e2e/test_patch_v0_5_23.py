"""The vendored 0.5.23 patch, end to end: the CPU engine's scheduler imports a patched COPY of SGLang (first on
``PYTHONPATH``; the installed files are never touched), the product package installed (its plugin stands aside on
a patched SGLang), and greedy EAGLE3 topk 4 under the
overlap scheduler writes exactly what non-speculative greedy writes for JSON-schema / regex / mixed batches.

The package's stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``) proves the patched call sites ran the integration in
the scheduler process, as the patched SGLang's runtime (``origin``), not through hooks of the plugin. Two engine starts (an in-process non-spec engine for the
reference, then ``python -m sglang.launch_server`` with the copy first on ``PYTHONPATH``).
"""

from __future__ import annotations

import json

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.helpers.patched_sglang import patched_sglang_copy

from .common import run_cases_on_patched_server
from .test_plugin_equivalence import CASES, _run

pytestmark = [pytest.mark.engine, pytest.mark.sglang_0_5_23]

def test_patched_copy_engine_token_identical(engine_pool, tmp_path):
    root = patched_sglang_copy(tmp_path / "patched", "0.5.23")
    mark = tmp_path / "product-stats.json"

    # the same non-spec reference test_plugin_equivalence compares with (one engine start for both)
    want = _run(engine_pool, EngineConfig(pair="random", spec=None))[0]

    engine_pool.close()  # one engine at a time
    got, stats, log_tail = run_cases_on_patched_server(root, tmp_path, CASES,
                                                       {"SGLANG_EAGLE_OVERLAP_STATS_FILE": str(mark),
                                                        "SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS": "1"})
    assert mark.exists(), f"the patched build_grammar_vocab_mask never ran:\n{log_tail}"
    marks = json.loads(mark.read_text())
    assert marks["origin"] == "patched-sglang" and marks["active"], marks  # the plugin added no hooks
    assert marks["steps"] > 0 and marks["tokens_advanced"] > 0 and marks["pid"] == stats.get("pid"), (marks, stats)
    # grammar-forced drafts switched on: the patched verify recorded forced continuations (the random pair's target
    # seldom writes them the tokenizer's way, so replacements are not required here; tests/e2e/test_real_model.py)
    assert marks["forced_drafts"] is True and marks["forced_nodes"] > 0, marks
    assert stats.get("runtime_errors") == [], stats
    for case in CASES:
        assert len(got[case]) == len(want[case]), case
        for i, (g, w) in enumerate(zip(got[case], want[case])):
            assert g[1] and g[1] == w[1], f"patched topk4 {case}[{i}]: {g[0]!r} vs non-spec {w[0]!r}"
            assert g[0] == w[0] and g[2] == w[2], f"patched topk4 {case}[{i}]: {g!r} vs non-spec {w!r}"
