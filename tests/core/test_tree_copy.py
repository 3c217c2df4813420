"""HostTreeCopier and MaskUploader: CPU passthrough, validation and the upload's stream order (a stand-in stream API)
everywhere; pinned-buffer reuse, async copies and the uploaded values on CUDA only
(gated by the ``cuda`` marker in tests/conftest.py)."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sglang_eagle_overlap.core import PendingTree

from sglang_eagle_overlap.core.tree_copy import HostTreeCopier
from sglang_eagle_overlap.core.tree_copy import MaskUploader
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


class _Stream:
    def __init__(self, api: "_StreamApi", name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, event: "_Event") -> None:
        self.api.log.append(f"{self.name} waits {event.name}")


class _Event:
    def __init__(self, api: "_StreamApi") -> None:
        self.api, self.name, self.synced = api, f"e{len(api.events)}", 0
        api.events.append(self)

    def record(self, stream: "_Stream | None" = None) -> None:
        self.api.log.append(f"{self.name} on {(stream or self.api.current).name}")

    def synchronize(self) -> None:
        self.synced += 1


class _StreamApi:
    """The slice of ``torch.cuda`` the uploader uses, logging what is enqueued on which stream."""

    def __init__(self) -> None:
        self.log: List[str] = []
        self.events: List[_Event] = []
        self.made: List[_Stream] = []
        self.main = self.current = _Stream(self, "main")

    def Stream(self, device=None) -> _Stream:  # noqa: N802 - torch's name
        s = _Stream(self, f"side{len(self.made)}")
        self.made.append(s)
        return s

    def current_stream(self, device=None) -> _Stream:
        return self.current

    def stream(self, s: _Stream):
        api = self

        class _Ctx:
            def __enter__(self) -> None:
                api.prev, api.current = api.current, s
                api.log.append(f"enter {s.name}")

            def __exit__(self, *exc) -> None:
                api.current = api.prev
                api.log.append(f"exit {s.name}")

        return _Ctx()

    def Event(self) -> _Event:  # noqa: N802 - torch's name
        return _Event(self)


def test_mask_upload_on_a_side_stream_that_the_callers_stream_waits_for():
    """``side_stream``: the copy is enqueued inside the side stream's context, its event recorded there, and the
    caller's stream waits for that event after; one side stream per uploader and device; the next fence waits for
    the last copy."""
    api = _StreamApi()
    up = MaskUploader(side_stream=True, streams=lambda dev: api)
    host = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    out = up.upload(host, "cpu")
    assert torch.equal(out, host)
    assert api.log == ["enter side0", "e0 on side0", "exit side0", "main waits e0"]
    up.upload(host, torch.device("cpu"))
    assert len(api.made) == 1 and api.log[-1] == "main waits e1"  # the same side stream again
    assert (up.uploads, up.side_uploads) == (2, 2)
    up.fence()
    assert [e.synced for e in api.events] == [0, 1]  # only the last copy is waited for, once
    up.fence()
    assert [e.synced for e in api.events] == [0, 1]


def test_mask_upload_on_the_callers_stream_when_the_side_stream_is_off():
    api = _StreamApi()
    up = MaskUploader(side_stream=False, streams=lambda dev: api)
    up.upload(torch.zeros(2, 3, dtype=torch.int32), "cpu")
    assert api.log == ["e0 on main"] and api.made == [] and (up.uploads, up.side_uploads) == (1, 0)
    assert up.take_fence() is api.events[0] and up.take_fence() is None  # handed over once (to the grammar thread)


def test_a_cpu_mask_is_not_uploaded_and_needs_no_fence():
    up = MaskUploader(side_stream=True)  # the real stream lookup: the CPU has none
    host = torch.ones(2, 3, dtype=torch.int32)
    assert up.upload(host, "cpu") is host
    assert up.uploads == 0 and up.take_fence() is None


@pytest.mark.cuda
@pytest.mark.parametrize("side", [True, False])
def test_cuda_mask_upload_values_and_ordering(side):
    """On a GPU: the uploaded mask read on the caller's stream right after the upload equals the host mask. The copy
    is 256 MB (milliseconds), and the read is enqueued at once: on a side stream the caller's stream did not wait for,
    the read would run while the copy is still writing the device memory and see other values."""
    host = torch.randint(-2**31, 2**31 - 1, (16384, 4096), dtype=torch.int32).pin_memory()
    want = int(host.to(torch.int64).sum())
    up = MaskUploader(side_stream=side)
    dev = up.upload(host, "cuda")
    got = int(dev.to(torch.int64).sum())  # enqueued on the caller's stream, read back
    assert got == want
    assert up.side_uploads == (1 if side else 0) and up.uploads == 1
    up.fence()


@pytest.mark.parametrize("on_host", [0, 1, 2], ids=["next-token", "sibling", "draft"])
def test_one_host_tensor_among_device_ones_does_not_make_the_tree_a_host_tree(fake_device, on_host):
    """Only a tree whose three tensors all live on the host passes straight through; with any one of them on the
    device, the device ones are copied into host buffers and the copy's event is waited for."""
    src = list(_device_tree(seed=4))
    host_tensor = src[on_host] = _tree(seed=4)[on_host]
    pending = HostTreeCopier().start(*src)
    assert pending.event is fake_device.events[0] and not pending.resolved
    h = pending.resolve()
    assert h[on_host] is host_tensor
    for t, want in zip(h, _tree(seed=4)):
        assert type(t) is torch.Tensor and torch.equal(t, want)  # every one a host tensor with the tree's values


@pytest.mark.parametrize("sizes", [[(1, 1), (1, 2), (1, 3), (2, 2)], [(4, 8), (3, 11), (3, 10), (8, 8), (9, 8)]])
def test_host_buffers_are_the_smallest_power_of_two_that_holds_the_tree(fake_device, sizes):
    """A buffer holds the largest tree seen so far in the smallest power of two of elements (never twice as many as
    needed), and grows only when a tree outgrows it: a tree of 2**k elements fills its buffer exactly, one element
    more allocates again."""
    copier = HostTreeCopier(num_slots=1)
    largest, held, allocations = 0, 0, 0
    for bs, n in sizes:
        nxt = copier.start(*_device_tree(bs=bs, n=n)).resolve()[0]
        grew = bs * n > held  # only a tree the buffer cannot hold allocates (three tensors: three buffers)
        allocations += 3 if grew else 0
        largest = max(largest, bs * n)
        held = nxt.untyped_storage().nbytes() // nxt.element_size()
        assert largest <= held < 2 * largest and held & (held - 1) == 0, (bs, n, held)
        assert copier.pinned_allocations == allocations, (bs, n)


def test_the_side_stream_and_the_callers_stream_are_the_masks_devices():
    """With a stream per device, the side stream is made on the mask's device and the stream that waits for the copy
    is the caller's current stream on that device (not the current device's, which may be another GPU)."""
    asked: List[tuple] = []

    class PerDevice(_StreamApi):
        def Stream(self, device=None) -> _Stream:  # noqa: N802 - torch's name
            asked.append(("Stream", device))
            return super().Stream(device)

        def current_stream(self, device=None) -> _Stream:
            asked.append(("current_stream", device))
            return super().current_stream(device)

    up = MaskUploader(side_stream=True, streams=lambda dev: PerDevice())
    up.upload(torch.zeros(2, 3, dtype=torch.int32), "cpu")
    assert asked == [("Stream", torch.device("cpu")), ("current_stream", torch.device("cpu"))]
