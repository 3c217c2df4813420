"""HostTreeCopier: CPU passthrough and validation everywhere; pinned-buffer reuse and async copies on CUDA only
(gated by the ``cuda`` marker in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_eagle_overlap.core import HostTreeCopier, PendingTree
from sglang_eo_dev.helpers.devices import CountingEvent


def _tree(bs=3, n=8, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(-1, n, (bs, n), generator=g)
    sib = torch.randint(-1, n, (bs, n), generator=g)
    tok = torch.randint(0, 32000, (bs * n,), generator=g)
    return nxt.to(device), sib.to(device), tok.to(device)


def test_cpu_passthrough_no_copy_no_event():
    copier = HostTreeCopier()
    nxt, sib, tok = _tree()
    pending = copier.start(nxt, sib, tok)
    assert isinstance(pending, PendingTree) and pending.event is None and pending.resolved
    h_nxt, h_sib, h_tok = pending.resolve()
    assert h_nxt is nxt and h_sib is sib and h_tok is tok  # no copy, no reshape: the draft keeps its flat shape
    assert copier.pinned_allocations == 0
    assert pending.resolve()[0] is nxt  # idempotent


@pytest.mark.parametrize(
    "shapes",
    [((3, 8), (3, 7), (24,)), ((3, 8), (3, 8), (23,)), ((2, 8), (3, 8), (24,))],
    ids=["sibling-shape", "draft-numel", "batch"],
)
def test_shape_validation(shapes):
    a, b, c = (torch.zeros(s, dtype=torch.int64) for s in shapes)
    with pytest.raises(ValueError, match="^verify tree tensors disagree in shape: retrieve_next_token "):
        HostTreeCopier().start(a, b, c)


def test_num_slots_validated():
    with pytest.raises(ValueError, match="num_slots"):
        HostTreeCopier(num_slots=0)


@pytest.mark.cuda
def test_cuda_copy_values_and_buffer_reuse():
    copier = HostTreeCopier(num_slots=2)
    history = []
    for step in range(6):
        nxt, sib, tok = _tree(device="cuda", seed=step)
        pending = copier.start(nxt, sib, tok)
        assert pending.event is not None
        h = pending.resolve()
        assert all(t.device.type == "cpu" and t.is_pinned() for t in h)
        assert torch.equal(h[0], nxt.cpu()) and torch.equal(h[1], sib.cpu())
        assert torch.equal(h[2], tok.cpu()) and h[2].shape == tok.shape
        history.append(copier.pinned_allocations)
    # 3 tensors x 2 slots, then never again.
    assert history[1] == 6 and history[-1] == 6, history
    # Slots alternate: step N's host tensors survive step N+1's copy.
    p1 = copier.start(*_tree(device="cuda", seed=10))
    h1 = p1.resolve()
    keep = h1[2].clone()
    copier.start(*_tree(device="cuda", seed=11)).resolve()
    assert torch.equal(h1[2], keep)
    # A new shape allocates once more per slot.
    copier.start(*_tree(bs=5, device="cuda")).resolve()
    assert copier.pinned_allocations == 9


@pytest.mark.cuda
def test_cuda_mixed_cpu_and_device_inputs():
    copier = HostTreeCopier()
    nxt, sib, tok = _tree(device="cuda")
    cpu_sib = sib.cpu()
    h = copier.start(nxt, cpu_sib, tok).resolve()
    assert h[1] is cpu_sib and torch.equal(h[0], nxt.cpu())
    assert copier.pinned_allocations == 2


def test_pending_tree_waits_on_its_event_once():
    host = _tree()
    ev = CountingEvent()
    pending = PendingTree(host=host, event=ev)
    assert not pending.resolved and ev.waits == 0  # creating it waits for nothing
    assert pending.resolve() is host and ev.waits == 1 and pending.resolved
    assert pending.resolve() is host and ev.waits == 1  # resolved: no second wait


class DeviceTensor(torch.Tensor):
    """A CPU tensor that says it lives on a device: drives the copier's device path on a host without one."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cpu(self):  # what the copier reads to tell host tensors from device ones
        return False


class _Module:
    """Stands in for ``torch.cuda`` (what ``torch.get_device_module`` returns): its events count records."""

    def __init__(self) -> None:
        self.events: list = []

    def Event(self):  # noqa: N802 -- torch's name
        module = self

        class Ev(CountingEvent):
            def record(self) -> None:
                module.events.append(self)

        return Ev()


@pytest.fixture
def fake_device(monkeypatch):
    module = _Module()

    def get_device_module(device):
        assert torch.device(device) == torch.device("cuda", 0), device  # the tree's device
        return module

    monkeypatch.setattr(torch, "get_device_module", get_device_module)
    return module


def _device_tree(bs=3, n=8, seed=0):
    return tuple(t.as_subclass(DeviceTensor) for t in _tree(bs, n, seed=seed))


def test_device_tree_is_copied_into_reused_host_buffers(fake_device):
    copier = HostTreeCopier()
    first = copier.start(*_device_tree(seed=1))
    assert first.event is fake_device.events[0] and not first.resolved and first.event.waits == 0
    h1 = first.resolve()
    assert first.event.waits == 1
    src = _tree(seed=1)
    for h, t in zip(h1, src):
        assert type(h) is torch.Tensor and h.device.type == "cpu"  # a host buffer, not the device tensor
        assert torch.equal(h, t) and h.shape == t.shape and h.dtype == t.dtype  # the draft stays flat
    assert copier.pinned_allocations == 3
    # Two slots alternate: step N's host tensors survive step N+1's copy.
    keep = [h.clone() for h in h1]
    h2 = copier.start(*_device_tree(seed=2)).resolve()
    assert copier.pinned_allocations == 6
    assert all(torch.equal(a, b) for a, b in zip(h1, keep))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(h1, h2))
    # The third step reuses the first slot's buffers: no allocation.
    h3 = copier.start(*_device_tree(seed=3)).resolve()
    assert copier.pinned_allocations == 6 and [a.data_ptr() for a in h3] == [a.data_ptr() for a in h1]
    assert torch.equal(h3[2], _tree(seed=3)[2])
    assert len(fake_device.events) == 3  # one event per copy
    # A new shape allocates once more (in the slot it lands in); a new dtype too.
    copier.start(*_device_tree(bs=5, seed=4)).resolve()
    assert copier.pinned_allocations == 9
    nxt, sib, tok = _device_tree(seed=5)
    copier.start(nxt, sib, tok.to(torch.int32)).resolve()
    assert copier.pinned_allocations == 10


def test_one_slot_reuses_its_buffers_every_step(fake_device):
    copier = HostTreeCopier(num_slots=1)
    h1 = copier.start(*_device_tree(seed=1)).resolve()
    h2 = copier.start(*_device_tree(seed=2)).resolve()
    assert copier.pinned_allocations == 3 and [a.data_ptr() for a in h1] == [a.data_ptr() for a in h2]


def test_cpu_tensors_among_device_ones_pass_through(fake_device):
    copier = HostTreeCopier()
    nxt, sib, tok = _device_tree()
    cpu_sib = _tree()[1]
    h = copier.start(nxt, cpu_sib, tok).resolve()
    assert h[1] is cpu_sib and torch.equal(h[0], _tree()[0]) and type(h[0]) is torch.Tensor
    assert copier.pinned_allocations == 2 and len(fake_device.events) == 1
