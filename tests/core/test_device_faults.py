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
from sglang_eagle_overlap.core import GrammarStep, MaskRequest, PendingTree
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


def test_a_device_error_chained_implicitly_is_still_found():
    """A device error that was being handled when a grammar error was raised (``__context__`` only, no ``from``), and
    one named as the cause of an error raised outside any handler (``__cause__`` only), are both device faults."""
    try:
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError:
            raise ValueError("while feeding the runs")  # noqa: B904 -- the implicit chain is the point
    except ValueError as outer:
        assert outer.__cause__ is None and outer.__context__ is not None
        assert is_device_fault(outer)
    caused = ValueError("after the event wait")
    caused.__cause__ = torch.AcceleratorError("unspecified launch failure")
    assert caused.__context__ is None and is_device_fault(caused)


def test_a_long_chain_of_grammar_errors_is_not_a_device_fault():
    """However deep the chain of grammar errors, none of them is a device error: not a device fault."""
    exc: BaseException = ValueError("token rejected")
    for i in range(20):
        nxt = KeyError(f"level {i}")
        nxt.__cause__ = exc
        exc = nxt
    assert not is_device_fault(exc)


def test_the_device_fault_names_the_device_error_and_how_to_locate_it(step):
    """The raised error says which error the device gave (its type and message: the log is all an operator has) and
    the environment variable that locates the failing kernel, spelt as CUDA reads it."""
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    job = start_job(step, RaisingEvent(error), None)
    with pytest.raises(DeviceFaultError) as got:
        step.finish_build(job, device="cpu")
    text = str(got.value)
    assert "(RuntimeError: CUDA error: an illegal memory access was encountered)" in text
    assert "CUDA_LAUNCH_BLOCKING=1" in text


def test_a_device_error_met_once_still_fails_the_step(step):
    """A device error of the grammar thread fails the step even when the wait would succeed if tried again: the step
    does not rebuild its masks in Python past a device error (a fault lasts; one that seems to pass is not trusted)."""
    job = start_job(step, RaisingEvent(RuntimeError("CUDA error: device-side assert triggered"), times=1), None)
    with pytest.raises(DeviceFaultError):
        step.finish_build(job, device="cpu")


def test_a_device_error_at_the_tree_wait_after_a_refused_native_call_fails_the_step(step):
    """The grammar thread's call fails on a grammar error (the previous result's event raises it, once), so the
    scheduler thread goes on in Python and waits for the tree itself: a device error there fails the step too."""
    ms = [G.matcher("nested", VOCAB) for _ in range(2)]
    docs = _docs(2)
    rows = [RowRun(f"r{i}", object(), ms[i], 0, i) for i in range(2)]
    runs = result_runs([d[:2] for d in docs], ready=RaisingEvent(ValueError("bad grammar state"), times=1))
    tree_error = RuntimeError("CUDA error: unspecified launch failure")
    host = step.copy_tree(*_tree(2)).host
    # the tree's copy event raises the device error (the thread never reached it: it stopped at the first event)
    tree = PendingTree(host=host, event=RaisingEvent(tree_error))
    job = step.start_build([MaskRequest(matcher=m) for m in ms], tree, vocab_size=VOCAB,
                           barrier=lambda: step.feed_later(rows, runs, None))
    assert job.future is not None
    with pytest.raises(DeviceFaultError) as got:
        step.finish_build(job, device="cpu")
    assert got.value.__cause__ is tree_error


def test_runs_left_unfed_by_a_device_fault_are_logged_with_their_error(step, caplog):
    """After a device fault, the runs queued for the step still wait on the failed event, so feeding them fails too:
    the step raises the fault (what the caller must see) and logs the feed's error at ERROR, by type and message."""
    job = start_job(step, RaisingEvent(RuntimeError("CUDA error: device-side assert triggered")), None)
    with caplog.at_level("ERROR", logger="sglang_eagle_overlap"):
        with pytest.raises(DeviceFaultError):
            step.finish_build(job, device="cpu")
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert "after the device fault" in errors[0]
    assert errors[0].endswith(": RuntimeError: CUDA error: device-side assert triggered"), errors[0]


def test_a_device_error_of_the_inline_native_walk_fails_the_step(monkeypatch):
    """Inline (no grammar thread): a device error raised by the native walk fails the step as on the thread path,
    while a grammar error there is walked again in Python (the same mask as the native walk's)."""
    s = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=False, native=native)
    try:
        ms = [G.matcher("nested", VOCAB) for _ in range(2)]
        want = s.build_mask([MaskRequest(matcher=m) for m in ms], s.copy_tree(*_tree(2)), vocab_size=VOCAB,
                            device="cpu").tree.bitmask.clone()
        for error, raised in ((ValueError("matcher raised"), None), (RuntimeError("CUDA error: misaligned address"),
                                                                     DeviceFaultError)):
            def walk(*args: Any, error: BaseException = error) -> Any:
                raise error

            monkeypatch.setattr(s.builder, "walk_native", walk)
            call = lambda: s.build_mask([MaskRequest(matcher=m) for m in ms], s.copy_tree(*_tree(2)),  # noqa: E731
                                        vocab_size=VOCAB, device="cpu")
            if raised is None:
                assert torch.equal(call().tree.bitmask, want)
            else:
                with pytest.raises(raised):
                    call()
    finally:
        s.close()


def test_every_caller_whose_outcome_callback_raises_is_counted(step):
    """Each waiting caller whose ``on_done`` raises is counted on the job (all are still told; the first error is
    raised after)."""
    docs = _docs(3)
    ms = [G.matcher("nested", VOCAB) for _ in docs]

    def fails(outcomes: Any) -> None:
        raise KeyError("the host's bookkeeping failed")

    def barrier() -> None:
        for i in range(3):
            step.feed_later([RowRun(f"r{i}", object(), ms[i], 0, 0)], result_runs([docs[i][:2]]),
                            fails if i != 1 else (lambda o: None))

    job = step.start_build([MaskRequest(matcher=m) for m in ms], step.copy_tree(*_tree(3)), vocab_size=VOCAB,
                           barrier=barrier)
    with pytest.raises(KeyError):
        step.finish_build(job, device="cpu")
    assert job.failed_callbacks == 2
