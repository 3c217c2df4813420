"""A device error met by the grammar thread fails the step loudly (``DeviceFaultError``) instead of the Python
rebuild that a grammar failure gets; every caller waiting on a step's runs is told even when one of them raises, and
that error is raised after (also for a step abandoned by its verify). The device error is injected through the
previous result's host-copy event, the first thing the grammar thread waits on."""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, List, Optional

import pytest
import torch

from sglang_eagle_overlap.core import RowRun
from sglang_eagle_overlap.core import GrammarStep, MaskRequest
from sglang_eagle_overlap.core.step import DeviceFaultError, is_device_fault
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.devices import result_runs
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.steps import make_step, was_fed

VOCAB = 512
N = 4


class RaisingEvent:
    """A host-copy event whose wait raises ``error`` (what a CUDA event's ``synchronize`` does on a device fault),
    every time or the first ``times`` times."""

    def __init__(self, error: BaseException, times: int = 1 << 30) -> None:
        self.error = error
        self.times = times

    def synchronize(self) -> None:
        if self.times > 0:
            self.times -= 1
            raise self.error


@pytest.fixture
def step() -> Iterator[GrammarStep]:
    """A step with the grammar thread and the native call (the path whose helper waits on the events)."""
    s = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=True, native=native)
    yield s
    s.close()


def _docs(k: int, seed: int = 7) -> List[List[int]]:
    rng = random.Random(seed)
    return [list(G.doc_tokens("nested", rng, VOCAB)) for _ in range(k)]


def _tree(bs: int):
    nxt = torch.tensor([[1, 2, 3, -1]] * bs, dtype=torch.int64)
    return nxt, torch.full((bs, N), -1, dtype=torch.int64), torch.zeros(bs, N, dtype=torch.int64)


def start_job(step: GrammarStep, ready: Any, on_done: Optional[Callable[[Any], None]], seed: int = 7,
              rid: str = "r") -> Any:
    """A grammar-thread job over two requests (``<rid>0``, ``<rid>1``, on chains of N nodes) whose previous result
    (runs of two tokens of :func:`_docs` ``(2, seed)``) waits on ``ready``; ``on_done`` is told their outcomes."""
    ms = [G.matcher("nested", VOCAB) for _ in range(2)]
    rows = [RowRun(f"{rid}{i}", object(), ms[i], 0, i) for i in range(2)]
    runs = result_runs([d[:2] for d in _docs(2, seed)], ready=ready)
    job = step.start_build([MaskRequest(matcher=m) for m in ms], step.copy_tree(*_tree(2)), vocab_size=VOCAB,
                           barrier=lambda: step.feed_later(rows, runs, on_done))
    assert job.future is not None  # the thread's path: the event is waited on there
    return job


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    torch.AcceleratorError("CUDA error: unspecified launch failure"),
])
def test_a_device_error_in_the_grammar_thread_fails_the_step(step, error):
    told: List[Any] = []
    job = start_job(step, RaisingEvent(error), told.append)
    with pytest.raises(DeviceFaultError, match="device failed") as got:
        step.finish_build(job, device="cpu")
    assert got.value.__cause__ is error
    # the queued runs' tokens are behind the failed event: not fed, never fed twice
    assert told == [] and step.ledger.tokens_fed == 0


def test_a_grammar_failure_in_the_grammar_thread_still_falls_back_to_python(step):
    told: List[Any] = []
    job = start_job(step, RaisingEvent(ValueError("bad grammar state"), times=1), told.append)
    out = step.finish_build(job, device="cpu")  # rebuilt request by request, no error raised
    assert out.tree.failed == [] and len(told) == 1 and step.ledger.tokens_fed == 4


def test_a_device_error_of_an_abandoned_step_is_raised_by_the_next_use(step):
    told: List[Any] = []
    start_job(step, RaisingEvent(RuntimeError("CUDA error: device-side assert triggered")), told.append)
    # the verify raised: no finish_build; the next ledger use settles the job
    with pytest.raises(DeviceFaultError):
        was_fed(step, "r0", 0)
    assert step.ledger.tokens_fed == 0 and step._open is None  # settled: the next use does not raise again
    assert not was_fed(step, "r0", 0)


@pytest.mark.parametrize("abandoned", [False, True])
def test_every_waiting_caller_is_told_when_one_raises_and_the_error_follows(step, abandoned):
    told: List[Any] = []
    docs = _docs(2)
    ms = [G.matcher("nested", VOCAB) for _ in docs]

    def first(outcomes: Any) -> None:
        told.append(("first", outcomes))
        raise KeyError("the host's bookkeeping failed")

    def barrier() -> None:
        step.feed_later([RowRun("r0", object(), ms[0], 0, 0)], result_runs([docs[0][:2]]), first)
        step.feed_later([RowRun("r1", object(), ms[1], 0, 0)], result_runs([docs[1][:2]]),
                           lambda o: told.append(("second", o)))

    job = step.start_build([MaskRequest(matcher=m) for m in ms], step.copy_tree(*_tree(2)), vocab_size=VOCAB,
                           barrier=barrier)
    with pytest.raises(KeyError, match="bookkeeping"):
        if abandoned:
            was_fed(step, "r0", 0)  # settles the job its verify left behind
        else:
            step.finish_build(job, device="cpu")
    assert [name for name, _ in told] == ["first", "second"]
    assert told[1][1][0].retained == tuple(docs[1][:2]) and step.ledger.tokens_fed == 4


def test_device_errors_are_told_from_grammar_errors():
    assert is_device_fault(RuntimeError("CUDA error: out of memory"))
    assert is_device_fault(torch.AcceleratorError("anything"))
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError as inner:
            raise ValueError("while waiting for the tree") from inner
    except ValueError as outer:
        assert is_device_fault(outer)  # found through the cause chain
    assert not is_device_fault(ValueError("token 17 rejected"))
    assert not is_device_fault(RuntimeError("native walk failed: w2: matcher raised"))
