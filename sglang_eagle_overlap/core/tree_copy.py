"""The verify step's two transfers: the EAGLE verify tree's asynchronous host copy (:class:`HostTreeCopier`) and the
tree mask's upload (:class:`MaskUploader`).

Call order (one verify step)::

    pending = copier.start(retrieve_next_token, retrieve_next_sibling, draft_tokens)   # before the verify launch
    ... target-verify forward is launched ...
    uploader.fence()                                       # before the build writes the mask's host buffer
    next_token, next_sibling, draft = pending.resolve()                                  # when the mask is built
    ... the mask is built into the host buffer ...
    device_mask = uploader.upload(host_mask, device)                                     # before sampling

Invariants:

* Pinned host buffers are one per (slot, tensor, dtype), sized in powers of two of elements, and reused: a new batch
  size allocates only when it outgrows its buffer (then the buffer doubles at least), so the pinned memory held is at
  most twice the largest tree's and the allocations stop after warm-up. Two slots alternate so that step N+1's copy
  can be launched while step N's host tensors are still being read (the overlap scheduler may launch N+1 before N's
  mask has been consumed by every reader).
* ``start`` enqueues non-blocking device-to-host copies on the current stream and records one event; ``resolve``
  waits on that event only (not on the whole device).
* Tensors already on the CPU pass straight through: no copy, no event, no reshape (the draft tokens keep their shape,
  flat ``[bs * n]`` or ``[bs, n]``, on the host as on the device).
* The mask's upload ends with an event; :meth:`MaskUploader.fence` waits for the previous upload before the host
  buffer it read is written again. With ``side_stream`` the copy runs on a stream of its own and the caller's stream
  waits for its event (see :class:`MaskUploader`).

This module imports torch only; it knows nothing of SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from sglang_eagle_overlap.core.protocols import DeviceEvent

__all__ = ["HostTreeCopier", "MaskUploader", "PendingTree", "device_streams", "host_to_device", "pinned_host"]

Tree = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_MAX_VIEWS = 48  # per slot: three tensors times the batch shapes of a steady load


def pinned_host(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Page-locked host memory (only called for a copy to a device, so a device runtime is present)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def host_to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A copy of ``host`` on ``dev`` that does not block the calling thread, ordered on the current stream. From
    pageable memory a CUDA copy is synchronous whatever ``non_blocking`` says, so the data is staged in pinned memory
    first. The staging tensor is dropped at once: PyTorch's pinned-memory cache records the copy's stream and hands the
    block out again only after that stream passed the copy, so a later call cannot overwrite it in flight. On the CPU:
    a clone (the caller may reuse ``host``)."""
    if dev.type == "cpu":
        return host.clone()
    staged = pinned_host(tuple(host.shape), host.dtype)
    staged.copy_(host)
    return staged.to(dev, non_blocking=True)


@dataclass(slots=True)
class PendingTree:
    """A verify tree whose host copy may still be in flight. ``resolve()`` is the only wait."""

    host: Tree
    event: Optional[DeviceEvent] = None
    resolved: bool = False

    def resolve(self) -> Tree:
        if not self.resolved:
            if self.event is not None:
                self.event.synchronize()
            self.resolved = True
        return self.host


@dataclass
class HostTreeCopier:
    """Owns the reusable pinned buffers for the verify-tree host copy (one per worker)."""

    num_slots: int = 2
    # per slot: the flat buffer of each (tensor index, dtype), and the views of it handed out per shape
    _buffers: List[Dict[Tuple[int, torch.dtype], torch.Tensor]] = field(default_factory=list)
    _views: List[Dict[Tuple[int, Tuple[int, ...], torch.dtype], torch.Tensor]] = field(default_factory=list)
    _slot: int = 0
    pinned_allocations: int = 0  # observable: grows only when a tree outgrows its buffer (log2 of the largest size)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        self._buffers = [{} for _ in range(self.num_slots)]
        self._views = [{} for _ in range(self.num_slots)]

    def _host_buffer(self, slot: int, index: int, src: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``src``'s shape and dtype: a view of the slot's one buffer for (``index``, dtype), made
        once per shape (the views are few and cheap, dropped when the buffer grows or they pass ``_MAX_VIEWS``)."""
        shape = tuple(src.shape)
        views = self._views[slot]
        view = views.get((index, shape, src.dtype))
        if view is not None:
            return view
        need = src.numel()
        buf = self._buffers[slot].get((index, src.dtype))
        if buf is None or buf.numel() < need:
            capacity = 1 << max(need - 1, 0).bit_length()  # the power of two >= need
            # Pinning needs a device runtime; without one (CPU-only torch) a plain buffer is the honest fallback.
            pin = torch.cuda.is_available() if src.device.type == "cuda" else False
            buf = self._buffers[slot][(index, src.dtype)] = torch.empty(capacity, dtype=src.dtype, pin_memory=pin)
            self.pinned_allocations += 1
            views.clear()  # views of the old buffer; their in-flight readers keep it alive themselves
        if len(views) >= _MAX_VIEWS:
            views.clear()
        view = views[(index, shape, src.dtype)] = buf[:need].view(shape)
        return view

    def start(
        self,
        retrieve_next_token: torch.Tensor,
        retrieve_next_sibling: torch.Tensor,
        draft_tokens: torch.Tensor,
    ) -> PendingTree:
        """Launch the copy. Call before the target-verify forward is launched, on the stream that produced the tree."""
        tensors = (retrieve_next_token, retrieve_next_sibling, draft_tokens)
        if retrieve_next_token.shape != retrieve_next_sibling.shape or retrieve_next_token.numel() != draft_tokens.numel():
            raise ValueError(
                "verify tree tensors disagree in shape: retrieve_next_token "
                f"{tuple(retrieve_next_token.shape)}, retrieve_next_sibling {tuple(retrieve_next_sibling.shape)}, "
                f"draft_tokens {tuple(draft_tokens.shape)}"
            )
        # The draft tokens keep their own shape (flat ``[bs * n]`` or ``[bs, n]``: every reader takes either), so a
        # host tree passes with no torch call but these checks (``is_cpu``: one flag read, no device object made)
        if retrieve_next_token.is_cpu and retrieve_next_sibling.is_cpu and draft_tokens.is_cpu:
            return PendingTree(host=tensors, event=None, resolved=True)
        device = next(t.device for t in tensors if not t.is_cpu)
        slot = self._slot
        self._slot = (self._slot + 1) % self.num_slots
        host = []
        for i, t in enumerate(tensors):
            if t.is_cpu:
                host.append(t)
                continue
            buf = self._host_buffer(slot, i, t)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        module = torch.get_device_module(device)
        event = module.Event()
        event.record()
        return PendingTree(host=(host[0], host[1], host[2]), event=event)


def device_streams(device: torch.device) -> Any:
    """The stream API of ``device`` (``torch.cuda`` and the like: ``Stream``, ``stream``, ``current_stream``,
    ``Event``), or None for the CPU, whose tensors need no upload."""
    return None if device.type == "cpu" else torch.get_device_module(device)


@dataclass
class MaskUploader:
    """The tree mask's host-to-device copy (one per worker), and the fence before its host buffer is reused.

    ``side_stream`` False: the copy is enqueued on the caller's current stream, behind the target verify launched
    there, so on a GPU it starts only when the verify ends and the sampling waits for it: serial GPU work after the
    verify. True: the copy is enqueued on a stream of its own (made once per device), which does not wait for
    the caller's stream, so it runs while the verify still runs; the caller's stream waits for the copy's event before
    anything it enqueues next (the sampling), and the device tensor is marked as used by the caller's stream
    (``record_stream``), so the caching allocator does not hand its memory back to the side stream while the sampling
    may still read it. The host buffer needs nothing from the device, so the side stream orders nothing before it.

    ``streams``: the stream API of a device (:func:`device_streams`; tests pass a stand-in)."""

    side_stream: bool = False
    streams: Callable[[torch.device], Any] = device_streams
    uploads: int = 0  # observable: device uploads made
    side_uploads: int = 0  # observable: of those, on the side stream
    _event: Optional[DeviceEvent] = None
    _side: Dict[Any, Any] = field(default_factory=dict)

    def fence(self) -> None:
        """Wait for the previous upload's copy (normally long done) before the host buffer it read is written."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def take_fence(self) -> Optional[DeviceEvent]:
        """The previous upload's event, handed to whoever writes the host buffer next (the grammar thread's job waits
        on it there); this uploader no longer holds it."""
        event, self._event = self._event, None
        return event

    def upload(self, host: torch.Tensor, device: Any) -> torch.Tensor:
        """``host`` on ``device`` (on the CPU: ``host`` itself, no copy). Call after the target-verify launch, on the
        stream that will sample with the mask; the next :meth:`fence` waits for this copy."""
        dev = device if isinstance(device, torch.device) else torch.device(device)
        api = self.streams(dev)
        if api is None:
            return host.to(dev, non_blocking=True)
        self.uploads += 1
        if not self.side_stream:
            out = host.to(dev, non_blocking=True)
            self._event = api.Event()
            self._event.record()
            return out
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = api.Stream(device=dev)
        caller = api.current_stream(dev)
        with api.stream(side):
            out = host.to(dev, non_blocking=True)
            event = api.Event()
            event.record(side)
        caller.wait_event(event)
        if not out.is_cpu:  # always, with a device's own stream API; a stand-in API (tests) copies to the CPU
            out.record_stream(caller)
        self._event = event
        self.side_uploads += 1
        return out
