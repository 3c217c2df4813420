"""The vendored 0.5.16 patch, end to end: the CPU engine's scheduler imports a patched COPY of SGLang 0.5.16 (first on
``PYTHONPATH``; the installed files are never touched), the product package installed (its plugin stands aside on
a patched SGLang), and greedy EAGLE3 topk 4 under the
overlap scheduler writes exactly what non-speculative greedy writes for JSON-schema / regex / EBNF / mixed batches,
while no grammar decode batch is forced out of overlap (unpatched 0.5.16 forces every one of them:
``tests/e2e/test_plugin_equivalence.py`` pins that with the plugin off).

The package's stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``, written every verify step) proves the patched call
sites ran the integration in the scheduler process (barrier advance, native mask, post-processing replays) and that
the runtime is the patched SGLang's (``origin``), not hooks of the plugin. Two engine starts (the in-process non-spec reference, shared
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

def test_patched_copy_engine_token_identical_and_overlapped(engine_pool, tmp_path):
    root = patched_sglang_copy(tmp_path / "patched", "0.5.16")
    mark = tmp_path / "product-stats.json"

    # the same non-spec reference test_plugin_equivalence compares with (one engine start for both)
    want = _run(engine_pool, EngineConfig(pair="random", spec=None))[0]

    engine_pool.close()  # one engine at a time
    got, stats, log_tail = run_cases_on_patched_server(root, tmp_path, CASES,
                                                       {"SGLANG_EAGLE_OVERLAP_STATS_FILE": str(mark),
                                                        "SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS": "1"})

    # The patched verify path ran in the scheduler process: barrier fed tokens, post-processing replayed them.
    assert mark.exists(), f"the patched build_vocab_mask never ran:\n{log_tail}"
    marks = json.loads(mark.read_text())
    assert marks["pid"] != os.getpid() and marks["pid"] == stats.get("pid"), (marks, stats)
    assert marks["origin"] == "patched-sglang" and marks["active"], marks  # the plugin added no hooks
    assert marks["steps"] > 0 and marks["tokens_advanced"] > 0 and marks["replays"] > 0, marks
    assert marks["aborts"] == 0 and marks["barrier_runs"] > 0, marks
    # grammar-forced drafts switched on: the patched verify recorded forced continuations (the random pair's target
    # seldom writes them the tokenizer's way, so replacements are not required here; tests/e2e/test_real_model.py)
    assert marks["forced_drafts"] is True and marks["forced_nodes"] > 0, marks
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
