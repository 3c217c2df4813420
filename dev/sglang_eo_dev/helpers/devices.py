"""Stand-ins for device objects on a host without a device, and the host results the ledger reads.

``CountingEvent`` stands for a device event (``torch.cuda.Event``): ``synchronize()`` returns at once and counts
itself; ``FlagEvent`` for one still in flight until waited for. ``DeviceTensor`` stands for a result tensor not yet
copied to the host: a non-host device, values readable only through ``tolist()``. ``result_runs`` builds a host
``ResultRuns`` holding given runs, as SGLang's verify (``ids[r * stride : r * stride + lens[r]]``) or prefill (one
token per row, no lengths) results lay them out; ``verify_result`` the installed SGLang's own
``GenerationBatchResult`` of a verify, laid out the same way. ``DecodeMode`` stands for a decode batch's
``forward_mode`` (what the bands' barriers ask of it).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["CountingEvent", "FlagEvent", "DecodeMode", "DeviceTensor", "result_runs", "verify_result"]


class CountingEvent:
    """``synchronize()`` returns at once and counts itself in ``waits``."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


class FlagEvent:
    """A device event that is never done by itself: ``query()`` says whether it is, ``synchronize()`` (a wait)
    completes it and counts itself in ``waits``. Tests use it where the code must read a copy only once its event
    has completed, and wait only when it has to."""

    def __init__(self) -> None:
        self.done = False
        self.waits = 0

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


class DecodeMode:
    """A decode batch's ``forward_mode``: decode, not extend, not idle."""

    def is_decode(self) -> bool:
        return True

    def is_extend(self) -> bool:
        return False

    def is_idle(self) -> bool:
        return False


class DeviceTensor:
    """A tensor on a device (``device.type`` "cuda") whose values ``tolist()`` still reads."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = list(values)
        self.device = type("Device", (), {"type": "cuda"})()

    def tolist(self) -> List[int]:
        return list(self.values)


def result_runs(runs: Sequence[Sequence[int]], stride: Optional[int] = None, *, prefill: bool = False,
                ready: Any = None) -> Any:
    """A host ``ResultRuns`` of ``runs``, one row each: decode rows at ``stride`` (default: the longest run), or,
    ``prefill``, each run's first token and no lengths. ``ready``: the host copy's event."""
    import torch

    from sglang_eagle_overlap.core.ledger import ResultRuns

    if prefill:
        return ResultRuns(torch.tensor([run[0] for run in runs] or [0], dtype=torch.int64), None, 1, ready)
    ids, lens, stride = _verify_layout(runs, stride)
    return ResultRuns(ids, lens, stride, ready)


def verify_result(runs: Sequence[Sequence[int]], stride: Optional[int] = None) -> Any:
    """The installed SGLang's ``GenerationBatchResult`` of a spec-v2 verify on the host whose row ``r`` accepted
    ``runs[r]``, at ``stride`` draft tokens per row (default: the longest run); its other fields keep SGLang's
    defaults (no host-copy event: already on the host)."""
    from sglang.srt.managers.utils import GenerationBatchResult

    ids, lens, stride = _verify_layout(runs, stride)
    return GenerationBatchResult(next_token_ids=ids, accept_lens=lens, speculative_num_draft_tokens=stride)


def _verify_layout(runs: Sequence[Sequence[int]], stride: Optional[int]) -> Tuple[Any, Any, int]:
    """``runs`` as a verify lays them out: ``ids[r * stride : r * stride + lens[r]]`` (int64 ids, int32 lengths, at
    least one row), and the stride used."""
    import torch

    stride = stride or max([1] + [len(run) for run in runs])
    ids = torch.zeros(max(1, len(runs)) * stride, dtype=torch.int64)
    lens = torch.zeros(max(1, len(runs)), dtype=torch.int32)
    for r, run in enumerate(runs):
        ids[r * stride : r * stride + len(run)] = torch.tensor(list(run), dtype=torch.int64)
        lens[r] = len(run)
    return ids, lens, stride
