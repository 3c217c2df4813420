"""The shapes of the objects the core calls but does not own, as ``typing.Protocol`` classes (structural: any object
with these methods fits; nothing here is checked at run time, and this module imports nothing but ``typing``).

* :class:`ForwardProbe` -- ``GrammarStep(probe=...)``: told when the verify forward is launched and when the mask is
  ready; returns the grammar time the forward did not hide
  (:class:`~sglang_eagle_overlap.metrics.ForwardReadyProbe`). Call order per step: ``on_launch`` ->
  ``on_mask_start`` -> ``on_mask_ready``.
* :class:`StepExporter` -- ``GrammarStep(exporter=...)``: receives each step's numbers once, after the mask is ready
  (:class:`~sglang_eagle_overlap.metrics.PrometheusExporter`).
* :class:`DeviceEvent` -- a device runtime's event (what ``torch.get_device_module(device).Event()`` returns, e.g.
  ``torch.cuda.Event``) fencing a non-blocking copy: ``record()`` on the copying stream, ``synchronize()`` before
  the host reads or reuses the buffer.
* :class:`WalkMatcher` -- what the exact tree walk calls on a grammar: an ``xgrammar.GrammarMatcher``, or a host
  grammar object presented as one (``accept_token`` -> False on rejection).
* :class:`GuidanceMatcher` -- an ``llguidance.LLMatcher``, as the batched llguidance walk uses it: a row filled in
  place (GIL-free; a whole row of exactly its tokenizer's width), its error state (llguidance reports grammar errors
  through the matcher, never by raising) and its fast-forward tokens (grammar-forced drafts).
* :class:`JumpForward` -- what grammar-forced drafts ask of a matcher (an ``xgrammar.GrammarMatcher``): the text the
  grammar forces from its state; :class:`ForcingMatcher` adds a token tried and taken back (bonus keys).
* :data:`StatValue` -- one value of the stats snapshot (``StepTelemetry.snapshot``, the JSON stats file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Union

if TYPE_CHECKING:
    from torch.types import Device

__all__ = ["DeviceEvent", "ForcingMatcher", "ForwardProbe", "GuidanceMatcher", "JumpForward", "StatValue",
           "StepExporter", "WalkMatcher"]

StatValue = Union[int, float, str, bool, None]


class ForwardProbe(Protocol):
    def on_launch(self, device: Device = None) -> None:
        """Just before the target-verify launch (where the verify tree's host copy starts), on the launching
        thread."""

    def on_mask_start(self, device: Device = None, t: Optional[float] = None) -> None:
        """After the launch call returned, when the mask step starts (``t``: its ``perf_counter`` time)."""

    def on_mask_ready(self, t_ready: float) -> float:
        """The mask is handed to sampling at ``t_ready``; returns the un-hidden seconds that became known now."""


class StepExporter(Protocol):
    def observe_step(self, grammar_s: float, unhidden_s: float, timeouts: int, *, forced_proposed: int = 0,
                     forced_accepted: int = 0) -> None:
        """One verify step: grammar seconds, the part of them not hidden by the forward, mask time-limit hits, and
        the grammar-forced drafts proposed / accepted since the previous call."""


class DeviceEvent(Protocol):
    def record(self, stream: Any = None, /) -> None: ...

    def synchronize(self) -> None: ...


class WalkMatcher(Protocol):
    def accept_token(self, token_id: int, /) -> bool: ...

    def rollback(self, num_tokens: int, /) -> None: ...

    def is_terminated(self) -> bool: ...


class GuidanceMatcher(Protocol):
    def unsafe_compute_mask_ptr(self, trg_pointer: int, trg_byte_size: int, /) -> None: ...

    def is_error(self) -> bool: ...

    def get_error(self) -> str: ...

    def compute_ff_tokens(self) -> List[int]: ...


class JumpForward(Protocol):
    def find_jump_forward_string(self) -> str: ...


class ForcingMatcher(JumpForward, WalkMatcher, Protocol):
    """What the mask build's forced-draft recording asks of a matcher: its forced text, and one token tried and
    taken back (a bonus key)."""
