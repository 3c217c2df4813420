"""The slow path's host-device copies do not block the scheduler thread, and what crosses is read only when complete.

No GPU here: the ``meta`` device stands for a GPU (a non-CPU device whose copies torch accepts on a CPU-only build),
``tree_copy.pinned_host`` is replaced by a recorder (pinning needs a device runtime), and stand-in events say when a
device-to-host copy is done. Covered: the forced-draft table, row map and positions, the timed-out rows of the
neutralise step (each staged through pinned memory, then copied non-blocking), the forced-draft counters (a copy still
in flight is never read), the pinned tree buffers (bounded whatever the batch sizes) and the native module's error
messages (kept per calling thread)."""

from __future__ import annotations

import threading
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch

from sglang_eagle_overlap.core import tree_copy
from sglang_eagle_overlap.core.forced import ALTERNATIVES, BONUS_KEYS, ForcedDrafts
from sglang_eagle_overlap.core.mask import neutralize_timed_out_drafts
from sglang_eagle_overlap.core.tree_copy import HostTreeCopier
from sglang_eo_dev.helpers.devices import FlagEvent

META = torch.device("meta")


@pytest.fixture
def pinned(monkeypatch) -> List[Tuple[Tuple[int, ...], torch.dtype]]:
    """Records every pinned staging buffer asked for (shape, dtype) and hands out a plain one."""
    asked: List[Tuple[Tuple[int, ...], torch.dtype]] = []

    def fake(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        asked.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(tree_copy, "pinned_host", fake)
    return asked


def test_the_forced_table_goes_up_through_pinned_memory(pinned):
    f = ForcedDrafts(width=4)
    f.begin(6)
    f.upload(META)
    assert pinned == [((6, 1 + BONUS_KEYS, 4, 1 + ALTERNATIVES), torch.int32)]
    assert f._table is not None and f._table.device == META and tuple(f._table.shape) == (6, 1 + BONUS_KEYS, 4, 1 + ALTERNATIVES)
    pinned.clear()
    f.begin(3)
    f.upload("cpu")  # on the CPU: a clone, nothing pinned
    assert pinned == [] and f._table is not None and f._table.device.type == "cpu"


def test_apply_stages_its_row_map_and_positions_through_pinned_memory(pinned):
    f = ForcedDrafts(width=4)
    bs, n = 2, 4
    rows = torch.full((bs, 1 + BONUS_KEYS, 4, 1 + ALTERNATIVES), -1, dtype=torch.int32, device=META)
    f._picked = (("a", "b"), rows, 3)  # what after_verify kept for step N (rows on the device)
    draft = torch.zeros(bs * n, dtype=torch.int64, device=META)
    nxt = torch.zeros(bs, n, dtype=torch.int64, device=META)
    f.apply(draft, nxt, ("b", "a"), chain=True)  # another order: the row map goes up
    assert ((bs,), torch.long) in pinned  # the row map
    assert ((bs * 3,), torch.long) in pinned  # the chain's positions, made once per shape
    assert f._written is not None and f._written.device == META


def test_neutralise_stages_the_timed_out_rows_through_pinned_memory(pinned):
    draft = torch.zeros(3 * 4, dtype=torch.int64, device=META)
    neutralize_timed_out_drafts(draft, [0, 2], 4)
    assert pinned == [((2,), torch.long)]
    host = torch.arange(12, dtype=torch.int64)
    neutralize_timed_out_drafts(host, [1], 4)  # on the CPU: indexed in place, nothing pinned
    assert pinned == [((2,), torch.long)] and host.view(3, 4)[1, 1:].tolist() == [-1, -1, -1]


class StandInStreams:
    def __init__(self) -> None:
        self.events: List[FlagEvent] = []

    def Event(self) -> FlagEvent:  # noqa: N802 - torch.cuda's name
        self.events.append(FlagEvent())
        return self.events[-1]


def test_forced_counters_are_read_only_from_a_completed_copy(pinned):
    f = ForcedDrafts()
    api = StandInStreams()
    f.streams = lambda dev: api  # the counters' device is treated as a GPU
    f._add(torch.tensor([3, 2, 1, 0], dtype=torch.int64))
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (0, 0, 0, 0)  # copy still in flight
    api.events[0].done = True
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (3, 2, 1, 0)
    f._add(torch.tensor([1, 1, 1, 1], dtype=torch.int64))
    f._add(torch.tensor([1, 0, 0, 0], dtype=torch.int64))
    api.events[1].done = True  # the older one done, the newer one not yet
    assert f.proposed == 4 and f.changed == 3
    api.events[2].done = True
    assert f.proposed == 5 and f.accepted == 2
    # copies never completing: bounded, the oldest is waited for
    for _ in range(10):
        f._add(torch.tensor([1, 0, 0, 0], dtype=torch.int64))
    assert len(f._copies) == 4 and sum(e.waits for e in api.events) == 6  # the 5th to 10th copy each waited once
    assert f.proposed == 5 + 10 - len(f._copies)


def test_four_counter_copies_may_be_in_flight_and_the_fifth_waits_for_the_oldest(pinned):
    """Up to four copies of the counters may be in flight without any wait; the fifth step's copy waits for the
    oldest (long done on a real device), whose counts are then read."""
    f = ForcedDrafts(width=4)
    api = StandInStreams()
    f.streams = lambda dev: api  # the counters' device is treated as a GPU
    for step in range(4):
        f._add(torch.tensor([1, 0, 0, 0], dtype=torch.int64))
        assert f.proposed == 0, step  # every copy still in flight: nothing read, nothing waited for
    assert [e.waits for e in api.events] == [0, 0, 0, 0]
    f._add(torch.tensor([1, 0, 0, 0], dtype=torch.int64))
    assert [e.waits for e in api.events] == [1, 0, 0, 0, 0] and f.proposed == 1


def test_chain_positions_are_cached_per_device(pinned):
    """The same shape on another device gets positions on that device, not the cached ones of the first."""
    f = ForcedDrafts(width=4)
    assert f._positions(2, 4, 3, torch.device("cpu")).device.type == "cpu"
    assert f._positions(2, 4, 3, META).device == META


def test_pinned_tree_buffers_are_bounded_over_many_batch_sizes():
    copier = HostTreeCopier()
    for bs in list(range(1, 200)) + list(range(199, 0, -7)):
        for slot in range(2):
            for i, dtype in enumerate((torch.int64, torch.int64, torch.int32)):
                view = copier._host_buffer(slot, i, torch.empty(bs, 8, dtype=dtype, device=META))
                assert tuple(view.shape) == (bs, 8) and view.dtype == dtype
    # per (slot, tensor) one buffer, grown by doubling: 8 .. 2048 elements is 9 sizes
    assert copier.pinned_allocations <= 2 * 3 * 9
    held = sum(b.numel() for slot in copier._buffers for b in slot.values())
    assert held <= 2 * 3 * 2 * 199 * 8  # at most twice the largest tree per buffer
    assert all(len(v) <= tree_copy._MAX_VIEWS for v in copier._views)
    a = copier._host_buffer(0, 0, torch.empty(5, 8, dtype=torch.int64, device=META))
    assert copier._host_buffer(0, 0, torch.empty(5, 8, dtype=torch.int64, device=META)) is a  # steady state: reused


def test_native_error_messages_stay_with_the_thread_that_made_the_call():
    from sglang_eo_dev.helpers import grammars as G
    from sglang_eo_dev.helpers.native import native

    nat = native()
    bad = G.compiled("regex", 512)._handle  # a CompiledGrammar: its "accept_token" lookup fails in C++
    good = nat.handles([G.matcher("nested", 512)])
    failing = nat.step_call([bad], [0, -1, 1, 5], (), (), (), None, None, None, None, 512, None)
    clean = nat.step_call(good, [0, -1, 1, 5], (), (), (), None, None, None, None, 512, None)
    raw: List[Any] = []
    t = threading.Thread(target=lambda: raw.append(failing()))
    t.start()
    t.join()
    clean()  # another call, on this thread, before the failing call's result is read
    res = nat.step_result(raw[0], 1, 0)
    assert ("f", 0) in res.errors and res.errors[("f", 0)]
    assert np.asarray(res.feeds).size == 2
