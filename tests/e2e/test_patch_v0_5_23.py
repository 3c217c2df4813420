"""The vendored 0.5.23 patch, end to end: the CPU engine's scheduler imports a patched COPY of SGLang (first on
``PYTHONPATH``; the installed files are never touched), product plugin off, and greedy EAGLE3 topk 4 under the
overlap scheduler writes exactly what non-speculative greedy writes for JSON-schema / regex / mixed batches.

The copy's ``build_grammar_vocab_mask`` is wrapped (test-only, in the copy) to append to a marker file, which proves
the patched mask path ran in the scheduler process. Two engine starts (an in-process non-spec engine for the
reference, then ``python -m sglang.launch_server`` with the copy first on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_eo_cpu_runtime.engine import EngineConfig

from .test_plugin_v0_5_23 import CASES, _run_all

pytestmark = [pytest.mark.engine, pytest.mark.sglang_0_5_23]

_REPO = Path(__file__).resolve().parents[2]
_MARK = '''

# --- test-only instrumentation appended by tests/e2e/test_patch_v0_5_23.py ---
_eo_patched_build_grammar_vocab_mask = build_grammar_vocab_mask


def build_grammar_vocab_mask(**kwargs):
    with open(os.environ["SGLANG_EO_PATCH_MARK"], "a") as _f:
        _f.write("x")
    return _eo_patched_build_grammar_vocab_mask(**kwargs)
'''


def test_patched_copy_engine_token_identical(engine_pool, tmp_path):
    import importlib.util

    src = Path(importlib.util.find_spec("sglang").origin).parent
    root = tmp_path / "patched"
    shutil.copytree(src, root / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    for patch in sorted((_REPO / "patches" / "sglang-0.5.23").glob("*.patch")):
        subprocess.run(["git", "apply", "--check", "-p1", str(patch)], cwd=root, check=True)
        subprocess.run(["git", "apply", "-p1", str(patch)], cwd=root, check=True)
    with open(root / "sglang" / "srt" / "speculative" / "spec_utils.py", "a") as f:
        f.write(_MARK)
    mark = tmp_path / "mark"

    base_key = ("patch-0.5.23-baseline",)
    if base_key not in engine_pool.cache:
        engine_pool.cache[base_key] = _run_all(engine_pool.get(EngineConfig(pair="random", spec=None)))
    want = engine_pool.cache[base_key]

    import json as _json
    import urllib.request

    from sglang_eo_cpu_runtime.engine import launch_server

    from .common import output_ids

    engine_pool.close()  # one engine at a time
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), old) if p)
    os.environ["SGLANG_EO_PATCH_MARK"] = str(mark)
    stats_file = str(tmp_path / "runtime-stats.json")
    server = None
    try:
        # A separate ``python -m sglang.launch_server``: its spawned scheduler inherits the copy on ``sys.path``
        # (an in-process Engine would hand this process's already imported, unpatched sys.path to the scheduler).
        server = launch_server(EngineConfig(pair="random", spec="topk4", product_plugin=False),
                               str(tmp_path / "server.log"), stats_file=stats_file)
        got = {}
        for case, (prompts, params) in CASES.items():
            body = _json.dumps({"text": prompts, "sampling_params": params}).encode()
            req = urllib.request.Request(server.base_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                outs = _json.loads(r.read().decode())
            got[case] = [(o["text"], output_ids(o), o["meta_info"]["finish_reason"]) for o in outs]
        stats = server.stats()
        log_tail = server.log_tail(200)
    finally:
        if server is not None:
            server.stop()
        os.environ["PYTHONPATH"] = old
        os.environ.pop("SGLANG_EO_PATCH_MARK", None)
    assert str(root) in log_tail or mark.exists(), log_tail
    assert mark.exists() and len(mark.read_text()) > 0, "the patched build_grammar_vocab_mask never ran"
    assert stats.get("runtime_errors") == [], stats
    for case in CASES:
        for i, (g, w) in enumerate(zip(got[case], want[case])):
            if g[1]:
                assert g[1] == w[1], f"patched topk4 {case}[{i}]: {g[0]!r} vs non-spec {w[0]!r}"
            assert g[0] == w[0], f"patched topk4 {case}[{i}]: {g[0]!r} vs non-spec {w[0]!r}"
