"""The user-facing documents hold together: every relative link in README.md, CHANGELOG.md and docs/*.md resolves
(the file exists; a ``#fragment`` names a heading of the target page), the README stays short, and the GPU figures
the demo prints are the ones README.md and docs/benchmarks.md quote."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(text: str) -> List[Tuple[int, str]]:
    """(line number, target) of every markdown link and image outside code (a link inside code is not a link)."""
    return [(n, m.group(1)) for n, line in prose_lines(text) for m in _LINK.finditer(_INLINE_CODE.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """Every heading anchor of a markdown page, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: Dict[str, int] = {}
    out: Set[str] = set()
    for _, line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> List[str]:
    problems = []
    for number, target in links(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ... are not checked
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{fragment} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path, monkeypatch):
    (tmp_path / "other.md").write_text("# A heading\n\n## Second `code` part, again\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading) [ok](other.md#second-code-part-again) [self](#top)\n"
                    "# Top\n[gone](missing.md) [bad](other.md#nope) `[code](missing.md)`\n"
                    "```\n[in a block](missing.md)\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)  # messages name files relative to ROOT
    problems = broken_links(page)
    assert [p.split(": ", 1)[1] for p in problems] == ["missing.md: no such file", "other.md#nope: no heading with "
                                                      "anchor #nope in other.md"]


def test_github_anchor_rules():
    assert slug("CPU: the scheduler thread's grammar time per step") == "cpu-the-scheduler-threads-grammar-time-per-step"
    assert slug("No C++ compiler") == "no-c-compiler"
    assert slug("xgrammar: `maxLength` strings admit raw control characters") == (
        "xgrammar-maxlength-strings-admit-raw-control-characters")
    assert slug("Grammar work per verify step, plugin vs SGLang 0.5.23") == (
        "grammar-work-per-verify-step-plugin-vs-sglang-0523")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.fixture(scope="module")
def demo():
    yield from loaded_script(ROOT / "scripts" / "demo.py", "sglang_eo_demo_docs")


def test_the_demo_quotes_the_gpu_figures_of_the_benchmarks_page(demo):
    figures = (demo.GPU_STOCK_OVER_PLUGIN, demo.GPU_PLUGIN_OVER_UNCONSTRAINED, demo.GPU_STOCK_OVER_UNCONSTRAINED)
    words = "\n".join(demo.explanation([], gpu=False))
    for figure in figures:
        assert figure in words, f"the demo does not print {figure!r}"
        for page in ("README.md", "docs/benchmarks.md"):
            assert figure in (ROOT / page).read_text(), f"{page} does not quote the demo's GPU figure {figure!r}"
    assert (ROOT / demo.GPU_RESULTS_DOC).is_file()


_SHA = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_no_commit(page):
    """A reader learns nothing from a commit hash; result files, not the documents, record the revision a benchmark
    measured. (Issue numbers and session ordinals: tests/test_no_history.py, over every file.)"""
    assert _SHA.findall(page.read_text()) == []
