"""The support table (``sglang_eagle_overlap/support.py``): consistent with the 0.5.16 adapter, backed by existing
engine tests, and the same as the "Speculative algorithms" table of docs/compatibility.md."""

from __future__ import annotations

import re
from pathlib import Path

from sglang_eagle_overlap import support

ROOT = Path(__file__).resolve().parents[1]


def test_every_band_lists_every_issue_algorithm_once():
    for band in ("0.5.16", "0.5.23"):
        names = [c.algorithm for c in support.SUPPORT if c.band == band]
        assert sorted(names) == ["EAGLE", "EAGLE3", "NGRAM", "STANDALONE"], (band, names)


def test_nextn_takes_eagles_row():
    for band in ("0.5.16", "0.5.23"):
        assert support.cell(band, "nextn") is support.cell(band, "EAGLE")
    assert support.cell("0.5.16", "NO_SUCH_ALGO") is None


def test_every_cell_is_backed_by_an_engine_test_file():
    for c in support.SUPPORT:
        path = ROOT / c.tested_by
        assert path.is_file(), c
        assert "pytest.mark.engine" in path.read_text(), c
    assert all(c.tested_by is None for c in support.UNTESTED)


def test_0_5_16_adapter_keeps_exactly_the_table_s_family():
    from sglang_eagle_overlap.adapters.v0_5_16 import band

    assert band.EAGLE_FAMILY == support.kept_algorithms("0.5.16") == {"EAGLE", "EAGLE3", "STANDALONE"}


def test_stand_aside_message_names_algorithm_and_reason():
    msg = support.stand_aside_message("0.5.16", "ngram")
    assert "NGRAM" in msg and "stands aside" in msg and support.cell("0.5.16", "NGRAM").reason in msg


def _doc_rows() -> dict:
    text = (ROOT / "docs" / "compatibility.md").read_text()
    section = text.split("## Speculative algorithms", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"0\.5\.\d+", cells[0]):
            rows[(cells[0], cells[1])] = cells
    return rows


def test_compatibility_page_table_matches_support_table():
    rows = _doc_rows()
    for c in support.SUPPORT + support.UNTESTED:
        key = (c.band, c.algorithm)
        assert key in rows, f"docs/compatibility.md 'Speculative algorithms' lacks {key}"
        decision, tested = rows[key][2], rows[key][-1]
        assert decision.startswith(f"**{c.decision}**"), (key, decision)
        if c.tested_by:
            assert c.tested_by in tested, (key, tested)
        else:
            assert tested.startswith("not tested"), (key, tested)
    assert len(rows) == len(support.SUPPORT) + len(support.UNTESTED)
