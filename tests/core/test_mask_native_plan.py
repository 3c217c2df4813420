"""``TreeMaskBuilder``'s native walk in its three parts (``prepare``, ``walk_native``, ``finish``), as
``GrammarStep`` drives them across two threads.

- The tree the native call is handed must be the one the build was prepared for: ``prepare`` sized the mask rows
  and the reset for ``[bs, n]``, and a tree of another shape would make the C++ walk read past its rows. The call is
  refused before anything is touched, with both shapes named, and the build still finishes in Python, exact.
- ``native_cpu_s`` is the calling thread's CPU time inside the native calls, summed over builds: the grammar thread's
  CPU time minus it bounds the GIL time it took from the scheduler thread, so a wrong sign or a reset between builds
  misreports that bound. The thread's CPU clock here is one only the test moves (the native call advances it), so the
  sums are exact, not timings.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
import types

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core import mask as mask_mod
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.tokenizers import EOS_ID
from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

VOCAB = 32000
N = 8


def _batch(seed: int, k: int):
    rng = random.Random(seed)
    ms, trees = [], []
    for _ in range(k):
        g = rng.choice(["regex", "nested", "ebnf"])
        doc = list(G.doc_tokens(g, rng, VOCAB))
        p = rng.randrange(0, max(1, len(doc) - 6))
        m = G.matcher(g, VOCAB, doc[:p])
        ms.append(m)
        trees.append(eagle_tree(rng, 4, 3, N, doc[p : p + 3], VOCAB, matcher=m, extra_tokens=(EOS_ID,)))
    return ms, stack_trees(trees)


def test_a_tree_of_another_shape_than_prepared_is_refused_and_the_build_finishes_in_python():
    ms, (nxt, sib, tok) = _batch(5, k=3)
    reqs = [MaskRequest(matcher=m) for m in ms]
    want = TreeMaskBuilder(threads=1).build(reqs, nxt, sib, tok, VOCAB).bitmask.clone()
    before = [G.next_token_bitmask(m, VOCAB) for m in ms]

    builder = TreeMaskBuilder(threads=1, native=native())
    plan = builder.prepare(reqs, N, VOCAB)
    assert plan.handles is not None  # the native walk applies to this batch
    short = (nxt[:, : N - 1], sib[:, : N - 1], tok.view(3, N)[:, : N - 1])
    with pytest.raises(ValueError, match=re.escape(f"the tree is (3, {N - 1}), the build was prepared for [3, {N}]")) as err:
        builder.walk_native(plan, *short)
    assert builder.native_walks == 0
    assert all(torch.equal(G.next_token_bitmask(m, VOCAB), b) for m, b in zip(ms, before))  # nothing was fed/walked

    builder.abandon_native(plan, err.value)  # as GrammarStep does with a refused call
    got = builder.finish(plan, None, nxt, sib, tok)
    assert torch.equal(got.bitmask, want) and not got.failed and not got.timed_out


class _CpuClock:
    """A thread CPU clock that moves only when the native call runs (by ``per_call`` seconds)."""

    def __init__(self, start: float, per_call: float) -> None:
        self.now, self.per_call, self.calls = start, per_call, 0

    def __call__(self) -> float:
        return self.now


class _TimedModule:
    """The native module, its ``step_batch`` advancing the CPU clock as a call that costs ``per_call`` would."""

    def __init__(self, inner, clock: _CpuClock) -> None:
        self._inner, self._clock = inner, clock

    def step_batch(self, *args):
        self._clock.now += self._clock.per_call
        self._clock.calls += 1
        return self._inner.step_batch(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_native_cpu_seconds_are_the_native_calls_cpu_time_summed_over_builds(monkeypatch):
    cpu = _CpuClock(start=100.0, per_call=0.25)
    # The builder reads both clocks through the ``time`` module; the wall clock stays the real one (the native walk
    # is taken only on the real clock).
    monkeypatch.setattr(mask_mod, "time", types.SimpleNamespace(perf_counter=time.perf_counter, thread_time=cpu))
    nat = dataclasses.replace(native(), module=_TimedModule(native().module, cpu))
    builder = TreeMaskBuilder(threads=1, native=nat)
    for seed in (1, 2, 3):
        ms, (nxt, sib, tok) = _batch(seed, k=3)
        builder.build([MaskRequest(matcher=m) for m in ms], nxt, sib, tok, VOCAB)
        assert builder.native_walks == seed == cpu.calls
        assert builder.native_cpu_s == pytest.approx(0.25 * seed)
