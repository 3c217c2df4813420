"""What the 0.5.23 adapter tests share: a fresh, active plugin runtime per test, and stand-ins for SGLang's ``Req``
carrying only the fields the band reads (``rid``, ``grammar``, ``output_ids``, ``is_retracted``, ``finished()``,
``inflight_middle_chunks``, ``to_finish``).

A test module imports ``active_state`` (the fixture) and ``stand_in_req``; marking the module with
``pytest.mark.usefixtures("active_state")`` gives every test the fresh runtime whether or not it names it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import pytest

from sglang_eo_dev.helpers.grammars import ensure_sglang_importable


@pytest.fixture
def active_state() -> Iterator[Any]:
    """The plugin's runtime, created with default settings and marked active; reset before and after the test."""
    ensure_sglang_importable()
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.settings import Settings

    runtime.reset()
    rt = runtime.create(Settings())
    rt.active = True
    yield rt
    runtime.reset()


def stand_in_req(rid: str, grammar: Any, output_ids: Sequence[int] = (), finished: bool = False,
                 retracted: bool = False, chunks: int = 0) -> SimpleNamespace:
    """A request as the band sees it: ``output_ids`` committed so far, finished / retracted / mid-chunk as given."""
    return SimpleNamespace(rid=rid, grammar=grammar, output_ids=list(output_ids), is_retracted=retracted,
                           finished=lambda: finished, inflight_middle_chunks=chunks, to_finish=None)
