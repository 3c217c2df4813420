"""The plugin's native module for tests and benchmarks: built once per process into the default cache (outside the
clone), the same way a worker loads it. A build failure raises: tests that need the module fail, never skip."""

from __future__ import annotations

import functools
from typing import Any, List, Sequence

from sglang_eagle_overlap.core.native import NativeGrammar, StepResult, load_native

__all__ = ["feed_runs", "native"]


@functools.lru_cache(maxsize=None)
def native() -> NativeGrammar:
    return load_native()


def feed_runs(nat: NativeGrammar, handles: Sequence[Any], runs: Sequence[Sequence[int]],
              live: Sequence[bool]) -> StepResult:
    """``nat.step_batch`` without a walk: ``runs[k]`` fed to ``handles[k]``'s matcher (``live[k]``: the caller's last
    run left it not terminated). ``StepResult.feeds`` holds ``retained, state`` per run, state one of ``FED``,
    ``TERMINATED``, ``REJECTED``, ``TERMINATED_BEFORE``, ``FEED_ERROR`` (its message in ``errors``; ``retained`` tokens
    were consumed before it) or ``NOT_FED`` (an earlier run of the same matcher failed)."""
    packed: List[int] = []
    for run, lv in zip(runs, live):
        packed += (1 if lv else 0, -1, len(run))
        packed.extend(run)
    return nat.step_batch(handles, packed, (), (), (), None, None, None, None, 0, None)
