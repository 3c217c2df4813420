"""What ``GrammarStep`` reports (its stats file, the per-rank file name, the INFO line) and where the per-process
mask time-limit decision comes from: the TP rank of the process (written for the surviving mutants of ``core/step.py``).

The stats file is what the engine tests, the benchmarks and operators read, so its keys are a contract: each one is
checked by name and value here, with the rank of a ``torch.distributed`` group stood in by patching
``core.step.distributed_rank`` (the core reads the group only through it).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading

import pytest
import torch

from sglang_eagle_overlap.core import RowRun
from sglang_eagle_overlap.core import step as step_mod
from sglang_eagle_overlap.core import telemetry as telemetry_mod
from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.step import GrammarStep
from sglang_eagle_overlap.core.ledger import ResultRuns
from sglang_eagle_overlap.core.mask import MaskRequest
from sglang_eagle_overlap.core.stats import COUNTERS
from sglang_eo_dev.helpers.clocks import FakeTime
from sglang_eo_dev.helpers.grammars import Recorder, doc_tokens, matcher
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.steps import feed_one, make_step, was_fed

BASE_KEYS = {"steps", "grammar_s", "unhidden_s", "advance_s", "tree_wait_s", "mask_s", "mask_timeouts", "sched_s",
             "join_wait_s", "helper_gil_s", "handoff_s", "grammar_thread", "forced_drafts", "native", "tokens_advanced", "ledger_requests",
             "pinned_allocations", "pid", "forced_proposed", "forced_changed", "forced_accepted", "forced_changed_accepted",
             "forced_nodes", "forced_keyed_nodes",
             "rank", "world_size", *COUNTERS}


def _rank(monkeypatch, value):
    monkeypatch.setattr(step_mod, "distributed_rank", lambda: value)
    monkeypatch.setattr(telemetry_mod, "distributed_rank", lambda: value)


def _forced(proposed, changed, accepted, changed_accepted, nodes, keyed=0):
    f = ForcedDrafts()
    f._mirror = torch.tensor([proposed, changed, accepted, changed_accepted], dtype=torch.int64)
    f.recorded_nodes, f.recorded_keyed = nodes, keyed
    return f


def test_snapshot_names_every_number_it_reports(monkeypatch):
    _rank(monkeypatch, (1, 2))
    step = make_step(mask_threads=1, grammar_thread=True, forced=_forced(7, 3, 5, 2, 11, 13),
                     state=lambda: {"active": True})
    s = step.telemetry.stats
    s.steps, s.sched_s, s.join_wait_s, s.helper_gil_s, s.handoff_s = 4, 0.25, 0.125, 0.0625, 0.03125
    s.advance_s, s.tree_wait_s, s.mask_s, s.unhidden_s, s.mask_timeouts = 0.5, 0.75, 1.5, 0.3, 2
    step.count(COUNTERS[0], 3)
    d = step.telemetry.snapshot()
    assert set(d) == BASE_KEYS | {"active"}
    assert (d["steps"], d["sched_s"], d["join_wait_s"], d["helper_gil_s"], d["handoff_s"]) == (
        4, 0.25, 0.125, 0.0625, 0.03125)
    assert (d["advance_s"], d["tree_wait_s"], d["mask_s"], d["unhidden_s"], d["mask_timeouts"]) == (
        0.5, 0.75, 1.5, 0.3, 2)
    assert d["grammar_s"] == pytest.approx(0.5 + 0.75 + 1.5)
    assert d["grammar_thread"] is True and d["forced_drafts"] is True and d["active"] is True
    assert (d["forced_proposed"], d["forced_changed"], d["forced_accepted"], d["forced_changed_accepted"],
            d["forced_nodes"], d["forced_keyed_nodes"]) == (7, 3, 5, 2, 11, 13)
    assert (d["rank"], d["world_size"]) == (1, 2) and d["pid"] == os.getpid()
    assert d[COUNTERS[0]] == 3 and all(d[c] == 0 for c in COUNTERS[1:])
    assert (d["tokens_advanced"], d["ledger_requests"], d["pinned_allocations"]) == (0, 0, 0)


def test_snapshot_without_a_group_or_forced_drafts(monkeypatch):
    _rank(monkeypatch, None)
    d = make_step(mask_threads=1).telemetry.snapshot()
    assert set(d) == BASE_KEYS
    assert d["grammar_thread"] is False and d["forced_drafts"] is False
    assert (d["forced_proposed"], d["forced_changed"], d["forced_accepted"], d["forced_changed_accepted"],
            d["forced_nodes"], d["forced_keyed_nodes"]) == (0, 0, 0, 0, 0, 0)
    assert (d["rank"], d["world_size"]) == (None, None)


@pytest.mark.parametrize("rank, name", [(None, "stats.json"), ((0, 1), "stats.json"), ((1, 2), "stats.rank1.json"),
                                        ((0, 4), "stats.rank0.json")])
def test_stats_file_is_per_rank_and_fixed_once_the_group_is_known(monkeypatch, tmp_path, rank, name):
    _rank(monkeypatch, rank)
    step = make_step(mask_threads=1, stats_file=str(tmp_path / "stats.json"))
    assert step.telemetry.stats_path() == str(tmp_path / name)
    _rank(monkeypatch, (3, 8))  # a group found later changes nothing once a rank was fixed; before, it is looked up
    assert step.telemetry.stats_path() == str(tmp_path / ("stats.rank3.json" if rank is None else name))
    step.telemetry.write_stats()
    written = json.loads((tmp_path / ("stats.rank3.json" if rank is None else name)).read_text())
    assert written["steps"] == 0 and set(written) == BASE_KEYS
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # replaced atomically


def test_no_stats_file_no_path_and_nothing_written(monkeypatch, tmp_path):
    _rank(monkeypatch, (1, 2))
    step = make_step(mask_threads=1)
    assert step.telemetry.stats_path() is None
    step.telemetry.write_stats()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank, allowed", [(None, True), ((0, 1), True), ((0, 2), False), ((1, 2), False),
                                           ((2, 3), False)])
def test_mask_time_limit_only_outside_a_multi_rank_group(monkeypatch, caplog, rank, allowed):
    """Ranks of one TP group must build identical masks, so a wall-clock limit is off there; decided once."""
    _rank(monkeypatch, rank)
    step = make_step(mask_threads=1, mask_time_limit_s=0.05)
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        assert step._may_time_out() is allowed
    _rank(monkeypatch, None if not allowed else (0, 2))  # the decision is not taken again
    assert step._may_time_out() is allowed
    said = [r.getMessage() for r in caplog.records if "mask time limit off" in r.getMessage()]
    assert said == ([] if allowed else [f"sglang-eagle-overlap: mask time limit off in this process (rank {rank[0]} "
                                        f"of {rank[1]}): tensor-parallel ranks must build identical masks"])


def test_report_logs_the_first_step_then_every_interval(monkeypatch, caplog, tmp_path):
    _rank(monkeypatch, None)
    clock = [100.0]
    monkeypatch.setattr(step_mod.time, "monotonic", lambda: clock[0])
    step = make_step(mask_threads=1, log_interval_s=30.0, stats_file=str(tmp_path / "s.json"),
                     forced=_forced(4, 2, 1, 1, 6))
    step.telemetry.stats.steps, step.telemetry.stats.mask_s, step.telemetry.stats.mask_timeouts = 1, 0.002, 1
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        step.telemetry.report()  # first step: a line
        step.telemetry.stats.steps = 2
        clock[0] += 29.0
        step.telemetry.report()  # inside the interval: none
        clock[0] += 1.0
        step.telemetry.stats.steps = 3
        step.telemetry.report()  # interval reached: a line
    lines = [r.getMessage() for r in caplog.records if "grammar verify steps" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("sglang-eagle-overlap: 1 grammar verify steps; per step: grammar 2.000 ms")
    assert "grammar thread off" in lines[0] and "1 mask time-limit hits" in lines[0]
    assert "forced drafts on (4 proposed, 2 changed, 1 accepted)" in lines[0]
    assert lines[1].startswith("sglang-eagle-overlap: 3 grammar verify steps")
    assert json.loads((tmp_path / "s.json").read_text())["steps"] == 3  # the file every step


def test_forced_deltas_are_what_moved_since_the_last_step():
    f = _forced(0, 0, 0, 0, 0)
    step = make_step(mask_threads=1, forced=f)
    assert step._forced_delta() == (0, 0)
    f._mirror = torch.tensor([5, 4, 2, 1], dtype=torch.int64)
    assert step._forced_delta() == (5, 2)
    f._mirror = torch.tensor([9, 6, 3, 2], dtype=torch.int64)
    assert step._forced_delta() == (4, 1)
    assert step._forced_delta() == (0, 0)
    assert make_step(mask_threads=1)._forced_delta() == (0, 0)  # off: nothing ever moves


class _Tree:
    """A resolved one-request, one-node tree (root only)."""

    def __init__(self) -> None:
        z = torch.zeros((1, 1), dtype=torch.int64)
        self.host = (z - 1, z - 1, z)

    def resolve(self):
        return self.host


@pytest.mark.parametrize("rank, asked, allowed", [(None, True, True), ((0, 2), True, False), (None, False, False)])
def test_start_build_records_the_job_it_was_given(monkeypatch, rank, asked, allowed):
    """A job's time-limit permission is the caller's and the process's (TP ranks never), its forced flag says whether
    forced drafts are on; with the grammar thread the barrier runs in the call, on the caller, and the native call on
    the named grammar thread. Its ``submit_s`` is what the call cost its caller, on a clock only the test moves (1000 s
    pass before each call, the barrier takes 0.25 s, nothing else takes time): inline (forced drafts: the work,
    barrier included, waits for finish_build) 0 s; with the grammar thread the barrier's 0.25 s, which is also the
    job's advance time."""
    _rank(monkeypatch, rank)
    clock = FakeTime()  # core.step's time module
    monkeypatch.setattr(step_mod, "time", clock)
    monkeypatch.setattr(telemetry_mod, "time", clock)
    names = []

    def barrier():
        names.append(threading.current_thread().name)
        clock.now += 0.25

    step = make_step(mask_threads=1, grammar_thread=True, forced=_forced(0, 0, 0, 0, 0), pin_memory=False)
    try:
        clock.now += 1000.0
        job = step.start_build([], _Tree(), vocab_size=8, allow_timeout=asked, barrier=barrier)
        assert job.allow_timeout is allowed and job.forced is True
        assert job.submit_s == 0.0
        assert job.future is None and names == []  # forced drafts: the work runs inline, in finish_build
        job2 = make_step(mask_threads=1).start_build([], _Tree(), vocab_size=8)
        assert job2.forced is False and job2.future is None and job2.allow_timeout is (rank is None)
    finally:
        step.close()
    step = make_step(mask_threads=1, grammar_thread=True, pin_memory=False, native=native)
    try:
        m = matcher("regex", 512)
        clock.now += 1000.0
        job = step.start_build([MaskRequest(matcher=m)], _Tree(), vocab_size=512, barrier=barrier)
        assert names == [threading.current_thread().name] and job.future is not None
        assert job.future._thread.name.startswith("sglang-eo-grammar")
        assert job.submit_s == 0.25 and job.advance_s == 0.25
        step.finish_build(job, device="cpu")
    finally:
        step.close()


def test_close_joins_the_open_job_and_a_later_job_starts_a_new_thread():
    step = make_step(mask_threads=1, grammar_thread=True, pin_memory=False, native=native)
    told = []
    grammar = object()
    m = matcher("regex", 512)
    doc = list(doc_tokens("regex", random.Random(0), 512))
    result = ResultRuns(torch.tensor(doc[:1]), None, 1)

    def barrier():
        step.feed_later([RowRun("r", grammar, m, 0, 0)], result, told.append)

    step.start_build([MaskRequest(matcher=m)], _Tree(), vocab_size=512, barrier=barrier)
    assert told == [] and step._thread is not None
    step.close()
    assert len(told) == 1 and told[0][0].retained == (doc[0],) and step._thread is None  # joined, recorded, told
    step.close()  # twice is fine
    job = step.start_build([MaskRequest(matcher=m)], _Tree(), vocab_size=512, barrier=lambda: None)
    assert step._thread is not None
    step.finish_build(job, device="cpu")
    step.close()
    assert step._thread is None and step.ledger.tokens_fed == 1


def test_a_fed_run_and_count_go_through_to_the_ledger_and_stats():
    step = make_step(mask_threads=1)
    g = Recorder()
    assert was_fed(step, "r", 3) is False
    feed_one(step, "r", g, 3, [7, 8])
    assert was_fed(step, "r", 3) is True and was_fed(step, "r", 5) is False and g.fed == [7, 8]
    assert was_fed(step, "other", 3) is False
    step.count(COUNTERS[1])  # one by default
    step.count(COUNTERS[1], 2)
    assert step.telemetry.stats.counters[COUNTERS[1]] == 3


def test_copy_host_tree_resolves_to_the_same_tree_without_the_launch_probe():
    class Probe:
        launches = 0

        def on_launch(self, device):
            Probe.launches += 1

    step = make_step(mask_threads=1, probe=Probe(), pin_memory=False)
    nxt = torch.tensor([[1, -1, -1]])
    sib = torch.tensor([[-1, 2, -1]])
    tok = torch.tensor([[5, 6, 7]])
    got = step.copy_host_tree(nxt, sib, tok).resolve()
    assert [t.tolist() for t in got] == [nxt.tolist(), sib.tolist(), tok.tolist()] and Probe.launches == 0


def test_report_names_the_grammar_thread_when_it_is_on(monkeypatch, caplog):
    _rank(monkeypatch, None)
    step = make_step(mask_threads=1, grammar_thread=True)
    step.telemetry.stats.steps, step.telemetry.stats.join_wait_s, step.telemetry.stats.helper_gil_s, step.telemetry.stats.handoff_s = 1, 0.004, 0.002, 0.001
    with caplog.at_level(logging.INFO, logger="sglang_eagle_overlap"):
        step.telemetry.report()
    (line,) = [r.getMessage() for r in caplog.records if "grammar verify steps" in r.getMessage()]
    assert "(grammar thread on: hand-off 1.000, join wait 4.000, its GIL time <= 2.000)" in line
    assert "forced drafts off" in line



def test_the_telemetry_part_counts_events_by_name_one_or_k_at_a_time():
    """``StepTelemetry.count`` (the part's own counter entry, for a host that holds the part rather than the step):
    one event by default, ``k`` when given, each under its own name, as the snapshot reports them."""
    telemetry = telemetry_mod.StepTelemetry()
    telemetry.count("aborts")
    telemetry.count("aborts")
    telemetry.count("replays", 5)
    snap = telemetry.snapshot()
    assert (snap["aborts"], snap["replays"], snap["mask_failures"]) == (2, 5, 0)
