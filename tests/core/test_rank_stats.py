"""The plugin's stats file under tensor parallelism (issue #21): every TP rank is a scheduler process with its own
grammar step, so with several ranks each writes ``<stem>.rank<r><ext>`` instead of all overwriting one file.

The two-rank case runs two real processes in one gloo ``torch.distributed`` group (what SGLang's CPU backend uses
for TP), each driving :meth:`GrammarStep.write_stats`.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_eagle_overlap.core.stats import distributed_rank, rank_stats_path
from sglang_eagle_overlap.core.step import GrammarStep


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
    step = GrammarStep(stats_file=str(path))
    step.write_stats()
    snap = json.loads(path.read_text())
    assert snap["rank"] is None and snap["world_size"] is None and snap["pid"] == os.getpid()
    assert list(tmp_path.iterdir()) == [path]


def _rank_main(rank: int, world: int, init_file: str, stats: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        step = GrammarStep(stats_file=stats)
        step.stats.count("barrier_runs", rank + 1)  # a per-rank value, to see whose file is whose
        step.write_stats()
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
        assert snap["barrier_runs"] == r + 1
        pids.add(snap["pid"])
    assert len(pids) == world and os.getpid() not in pids
    assert torch.distributed.is_available()
