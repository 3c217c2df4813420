"""scripts/demo.py end to end on the real engine (CPU, ``--tiny`` follower models), for the installed SGLang.

On 0.5.16 it runs plugin off and on and must show the difference the README promises: without the plugin every
grammar decode batch ran with the overlap forced off, with it none; on 0.5.23 the plugin on, overlap kept. Every
output valid, the plugin active exactly when on (the demo exits non-zero otherwise), nothing left in TMPDIR.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _row(table: str, version: str, state: str) -> str:
    for line in table.splitlines():
        cells = line.split()
        if cells[:2] == [version, state]:
            return line
    raise AssertionError(f"no row for SGLang {version} plugin {state} in:\n{table}")


@pytest.mark.engine
def test_demo_shows_what_the_plugin_changes(engine_pool):
    from sglang_eagle_overlap.plugin import sglang_version

    engine_pool.close()  # one engine at a time: the demo starts its own
    version = sglang_version()
    venv = Path(sys.executable).parents[1]
    assert venv.name == f"sglang-{version}", (
        f"run this test with the python of a venv built by scripts/setup_cpu_env.sh (got {sys.executable})"
    )
    before = set(os.listdir(tempfile.gettempdir()))
    env = dict(os.environ, SGLANG_EO_VENV_DIR=str(venv.parent))
    cmd = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--sglang-version", version,
           "--plugin", "both" if version == "0.5.16" else "on", "--requests", "2", "--rounds", "1",
           "--max-new-tokens", "64", "--no-engine-lock",  # the test run already holds the engine lock
           "--tiny"]  # the real pair's engines are tested by test_real_model (CI time)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert set(os.listdir(tempfile.gettempdir())) == before, "the demo left files in TMPDIR"
    on = _row(res.stdout, version, "on")
    assert "kept (0/" in on and "2/2" in on, on
    if version == "0.5.16":
        off = _row(res.stdout, version, "off")
        assert "forced OFF" in off and "2/2" in off, off
        n_off, n_total = off.split("forced OFF ", 1)[1].split()[0].split("/")
        assert n_off == n_total and int(n_total) > 0, off
    assert "follower" in res.stdout  # the plain-words explanation of the identical outputs
