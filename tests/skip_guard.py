"""pytest plugin: with ``SGLANG_EO_REQUIRE_ENGINE=1`` a test skipped for a reason not in :data:`ALLOWED_SKIPS` fails
the session.

Why: the engine suite skips itself when the interpreter lacks SGLang, the CPU ``sgl_kernel`` stand-in or the dev
package (``tests/e2e/conftest.py``), so a broken CPU venv used to give a green run. ``scripts/test.sh`` (hence
``.ci/run``) sets the variable: on the venvs it builds every test runs except the named skips below.

Call order: ``pytest_runtest_logreport`` / ``pytest_collectreport`` record every skip (an xfail is none) as it is
reported; at the end ``pytest_sessionfinish`` (tryfirst) turns an otherwise green exit status into ``TESTS_FAILED``
when a skip was not allowed, and ``pytest_terminal_summary`` prints each one grouped by reason, with what is missing
from the interpreter and the command that repairs it. Without the variable the plugin only records.

Registered by ``tests/conftest.py`` (``pytest_plugins``); ``tests/test_skip_guard.py`` runs pytest on tiny test files
with and without it. The other-band entry depends on the SGLang installed: on the 0.5.23 venv only a 0.5.16 test
skipped for "needs SGLang 0.5.16 installed (found 0.5.23)" passes, and the reverse on the 0.5.16 venv.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

# The version of the SGLang distribution this interpreter has, or None: what tests/conftest.py reports as ``found`` in
# a band skip (the same function).
from sglang_eagle_overlap.plugin import sglang_version as installed_sglang

__all__ = ["ENV", "ALLOWED_SKIPS", "AllowedSkip", "allowed_skip", "allowed_skips", "diagnose", "installed_sglang"]

ENV = "SGLANG_EO_REQUIRE_ENGINE"


@dataclass(frozen=True)
class AllowedSkip:
    """A skip that is expected on a machine that runs the whole suite: ``reason`` is a regex the skip reason must
    match from its start, and the test must carry ``marker`` (when set)."""

    name: str
    reason: str
    marker: Optional[str]
    why: str


# The supported SGLang bands and the marker of each band's tests (tests/conftest.py skips the other band's).
_VERSION_MARKERS = {"0.5.16": "sglang_0_5_16", "0.5.23": "sglang_0_5_23"}


def _other_band_reason(installed: Optional[str]) -> str:
    """The band skip allowed on a venv of SGLang ``installed``: a test of another supported band, on this band only.
    Without a supported band installed nothing matches: such a venv runs neither band's tests, and that must show."""
    if installed not in _VERSION_MARKERS:
        return r"(?!)"  # matches no reason
    wanted = "|".join(re.escape(v) for v in _VERSION_MARKERS if v != installed)
    return rf"needs SGLang ({wanted}) installed \(found {re.escape(installed)}\)"


def allowed_skips(installed: Optional[str]) -> Tuple[AllowedSkip, ...]:
    """The skips allowed on a venv of SGLang ``installed`` (None: no SGLang)."""
    return (
        AllowedSkip("cuda", r"needs a CUDA device: torch\.cuda\.is_available\(\) is False", "cuda",
                    "CUDA-only tests (tests/gpu, @pytest.mark.cuda) on a machine without a GPU"),
        AllowedSkip("other-band", _other_band_reason(installed), None,
                    "tests of the other supported SGLang band (@pytest.mark.sglang_0_5_16 / sglang_0_5_23); the "
                    "other venv runs them"),
        AllowedSkip("noisy-follower-only", r"only the noisy follower is expected to accept drafts$", "engine",
                    "tests/e2e/test_spec_equivalence.py::test_noisy_follower_accepts_drafts on the random-weight pair "
                    "(whose drafts are never accepted by design)"),
    )


# This interpreter's list: the other-band entry names the band not installed here.
ALLOWED_SKIPS: Tuple[AllowedSkip, ...] = allowed_skips(installed_sglang())

# What the suite needs importable, and what a missing one means.
_REQUIRED = (
    ("sglang", "SGLang is not installed: the engine, contract and patch tests would be skipped"),
    ("sgl_kernel", "sgl_kernel stand-in not importable: the engine suite would be skipped"),
    ("sglang_eo_dev", "the dev package sglang_eo_dev (CPU runtime, helpers) is not importable: the engine suite "
                      "would be skipped"),
    ("xgrammar", "xgrammar is not installed"),
    ("torch", "torch is not installed"),
)


def allowed_skip(reason: str, keywords: Sequence[str],
                 entries: Optional[Sequence[AllowedSkip]] = None) -> Optional[AllowedSkip]:
    """The entry of ``entries`` (default :data:`ALLOWED_SKIPS`, this interpreter's) that allows a skip with this reason
    on a test with these keywords."""
    for entry in ALLOWED_SKIPS if entries is None else entries:
        match = re.match(entry.reason, reason)
        if match is None or (entry.marker is not None and entry.marker not in keywords):
            continue
        if entry.name == "other-band" and _VERSION_MARKERS[match.group(1)] not in keywords:
            continue  # a band skip only on a test that carries that band's marker
        return entry
    return None


def diagnose() -> List[str]:
    """One line per module the suite needs that this interpreter cannot import."""
    missing = []
    for module, meaning in _REQUIRED:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(f"{meaning} ({module} not importable)")
    return missing


def _reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
    else:
        text = str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def _required() -> bool:
    return os.environ.get(ENV) == "1"


_STATE: Dict[str, List[Tuple[str, str]]] = {"bad": []}


def pytest_sessionstart(session: pytest.Session) -> None:
    _STATE["bad"] = []


def _record(nodeid: str, longrepr: object, keywords: Sequence[str]) -> None:
    reason = _reason(longrepr)
    if allowed_skip(reason, keywords) is None:
        _STATE["bad"].append((nodeid, reason))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # pytest reports an expected failure (xfail mark, ``pytest.xfail``) as skipped with ``wasxfail`` set: the test ran
    # (or was declared not to) and failed as expected, which is a result, not a skip
    if report.skipped and not hasattr(report, "wasxfail"):
        _record(report.nodeid, report.longrepr, list(report.keywords))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _record(report.nodeid, report.longrepr, [])


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _required() and _STATE["bad"] and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    bad = _STATE["bad"]
    if not bad or not _required():
        return
    tr = terminalreporter
    tr.section(f"{ENV}=1: skipped tests that must run here", sep="=", red=True, bold=True)
    for line in diagnose():
        tr.write_line(f"CAUSE: {line}; rebuild the venv with scripts/setup_cpu_env.sh <version> "
                      "(or run scripts/test.sh, which builds it)", red=True)
    groups: Dict[str, List[str]] = {}
    for nodeid, reason in bad:
        groups.setdefault(reason, []).append(nodeid)
    for reason, nodeids in groups.items():
        tr.write_line(f"{len(nodeids)} skipped: {reason}")
        for nodeid in nodeids[:3]:
            tr.write_line(f"    {nodeid}")
        if len(nodeids) > 3:
            tr.write_line(f"    ... and {len(nodeids) - 3} more")
    names = ", ".join(e.name for e in ALLOWED_SKIPS)
    tr.write_line(f"Only these skips are allowed (tests/skip_guard.py ALLOWED_SKIPS): {names}. A skip that is "
                  f"expected on every machine belongs there, with its reason; unset {ENV} to run a partial suite.")
