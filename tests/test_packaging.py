"""The distribution's SGLang requirement and the missing-SGLang refusal.

* The ``sglang`` requirement in ``pyproject.toml`` admits exactly the SGLang releases the plugin's version gate
  accepts (:data:`sglang_eagle_overlap.SUPPORTED_SGLANG_VERSIONS`), checked with ``packaging`` against the real
  metadata, and pip enforces it at install time: a wheel built from this repository is dry-run-installed with
  ``--no-index`` into a throw-away venv that holds a tiny fake ``sglang`` distribution (0.5.20, then 0.5.16).
* ``plugin.load()`` in an interpreter without SGLang refuses with a message that says so and names the supported
  versions.

Nothing here touches the network or the calling venv: pip runs with ``--python <temp venv>`` and ``--no-index``.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from sglang_eagle_overlap import SUPPORTED_SGLANG_VERSIONS

ROOT = Path(__file__).resolve().parents[1]

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def _requirements() -> dict[str, Requirement]:
    if tomllib is None:
        pytest.fail("tomllib is needed to read pyproject.toml (Python >= 3.11); run with a test venv's python")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in meta["project"]["dependencies"]]
    return {r.name: r for r in reqs}


# Every SGLang release from the first with the plugin framework (0.5.11) to one past the newest supported, with the
# post releases PyPI has, plus post / next releases that do not exist yet but would be refused by the version gate.
PUBLISHED = (
    "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16",
    "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)
HYPOTHETICAL = ("0.5.17.post1", "0.5.20.post2", "0.5.22.post1", "0.5.23.post1", "0.5.24", "0.6.0", "0.5.23rc1")


def test_sglang_requirement_admits_exactly_the_supported_versions():
    spec = _requirements()["sglang"].specifier
    # prereleases=False is pip's default (SGLang publishes no release candidates on PyPI).
    admitted = [v for v in PUBLISHED + HYPOTHETICAL if spec.contains(v, prereleases=False)]
    assert admitted == list(SUPPORTED_SGLANG_VERSIONS), (
        f"pyproject's sglang requirement {spec} admits {admitted}; the plugin's version gate accepts exactly "
        f"{SUPPORTED_SGLANG_VERSIONS}. Update both together (sglang_eagle_overlap/__init__.py and pyproject.toml)."
    )
    # Known limits of PEP 440 (no "or"): a post release of the OLDER supported version, or a pre-release of the
    # newer one with --pre, would pass. None exists on PyPI, and the version gate would still refuse it at start-up.
    assert spec.contains("0.5.16.post1") and spec.contains("0.5.23rc1", prereleases=True)


def test_requires_python_matches_sglang():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text()) if tomllib else pytest.fail("needs tomllib")
    from packaging.specifiers import SpecifierSet

    rp = SpecifierSet(meta["project"]["requires-python"])
    # SGLang 0.5.16 supports 3.10, 0.5.23 needs >= 3.11: the plugin itself must install on both.
    assert rp.contains("3.10.0") and rp.contains("3.11.7") and rp.contains("3.12.1")


# -- install-time refusal, for real -------------------------------------------------------------------------------
def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _fake_wheel(out_dir: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel ``name==version`` (one empty module): enough for pip to install and resolve."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sglang-eo-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    path = out_dir / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def _pip(target_python: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--python", str(target_python), "--disable-pip-version-check",
           "--no-input", "--isolated", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """The plugin's wheel built from this checkout (a copy, so no build/ or egg-info lands in the repo) and fake
    wheels of its other dependencies."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    shutil.copytree(ROOT / "sglang_eagle_overlap", src / "sglang_eagle_overlap",
                    ignore=shutil.ignore_patterns("__pycache__"))
    house = tmp / "wheels"
    house.mkdir()
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--isolated",
         "--disable-pip-version-check", "-q", "-w", str(house), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"building the plugin wheel failed:\n{build.stdout}\n{build.stderr}"
    assert list(house.glob("sglang_eagle_overlap-*.whl")), list(house.iterdir())
    _fake_wheel(house, "torch", "2.13.0")
    _fake_wheel(house, "xgrammar", "0.2.7")
    return house


def _venv_with_sglang(root: Path, sglang_version: str, fakes: Path) -> Path:
    env_dir = root / f"venv-sglang-{sglang_version}"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    wheel = _fake_wheel(fakes, "sglang", sglang_version)
    res = _pip(py, "install", "--no-index", "--no-deps", "-q", str(wheel))
    assert res.returncode == 0, res.stderr
    return py


def test_pip_refuses_the_plugin_next_to_an_unsupported_sglang(wheelhouse, tmp_path):
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    py = _venv_with_sglang(tmp_path, "0.5.20", fakes)
    # Nothing but the plugin and its other dependencies is on offer: pip must refuse, naming sglang.
    res = _pip(py, "install", "--dry-run", "--no-index", "--find-links", str(wheelhouse), "sglang-eagle-overlap")
    out = res.stdout + res.stderr
    assert res.returncode != 0, f"pip accepted the plugin next to SGLang 0.5.20:\n{out}"
    assert "sglang" in out.lower() and "Would install" not in out, out
    # Asking pip to keep the installed SGLang is refused as a conflict.
    res = _pip(py, "install", "--dry-run", "--no-index", "--find-links", str(wheelhouse), "sglang-eagle-overlap",
               "sglang==0.5.20", "--find-links", str(fakes))
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "conflict" in out.lower(), out
    # With a supported SGLang on offer pip replaces 0.5.20 by it: it never keeps an unsupported SGLang.
    _fake_wheel(fakes, "sglang", "0.5.16")
    res = _pip(py, "install", "--dry-run", "--no-index", "--find-links", str(wheelhouse), "--find-links",
               str(fakes), "sglang-eagle-overlap")
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "sglang-0.5.16" in out and "sglang-0.5.20" not in out, out


def test_pip_accepts_the_plugin_next_to_a_supported_sglang(wheelhouse, tmp_path):
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    py = _venv_with_sglang(tmp_path, "0.5.23", fakes)
    res = _pip(py, "install", "--dry-run", "--no-index", "--find-links", str(wheelhouse), "sglang-eagle-overlap")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    would = next((line for line in out.splitlines() if line.startswith("Would install")), "")
    assert "sglang-eagle-overlap-" in would and "sglang-0." not in would, out  # the installed SGLang is kept


# -- no SGLang at all ------------------------------------------------------------------------------------------------
def test_load_without_sglang_says_it_is_not_installed():
    # -S: no site-packages, so neither the sglang package nor its dist-info metadata exists for this interpreter;
    # only this checkout's plugin package is on the path.
    code = (
        "import sys, importlib.util, importlib.metadata as md\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "assert importlib.util.find_spec('sglang') is None\n"
        "try:\n"
        "    md.version('sglang')\n"
        "    raise SystemExit('sglang metadata visible')\n"
        "except md.PackageNotFoundError:\n"
        "    pass\n"
        "from sglang_eagle_overlap import plugin\n"
        "try:\n"
        "    plugin.load()\n"
        "except plugin.PluginLoadError as e:\n"
        "    print('REFUSED:', e)\n"
        "else:\n"
        "    print('LOADED')\n"
    )
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.startswith("REFUSED:"), out
    msg = out.lower()
    assert "sglang is not installed" in msg, (
        f"the refusal should say SGLang is not installed (got: {out.strip()!r})"
    )
    assert all(v in out for v in SUPPORTED_SGLANG_VERSIONS), out
    assert "sglang none" not in msg, out  # the version lookup's None must not leak into the message


def test_fake_wheel_is_what_pip_installs(tmp_path):
    # Guard for the tests above: the fake dist really registers its version with importlib.metadata.
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    py = _venv_with_sglang(tmp_path, "0.5.20", fakes)
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert Version(out) == Version("0.5.20")


def test_the_wheel_ships_the_native_source(wheelhouse):
    """``core/native.py`` compiles ``native/grammar_batch.cc`` on first use: an installed wheel must carry it."""
    import zipfile

    wheel = next(wheelhouse.glob("sglang_eagle_overlap-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_eagle_overlap/native/grammar_batch.cc" in names
    assert "sglang_eagle_overlap/core/native.py" in names
