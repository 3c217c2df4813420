"""The overlap-timeline recorder and its step grouping (no SGLang).

Synthetic event logs, times in seconds, drawn per step relative to the verify launch L (``|`` = launch)::

    stock 0.5.16 (forced sync)   advance  tree_wait | forward | mask_build  upload  sample
    plugin / 0.5.23 overlap      tree_copy | forward | advance  tree_wait  mask_build  upload  sample
"""

from __future__ import annotations

import json

import pytest

from sglang_eagle_overlap.core import timeline as T
from sglang_eo_dev import timeline_events as E


def _sync_step(L: float, bs: int = 4):
    return [
        ("advance", L - 0.004, L - 0.003, 0, True),
        ("tree_wait", L - 0.001, L, bs, True),
        ("forward", L, L + 0.010, bs, True),
        ("mask_build", L + 0.010, L + 0.013, 0, True),
        ("mask_upload", L + 0.013, L + 0.0132, bs, True),
        ("sample", L + 0.0132, L + 0.0132, bs, True),
    ]


def _overlap_step(L: float, bs: int = 4):
    return [
        ("tree_copy", L - 0.0005, L - 0.0005, 0, True),
        ("forward", L, L + 0.010, bs, True),
        ("advance", L + 0.010, L + 0.011, bs, True),
        ("tree_wait", L + 0.011, L + 0.0111, bs, True),
        ("mask_build", L + 0.0111, L + 0.0121, bs, True),
        ("mask_upload", L + 0.0121, L + 0.0122, bs, True),
        ("sample", L + 0.0122, L + 0.0122, bs, True),
    ]


def test_disabled_recorder_records_nothing():
    tl = T.Timeline(None)
    tl.span("advance", 1.0, 2.0)
    tl.point("sample")
    assert not tl.enabled and tl.events() == [] and tl.flush() is False


def test_ring_buffer_is_bounded_and_counts_drops(tmp_path):
    tl = T.Timeline(str(tmp_path / "t.json"), capacity=3)
    for i in range(5):
        tl.span("advance", float(i), float(i) + 0.5)
    assert [e[1] for e in tl.events()] == [2.0, 3.0, 4.0]
    assert tl.flush()
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["dropped"] == 2 and len(data["events"]) == 3
    assert E.load_events(str(tmp_path / "t.json")) == tl.events()


def test_writer_thread_flushes_without_an_explicit_call(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(T, "FLUSH_INTERVAL_S", 0.01)
    path = tmp_path / "t.json"
    tl = T.Timeline(str(path))
    tl.point("sample", 1.0, bs=2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.01)
    assert E.load_events(str(path)) == [("sample", 1.0, 1.0, 2, True)]


def test_singleton_is_created_from_the_first_path_given(monkeypatch, tmp_path):
    monkeypatch.setattr(T, "_singleton", [None])
    monkeypatch.setenv(T.TIMELINE_ENV, str(tmp_path / "ignored.json"))  # core reads no environment
    assert not T.process_timeline(None).enabled
    monkeypatch.setattr(T, "_singleton", [None])
    first = T.process_timeline(str(tmp_path / "x.json"))
    assert first.enabled and T.process_timeline(None) is first


def test_sync_steps_put_the_advance_before_the_launch():
    events = _sync_step(10.0) + _sync_step(10.02)
    steps = E.group_steps(events)
    assert len(steps) == 2
    s = steps[0]
    assert s["bs"] == 4
    assert s["forward"] == pytest.approx([0.0, 10.0])
    assert s["phases"]["advance"] == [pytest.approx([-4.0, -3.0])]
    assert s["phases"]["tree_wait"] == [pytest.approx([-1.0, 0.0])]
    assert s["phases"]["mask_build"] == [pytest.approx([10.0, 13.0])]
    assert s["sample"] == pytest.approx(13.2)
    assert s["grammar_ms"] == pytest.approx(1.0 + 1.0 + 3.0 + 0.2)
    assert s["period_ms"] == pytest.approx(20.0) and steps[1]["period_ms"] is None


def test_overlap_steps_keep_phases_after_the_launch_and_the_tree_copy_point():
    steps = E.group_steps(_overlap_step(5.0, bs=8) + _overlap_step(5.05, bs=8))
    s = steps[1]
    assert s["tree_copy"] == pytest.approx(-0.5)
    assert s["phases"]["advance"] == [pytest.approx([10.0, 11.0])]
    assert all(b >= 0 for spans in s["phases"].values() for b, _ in spans)
    assert s["grammar_ms"] == pytest.approx(2.2)


def test_unconstrained_forwards_do_not_make_steps_and_give_free_periods():
    free = [("forward", 1.0 + 0.01 * i, 1.005 + 0.01 * i, 4, False) for i in range(4)]
    free += [("step", 0.9, 0.95, 4, False)]
    events = free + _overlap_step(2.0)
    assert len(E.group_steps(events)) == 1
    periods = E.step_periods(events, grammar=False)
    assert list(periods) == [4] and periods[4] == pytest.approx([10.0, 10.0, 10.0])
    # grammar forwards of another bs never pair with each other
    assert E.step_periods(_overlap_step(3.0, bs=2) + _overlap_step(3.1, bs=4), grammar=True) == {}


def test_a_sample_without_its_forward_drops_the_orphan_phases():
    events = [("advance", 1.0, 1.1, 0, True), ("sample", 1.2, 1.2, 1, True)] + _overlap_step(2.0)
    steps = E.group_steps(events)
    assert len(steps) == 1 and steps[0]["phases"]["advance"] == [pytest.approx([10.0, 11.0])]


def test_mask_apply_after_the_sample_belongs_to_the_step_before():
    events = _overlap_step(1.0) + [("mask_apply", 1.0123, 1.0125, 0, True)] + _overlap_step(1.05)
    steps = E.group_steps(events)
    assert steps[0]["phases"]["mask_apply"] == [pytest.approx([12.3, 12.5])]
    assert steps[0]["apply_ms"] == pytest.approx(0.2) and steps[0]["grammar_ms"] == pytest.approx(2.2)
    assert "mask_apply" not in steps[1]["phases"] and steps[1]["apply_ms"] == 0.0
