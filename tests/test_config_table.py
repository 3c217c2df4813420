"""The configuration table of README.md and docs/configuration.md is the one ``settings.markdown_table()`` renders
from ``settings.ENV`` and ``settings.SWITCH_DOCS``: a switch added, renamed or re-documented in the settings module
and not in the docs (or the other way round) fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_eagle_overlap import settings

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- config-table:start"
END = "<!-- config-table:end -->"
PAGES = ("README.md", "docs/configuration.md")


def embedded_table(text: str) -> str:
    """The lines between the start marker's line and the end marker (exactly one of each, in that order)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(START)]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], (starts, ends)
    return "\n".join(lines[starts[0] + 1:ends[0]])


@pytest.mark.parametrize("page", PAGES)
def test_page_carries_the_generated_table(page):
    text = (ROOT / page).read_text()
    assert embedded_table(text) == settings.markdown_table(), (
        f"{page}: the configuration table differs from the settings module's; regenerate it with "
        "`python -m sglang_eagle_overlap.settings --markdown` and paste it between the config-table markers")


def test_table_has_one_row_per_switch_in_env_order():
    rows = settings.markdown_table().splitlines()[2:]
    names = [row.split("|")[1].strip().strip("`") for row in rows]
    assert names == list(settings.ENV.values())


def test_a_switch_without_docs_makes_the_table_fail(monkeypatch):
    monkeypatch.setitem(settings.ENV, "new_switch", "SGLANG_EAGLE_OVERLAP_NEW_SWITCH")
    with pytest.raises(KeyError, match="SGLANG_EAGLE_OVERLAP_NEW_SWITCH"):
        settings.markdown_table()


def test_documented_defaults_are_the_parsers():
    """The defaults the table states for switches whose default is one value are what an empty environment gives."""
    parsed = settings.Settings.from_env({})
    docs = settings.SWITCH_DOCS
    flag = {"`1`": True, "`0`": False}
    assert flag[docs["grammar_thread"].default] is parsed.grammar_thread
    assert flag[docs["mask_upload_stream"].default] is parsed.mask_upload_stream
    assert int(docs["grammar_thread_min_batch"].default) == parsed.grammar_thread_min_batch
    assert float(docs["mask_time_limit_ms"].default) / 1e3 == parsed.mask_time_limit_s
    assert float(docs["log_interval_s"].default) == parsed.log_interval_s
    assert docs["enabled"].default == "on" and parsed.enabled
    assert docs["forced_drafts"].default == "auto" and parsed.forced_drafts is None
    assert docs["native"].default == "auto" and parsed.native is None
    assert flag[docs["max_length_pattern"].default] is parsed.max_length_pattern
    assert docs["stats_file"].default == "none" and parsed.stats_file is None
    assert docs["timeline_file"].default == "none" and parsed.timeline_file is None


def test_the_module_prints_the_table():
    res = subprocess.run([sys.executable, "-m", "sglang_eagle_overlap.settings", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip("\n") == settings.markdown_table()
