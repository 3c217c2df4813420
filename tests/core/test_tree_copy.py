"""HostTreeCopier: CPU passthrough and validation everywhere; pinned-buffer reuse and async copies on CUDA only
(gated by the ``cuda`` marker in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_eagle_overlap.core import HostTreeCopier, PendingTree


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
    assert h_nxt is nxt and h_sib is sib
    assert h_tok.shape == nxt.shape and h_tok.data_ptr() == tok.data_ptr()  # a view, not a copy
    assert copier.pinned_allocations == 0
    assert pending.resolve()[0] is nxt  # idempotent


@pytest.mark.parametrize(
    "shapes",
    [((3, 8), (3, 7), (24,)), ((3, 8), (3, 8), (23,)), ((2, 8), (3, 8), (24,))],
    ids=["sibling-shape", "draft-numel", "batch"],
)
def test_shape_validation(shapes):
    a, b, c = (torch.zeros(s, dtype=torch.int64) for s in shapes)
    with pytest.raises(ValueError, match="disagree in shape"):
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
        assert torch.equal(h[2], tok.cpu().view(nxt.shape))
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


class _Event:
    """Stands in for a device event: counts the waits."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_pending_tree_waits_on_its_event_once():
    host = _tree()
    ev = _Event()
    pending = PendingTree(host=host, event=ev)
    assert not pending.resolved and ev.waits == 0  # creating it waits for nothing
    assert pending.resolve() is host and ev.waits == 1 and pending.resolved
    assert pending.resolve() is host and ev.waits == 1  # resolved: no second wait
