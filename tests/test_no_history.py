"""The repository speaks of itself, not of how it was made: no file says which work session or which of this
project's issues a line came from, and no benchmark result is named after a commit or an ordinal.

Why: a reader of a comment, a test or a doc needs the reason behind it; a session's ordinal or an issue number tells them
nothing and goes stale. A benchmark result carries the revision it measured inside the file, while its name says what it
measures, so a re-run replaces it instead of adding a file per run (git history keeps the earlier ones).

Scans every file git would commit: the tracked ones plus the untracked files that are not ignored. References to other
projects' trackers ("xgrammar issue #852", "pytorch#58626", a GitHub URL) name their project and are allowed.

The patterns are assembled from pieces so that this file's own text does not match them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"

_ORDINAL = r"[0-9]+(?:st|nd|rd|th)"
# between the words: spaces, a hyphen, or a line break with a comment's continuation marker (# // *)
_GAP = r"(?:[\s-]|#|//|\*)+"
SESSION = re.compile(r"\b" + _ORDINAL + _GAP + "ses" + "sion", re.IGNORECASE)
# the word for an issue followed by a number, "#" optional, one or more: one of this project's issues by number
OWN_ISSUE = re.compile(r"\b" + "iss" + r"ues?" + _GAP + r"#?[0-9]+", re.IGNORECASE)
# the word just before an allowed reference: another project's tracker
UPSTREAM = {"sglang", "xgrammar", "pytorch", "torch", "vllm", "llguidance", "transformers", "flashinfer", "triton",
            "outlines", "huggingface", "upstream", "github", "cpython", "python", "numpy", "mutmut", "pytest", "mypy"}
_WORD_BEFORE = re.compile(r"([A-Za-z0-9_.\-/]+)[\s:'\"`(]*$")
ORDINAL_NAME = re.compile(r"(?:^|[_.\-])" + _ORDINAL + r"(?=[_.\-]|$)", re.IGNORECASE)
HEX_WORD = re.compile(r"(?<![0-9a-z])[0-9a-f]{7,40}(?![0-9a-z])")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def repo_files() -> List[str]:
    """Tracked files plus untracked files that .gitignore does not exclude, that exist in the work tree."""
    names = set(_git("ls-files", "-z").split("\0")) | set(_git("ls-files", "-z", "--others", "--exclude-standard")
                                                           .split("\0"))
    return sorted(n for n in names if n and (ROOT / n).is_file())


def text_of(name: str) -> str:
    """The file's text, or "" for a binary file (a NUL byte in its first 8 KiB)."""
    data = (ROOT / name).read_bytes()
    if b"\0" in data[:8192]:
        return ""
    return data.decode("utf-8", errors="replace")


def own_issue_mentions(text: str) -> List[Tuple[int, str]]:
    """The "issue N" mentions in ``text`` (offset, text) that do not name another project right before them."""
    found = []
    for m in OWN_ISSUE.finditer(text):
        before = _WORD_BEFORE.search(text[max(0, m.start() - 60): m.start()])
        word = before.group(1).lower().rstrip(".,") if before else ""
        if word in UPSTREAM or "/" in word:
            continue
        found.append((m.start(), m.group(0)))
    return found


def history_lines(text: str) -> List[str]:
    """Where ``text`` names a work session by its ordinal or one of this project's issues by number, as
    ``"<line>: <mention>: <line text>"``; a mention may span a line break (a wrapped comment or docstring)."""
    lines = text.splitlines()
    out = []
    for start, hit in sorted([(m.start(), m.group(0)) for m in SESSION.finditer(text)] + own_issue_mentions(text)):
        no = text.count("\n", 0, start) + 1
        out.append(f"{no}: {' '.join(hit.split())}: {lines[no - 1].strip()[:160]}")
    return out


def is_commit(word: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{word}^{{commit}}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def test_the_patterns_catch_history_and_let_upstream_references_through():
    """The detectors themselves: each kind of history mention is caught, other projects' issues are not."""
    n = "1" + "7"
    caught = [f"the 12th {'ses'}sion measured it", f"see iss{'ue'} {n} for why", f"(iss{'ue'} #{n})",
              f"iss{'ues'} 18, 19", f"the 3rd-{'ses'}sion code", f"ISS{'UE'} {n}:",
              f"# since the 13th\n    # {'ses'}sion", f"(see iss{'ue'}\n   {n})"]
    assert all(history_lines(t) for t in caught), [t for t in caught if not history_lines(t)]
    passed = [f"xgrammar iss{'ue'} #852", f"SGLang iss{'ue'} 1234", f"pytorch#58626",
              f"https://github.com/mlc-ai/xgrammar/iss{'ues'}/852", "a sessions table", "the 1st step"]
    assert not any(history_lines(t) for t in passed), [t for t in passed if history_lines(t)]
    assert ORDINAL_NAME.search("scheduler_budget_0.5.16_thread_" + "13" + "th.json")
    assert not ORDINAL_NAME.search("gil_convoy_switch0.5ms.json")


def test_no_file_names_a_work_session_or_one_of_this_projects_issues():
    offenders: Dict[str, List[str]] = {}
    for name in repo_files():
        lines = history_lines(text_of(name))
        if lines:
            offenders[name] = lines
    assert not offenders, ("files that speak of their history instead of the reason (say why instead):\n"
                           + "\n".join(f"{f}:{ln}" for f, ls in offenders.items() for ln in ls[:5]))


def test_benchmark_results_are_named_by_what_they_measure():
    """No result file name carries an ordinal or a commit of this repository: the revision goes inside the file."""
    bad = []
    for name in repo_files():
        if not name.startswith(RESULTS):
            continue
        base = name[len(RESULTS):]
        if ORDINAL_NAME.search(base):
            bad.append(f"{name}: ordinal")
        bad += [f"{name}: commit {w}" for w in HEX_WORD.findall(base) if is_commit(w)]
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def budget_bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_scheduler_budget.py", "bench_scheduler_budget")


def test_a_run_against_a_revision_is_named_by_the_paths_it_compares(budget_bench):
    """``bench_scheduler_budget.py --before REV``: the file says what was compared (``_vs_baseline``), not REV,
    so the next run against the same baseline replaces it; the default set of paths keeps the short name."""
    stem = budget_bench.result_stem
    assert stem("0.5.16", list(budget_bench.PATHS), False) == "scheduler_budget_0.5.16"
    assert stem("0.5.16", ["before", "thread"], False) == "scheduler_budget_0.5.16_thread_vs_baseline"
    assert stem("0.5.23", ["before", "inline", "thread"], False) == "scheduler_budget_0.5.23_inline_thread_vs_baseline"
    assert stem("0.5.23", ["thread", "inline"], False) == "scheduler_budget_0.5.23_thread_inline"
    assert stem("0.5.16", ["thread"], True) == "scheduler_budget_0.5.16_thread_breakdown"
    assert stem("0.5.16", ["before"], False) == "scheduler_budget_0.5.16_vs_baseline"
