"""The plugin's native module for tests and benchmarks: built once per process into the default cache (outside the
clone), the same way a worker loads it. A build failure raises: tests that need the module fail, never skip."""

from __future__ import annotations

import functools
from typing import Any, List, Sequence

from sglang_eagle_overlap.core.native import NativeGrammar, StepResult, load_native

__all__ = ["WrongHandles", "feed_runs", "native"]


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


class WrongHandles:
    """The native module, except that each matcher of ``bad`` hands it the handle of another xgrammar type (a compiled
    grammar, one per matcher: the call refuses a handle given for two rows): C++ fails on its first call of that
    matcher, as a matcher that raises inside the native call, while the Python object stays intact."""

    def __init__(self, bad: Sequence[Any], vocab_size: int) -> None:
        from sglang_eo_dev.helpers import grammars as G

        self._nat = native()
        self._wrong = {id(m): G.compiled(g, vocab_size)._handle for m, g in zip(bad, ("regex", "ebnf", "nested"))}

    def handle(self, matcher: Any) -> Any:
        return self._wrong.get(id(matcher)) or self._nat.handle(matcher)

    def handles(self, matchers: Sequence[Any]) -> Any:
        got = self._nat.handles(matchers)
        return None if got is None else [self._wrong.get(id(m), h) for m, h in zip(matchers, got)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nat, name)
