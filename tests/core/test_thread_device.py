"""The grammar thread makes the scheduler thread's CUDA device its own before it waits on any event.

A new thread's current CUDA device is 0 whatever its parent's is, so without this a rank on GPU k would open a CUDA
context on GPU 0 from its grammar thread. No GPU here: a stand-in device API keeps a current device per thread the way
the CUDA runtime does (a new thread starts on 0), and the stand-in events note the device current on the thread that
waits on them."""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Tuple

from sglang_eagle_overlap.core import GrammarStep
from sglang_eo_dev.helpers.native import native
from tests.core.test_device_faults import start_job
from sglang_eo_dev.helpers.steps import make_step


class StandInDevices:
    """``current`` / ``set`` per thread; every thread but the one that made it starts on device 0."""

    def __init__(self, scheduler_device: int) -> None:
        self._current: Dict[int, int] = {threading.get_ident(): scheduler_device}
        self.sets: List[Tuple[int, int]] = []  # (thread id, device) per set call

    def current(self) -> Optional[int]:
        return self._current.get(threading.get_ident(), 0)

    def set(self, index: int) -> None:
        self.sets.append((threading.get_ident(), index))
        self._current[threading.get_ident()] = index


class NotingEvent:
    """A finished event that notes (thread id, that thread's current device) at each wait."""

    def __init__(self, devices: StandInDevices) -> None:
        self.devices = devices
        self.waits: List[Tuple[int, Optional[int]]] = []

    def synchronize(self) -> None:
        self.waits.append((threading.get_ident(), self.devices.current()))


def _job(step: GrammarStep, event: NotingEvent, seed: int) -> None:
    """One grammar-thread step whose previous result waits on ``event`` (requests of its own per seed)."""
    step.finish_build(start_job(step, event, None, seed=seed, rid=f"r{seed}."), device="cpu")


def test_the_grammar_thread_waits_on_events_on_the_scheduler_threads_device():
    devices = StandInDevices(scheduler_device=3)
    step = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=True, native=native, devices=devices)
    try:
        event = NotingEvent(devices)
        _job(step, event, seed=1)
        helper = [t for t, _ in event.waits if t != threading.get_ident()]
        assert helper, "the event was not waited on by the grammar thread"
        assert all(dev == 3 for t, dev in event.waits if t in helper)
        assert devices.sets == [(helper[0], 3)]  # set on the grammar thread, before its wait
        # the next job on the same device sets nothing again; a job from another device moves the thread
        _job(step, NotingEvent(devices), seed=2)
        assert len(devices.sets) == 1
        devices.set(5)  # the scheduler thread now on device 5 (its own set call, noted too)
        later = NotingEvent(devices)
        _job(step, later, seed=3)
        assert devices.sets[-1] == (helper[0], 5)
        assert [dev for t, dev in later.waits if t == helper[0]] == [5]
    finally:
        step.close()


def test_without_cuda_in_use_the_thread_sets_no_device():
    class NoCuda(StandInDevices):
        def current(self) -> Optional[int]:
            return None  # what CudaDevices answers while CUDA is not initialised

    devices = NoCuda(scheduler_device=0)
    step = make_step(mask_threads=1, mask_time_limit_s=None, grammar_thread=True, native=native, devices=devices)
    try:
        _job(step, NotingEvent(devices), seed=4)
        assert devices.sets == []
    finally:
        step.close()
