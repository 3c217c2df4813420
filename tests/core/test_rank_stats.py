"""The plugin's grammar step under tensor parallelism: every TP rank is a scheduler process with its own
:class:`GrammarStep`.

* Stats: with several ranks each writes ``<stem>.rank<r><ext>`` instead of all overwriting one file.
* Mask time limit: wall-clock, so ranks could disagree on which requests keep their drafts; a step that is one rank
  of several builds without it (a slow grammar costs time, never a different mask), a single process keeps it.

The two-rank cases run two real processes in one gloo ``torch.distributed`` group (what SGLang's CPU backend uses
for TP).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.stats import distributed_rank, rank_stats_path
from sglang_eagle_overlap.core.step import GrammarStep
from sglang_eo_dev.helpers.steps import make_step


def test_single_rank_keeps_the_path():
    assert rank_stats_path("/x/stats.json", 0, 1) == "/x/stats.json"
    assert rank_stats_path("/x/stats", 0, 1) == "/x/stats"


@pytest.mark.parametrize("path,rank,want", [
    ("/x/stats.json", 0, "/x/stats.rank0.json"),
    ("/x/stats.json", 7, "/x/stats.rank7.json"),
    ("/x/stats", 1, "/x/stats.rank1"),
    ("/x.d/plugin-stats.v2.json", 3, "/x.d/plugin-stats.v2.rank3.json"),
])
def test_several_ranks_get_one_file_each(path, rank, want):
    assert rank_stats_path(path, rank, 8) == want


def test_without_a_process_group_the_step_writes_the_plain_path(tmp_path):
    assert not dist.is_initialized()
    assert distributed_rank() is None
    path = tmp_path / "stats.json"
    step = make_step(stats_file=str(path))
    step.telemetry.write_stats()
    snap = json.loads(path.read_text())
    assert snap["rank"] is None and snap["world_size"] is None and snap["pid"] == os.getpid()
    assert list(tmp_path.iterdir()) == [path]


class _SlowGrammar:
    """Accepts every token; each mask row takes ``fill_s`` (a slow grammar, e.g. on a busy core)."""

    def __init__(self, fill_s: float) -> None:
        self.fill_s = fill_s

    def accept_token(self, token: int) -> bool:
        return True

    def rollback(self, k: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def fill_vocab_mask(self, vocab_mask, idx: int) -> None:
        time.sleep(self.fill_s)


class _Chain:
    """A resolved verify tree: one request, a chain of 4 nodes (root + 3 drafts)."""

    def resolve(self):
        nxt = torch.tensor([[1, 2, 3, -1]])
        return nxt, torch.full((1, 4), -1), torch.tensor([[0, 5, 6, 7]])


def _slow_step(stats: str) -> tuple[GrammarStep, torch.Tensor]:
    """One verify step whose only request's mask build exceeds the 10 ms limit at its root row."""
    step = make_step(stats_file=stats, mask_time_limit_s=0.01, mask_threads=1)
    drafts = torch.tensor([0, 5, 6, 7])
    step.build_mask([MaskRequest(grammar=_SlowGrammar(0.03), request_id="slow")], _Chain(), vocab_size=64,
                    device="cpu", draft_device=drafts)
    return step, drafts


def test_a_single_process_applies_the_mask_time_limit(tmp_path):
    step, drafts = _slow_step(str(tmp_path / "stats.json"))
    assert step.telemetry.stats.mask_timeouts == 1
    assert drafts.tolist() == [0, -1, -1, -1]  # its drafts dropped for this step


def _rank_main(rank: int, world: int, init_file: str, stats: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        step = make_step(stats_file=stats)
        step.telemetry.stats.count("barrier_runs", rank + 1)  # a per-rank value, to see whose file is whose
        step.telemetry.write_stats()
        if rank == 1:  # only rank 1 is slow: it must still build the exact mask and keep its drafts
            slow, drafts = _slow_step(stats)
            slow.telemetry.stats.count("barrier_runs", 100 + int(drafts.tolist() == [0, 5, 6, 7]))
            slow.telemetry.write_stats()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_each_rank_of_a_gloo_group_writes_its_own_file(tmp_path):
    stats = str(tmp_path / "stats.json")
    world = 2
    mp.start_processes(_rank_main, args=(world, str(tmp_path / "init"), stats), nprocs=world, start_method="spawn")
    assert not os.path.exists(stats)  # nobody wrote the shared path
    pids = set()
    for r in range(world):
        snap = json.loads((tmp_path / f"stats.rank{r}.json").read_text())
        assert (snap["rank"], snap["world_size"]) == (r, world)
        if r == 1:  # the slow step's file: no time-limit hit, drafts intact
            assert snap["mask_timeouts"] == 0 and snap["steps"] == 1 and snap["barrier_runs"] == 101, snap
        else:
            assert snap["barrier_runs"] == 1
        pids.add(snap["pid"])
    assert len(pids) == world and os.getpid() not in pids
    assert torch.distributed.is_available()
