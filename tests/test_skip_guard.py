"""``tests/skip_guard.py``: with ``SGLANG_EO_REQUIRE_ENGINE=1`` a skip outside ``ALLOWED_SKIPS`` fails the run.

Each case runs pytest in a fresh interpreter: on tiny test files written here (the guard loaded with ``-p``), and on
the real ``tests/e2e/test_sgl_kernel_standin.py`` with the ``sgl_kernel`` stand-in hidden the way a broken CPU venv
hides it (``find_spec`` finds nothing), so the repository's own conftests decide the skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional, Tuple

import pytest

from tests.skip_guard import ALLOWED_SKIPS, ENV, allowed_skip

ROOT = Path(__file__).resolve().parents[1]

_FILES = {
    "test_cuda_allowed.py": """
        import pytest

        @pytest.mark.cuda
        @pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
        def test_gpu():
            pass

        @pytest.mark.sglang_0_5_16
        @pytest.mark.skip(reason="needs SGLang 0.5.16 installed (found 0.5.23); run with that version's venv python")
        def test_other_band():
            pass

        def test_runs():
            assert 1 + 1 == 2
        """,
    "test_stray_skip.py": """
        import pytest

        def test_quietly_skipped():
            pytest.skip("needs something this machine should have")
        """,
    "test_band_reason_without_marker.py": """
        import pytest

        @pytest.mark.skip(reason="needs SGLang 0.5.16 installed (found 0.5.23); run with that version's venv python")
        def test_unmarked():
            pass
        """,
    "test_cuda_reason_without_marker.py": """
        import pytest

        @pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
        def test_unmarked():
            pass
        """,
    "test_module_skip.py": """
        import pytest

        pytest.importorskip("no_such_module_sglang_eo")

        def test_never():
            pass
        """,
}

_INI = """
[pytest]
markers =
    cuda: a
    engine: b
    sglang_0_5_16: c
    sglang_0_5_23: d
"""


def _pytest(args, cwd: Path, require: Optional[str], prelude: str = "") -> Tuple[int, str]:
    env: Dict[str, str] = dict(os.environ)
    env.pop(ENV, None)
    if require is not None:
        env[ENV] = require
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the guard and the repository's conftests only
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "dev"), env.get("PYTHONPATH", "")) if p)
    code = prelude + "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "-q", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _tiny(tmp_path: Path, *names: str) -> Path:
    (tmp_path / "pytest.ini").write_text(_INI)
    for name in names:
        (tmp_path / name).write_text(textwrap.dedent(_FILES[name]))
    return tmp_path


_BAD = ("test_stray_skip.py", "test_band_reason_without_marker.py", "test_cuda_reason_without_marker.py",
        "test_module_skip.py")


def test_allowed_skips_pass_with_the_guard_on(tmp_path):
    rc, out = _pytest(["-p", "tests.skip_guard", "-rs"], _tiny(tmp_path, "test_cuda_allowed.py"), "1")
    assert rc == 0, out
    assert "1 passed, 2 skipped" in out, out


def test_each_skip_outside_the_list_fails_the_run_only_with_the_guard_on(tmp_path):
    root = _tiny(tmp_path, "test_cuda_allowed.py", *_BAD)
    rc, out = _pytest(["-p", "tests.skip_guard"], root, "1")
    assert rc == 1, out
    assert f"{ENV}=1: skipped tests that must run here" in out, out
    summary = out[out.index(f"{ENV}=1: skipped"):]
    for name in _BAD:
        assert name in summary, (name, summary)  # every offending test is named ...
    assert "test_cuda_allowed.py" not in summary, summary  # ... and no allowed one
    rc, out = _pytest(["-p", "tests.skip_guard"], root, "0")
    assert rc == 0 and "skipped tests that must run here" not in out, out


def test_hidden_sgl_kernel_fails_the_real_suite_and_says_why():
    target = ["tests/e2e/test_sgl_kernel_standin.py"]
    rc, out = _pytest(target, ROOT, "1")
    assert rc == 0 and " passed" in out and "skipped" not in out, out  # control: nothing skipped here
    hide = "import sys; sys.modules['sgl_kernel'] = None\n"  # what a venv without the stand-in looks like
    rc, out = _pytest(target, ROOT, "1", prelude=hide)
    assert rc == 1, out
    assert "sgl_kernel stand-in not importable" in out and "scripts/setup_cpu_env.sh" in out, out


def test_allowed_list_matches_reason_and_marker():
    names = {e.name for e in ALLOWED_SKIPS}
    assert names == {"cuda", "other-band", "noisy-follower-only"}
    cuda = "needs a CUDA device: torch.cuda.is_available() is False on this machine"
    assert allowed_skip(cuda, ["cuda"]).name == "cuda"
    assert allowed_skip(cuda, []) is None
    band = "needs SGLang 0.5.23 installed (found 0.5.16); run with that version's venv python"
    assert allowed_skip(band, ["sglang_0_5_23"]).name == "other-band"
    assert allowed_skip(band, ["sglang_0_5_16"]) is None  # a band skip on a test of the other band's marker
    missing = ("engine tests need SGLang and the CPU test runtime (missing: sgl_kernel); run with the python of a "
               "venv built by scripts/setup_cpu_env.sh <version>")
    assert allowed_skip(missing, ["engine"]) is None
