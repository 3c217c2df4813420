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

from tests.skip_guard import ALLOWED_SKIPS, ENV, allowed_skip, allowed_skips, installed_sglang

ROOT = Path(__file__).resolve().parents[1]
# The tiny files' band skips are written as tests/conftest.py writes them on this interpreter: a test of the band not
# installed here (OTHER) is skipped, found RUNNING; the guard allows that and nothing else.
RUNNING = installed_sglang()
OTHER = "0.5.16" if RUNNING == "0.5.23" else "0.5.23"

_FILES = {
    "test_cuda_allowed.py": """
        import pytest

        @pytest.mark.cuda
        @pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False on this machine")
        def test_gpu():
            pass

        @pytest.mark.sglang_OTHER_MARK
        @pytest.mark.skip(reason="needs SGLang OTHER installed (found RUNNING); run with that version's venv python")
        def test_other_band():
            pass

        def test_runs():
            assert 1 + 1 == 2
        """,
    "test_xfails.py": """
        import pytest

        @pytest.mark.xfail(reason="a known upstream bug")
        def test_marked_xfail_that_fails():
            assert False

        @pytest.mark.xfail(reason="would hang", run=False)
        def test_xfail_not_run():
            assert False

        def test_imperative_xfail():
            pytest.xfail("fails here by design")
        """,
    "test_own_band_skipped.py": """
        import pytest

        # a test of the band installed here that skips itself with a band reason: it must run on this venv
        @pytest.mark.sglang_RUNNING_MARK
        @pytest.mark.skip(reason="needs SGLang RUNNING installed (found RUNNING); run with that version's venv python")
        def test_own_band():
            pass
        """,
    "test_stray_skip.py": """
        import pytest

        def test_quietly_skipped():
            pytest.skip("needs something this machine should have")
        """,
    "test_band_reason_without_marker.py": """
        import pytest

        @pytest.mark.skip(reason="needs SGLang OTHER installed (found RUNNING); run with that version's venv python")
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


def _mark(version: str) -> str:
    return version.replace(".", "_")


def _tiny(tmp_path: Path, *names: str) -> Path:
    (tmp_path / "pytest.ini").write_text(_INI)
    for name in names:
        text = textwrap.dedent(_FILES[name])
        text = text.replace("OTHER_MARK", _mark(OTHER)).replace("RUNNING_MARK", _mark(str(RUNNING)))
        (tmp_path / name).write_text(text.replace("OTHER", OTHER).replace("RUNNING", str(RUNNING)))
    return tmp_path


_BAD = ("test_stray_skip.py", "test_band_reason_without_marker.py", "test_cuda_reason_without_marker.py",
        "test_module_skip.py", "test_own_band_skipped.py")


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
    on_16 = allowed_skips("0.5.16")
    band = "needs SGLang 0.5.23 installed (found 0.5.16); run with that version's venv python"
    assert allowed_skip(band, ["sglang_0_5_23"], on_16).name == "other-band"
    assert allowed_skip(band, ["sglang_0_5_16"], on_16) is None  # a band skip on a test of the other band's marker
    missing = ("engine tests need SGLang and the CPU test runtime (missing: sgl_kernel); run with the python of a "
               "venv built by scripts/setup_cpu_env.sh <version>")
    assert allowed_skip(missing, ["engine"]) is None


@pytest.mark.parametrize("running, other", [("0.5.23", "0.5.16"), ("0.5.16", "0.5.23")])
def test_a_band_skip_is_allowed_only_for_the_band_not_installed(running, other):
    """On the venv of ``running`` the only band skip allowed is a test of ``other`` reported as found ``running``
    (what tests/conftest.py writes there). A test of the running band skipped with a band reason, or a reason naming
    another installed version, is a test that should have run here."""
    entries = allowed_skips(running)
    mark = {v: f"sglang_{_mark(v)}" for v in (running, other)}

    def reason(wanted: str, found: str) -> str:
        return f"needs SGLang {wanted} installed (found {found}); run with that version's venv python"

    assert allowed_skip(reason(other, running), [mark[other]], entries).name == "other-band"
    assert allowed_skip(reason(running, running), [mark[running]], entries) is None  # its own band's test
    assert allowed_skip(reason(running, other), [mark[running]], entries) is None  # what the other venv would say
    assert allowed_skip(reason(other, "0.5.20"), [mark[other]], entries) is None  # found is not what runs here
    # no supported band installed (no SGLang, or an unsupported version): no band skip is expected anywhere
    for installed in (None, "0.5.20"):
        for wanted in mark:
            assert allowed_skip(reason(wanted, str(installed)), [mark[wanted]], allowed_skips(installed)) is None


def test_xfails_are_not_skips(tmp_path):
    """An expected failure (xfail mark, not run or failing, ``pytest.xfail``) is reported by pytest as skipped with
    ``wasxfail``: the guard must not count it, or marking a known failure xfail would fail a run the skip guard
    should pass."""
    root = _tiny(tmp_path, "test_xfails.py", "test_cuda_allowed.py")
    rc, out = _pytest(["-p", "tests.skip_guard", "-rsx"], root, "1")
    assert rc == 0, out
    assert "1 passed, 2 skipped, 3 xfailed" in out and "skipped tests that must run here" not in out, out


def test_the_running_bands_own_test_skipped_with_a_band_reason_fails_the_run(tmp_path):
    """The end-to-end form of the band rule: next to the allowed other-band skip, a test of this venv's band that
    skips with a band reason fails the run and is named."""
    root = _tiny(tmp_path, "test_cuda_allowed.py", "test_own_band_skipped.py")
    rc, out = _pytest(["-p", "tests.skip_guard"], root, "1")
    assert rc == 1, out
    summary = out[out.index(f"{ENV}=1: skipped"):]
    assert "test_own_band_skipped.py::test_own_band" in summary and "test_cuda_allowed.py" not in summary, summary
