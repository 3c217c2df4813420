"""``TreeMaskBuilder``'s native walk in its three parts (``prepare``, ``walk_native``, ``finish``), as
``GrammarStep`` drives them across two threads.

- The tree the native call is handed must be the one the build was prepared for: ``prepare`` sized the mask rows
  and the reset for ``[bs, n]``, and a tree of another shape would make the C++ walk read past its rows. The call is
  refused before anything is touched, with both shapes named, and the build still finishes in Python, exact.
- ``native_cpu_s`` is the calling thread's CPU time inside the native calls, summed over builds: the grammar thread's
  CPU time minus it bounds the GIL time it took from the scheduler thread, so a wrong sign or a reset between builds
  misreports that bound. The thread's CPU clock here is one only the test moves (the native call advances it), so the
  sums are exact, not timings.
- A walk the native call reports failed (its status, its error) is walked again in Python from the matcher it left
  where it found it: the mask stays exact, the natively walked neighbours keep their rows, one warning names the
  errors, and a host grammar walked after it still has the whole time limit.
- A builder that has the native module but does not take the native walk (an injected clock) feeds a ledger plan's
  waiting runs itself, before its Python walk.
"""

from __future__ import annotations

import dataclasses
import logging
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
from sglang_eo_dev.helpers.clocks import CpuClock
from sglang_eo_dev.helpers.native import WrongHandles, native
from sglang_eo_dev.helpers.tokenizers import EOS_ID
from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees
from tests.core.test_mask_failures import BrokenGrammar

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


def test_a_tree_of_another_shape_than_prepared_is_refused_and_the_build_finishes_in_python(caplog):
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

    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        builder.abandon_native(plan, err.value)  # as GrammarStep does with a refused call
    assert [r.getMessage() for r in caplog.records] == [
        f"sglang-eagle-overlap: native tree mask build failed (ValueError: the tree is (3, {N - 1}), the build was "
        f"prepared for [3, {N}]); rebuilding request by request"]
    got = builder.finish(plan, None, nxt, sib, tok)
    assert torch.equal(got.bitmask, want) and not got.failed and not got.timed_out


class _TimedModule:
    """The native module, its ``step_batch`` advancing the CPU clock as a call that costs ``per_call`` would."""

    def __init__(self, inner, clock: CpuClock) -> None:
        self._inner, self._clock = inner, clock

    def step_batch(self, *args):
        self._clock.tick()
        return self._inner.step_batch(*args)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_native_cpu_seconds_are_the_native_calls_cpu_time_summed_over_builds(monkeypatch):
    cpu = CpuClock(per_tick=0.25, now=100.0)
    # The builder reads both clocks through the ``time`` module; the wall clock stays the real one (the native walk
    # is taken only on the real clock).
    monkeypatch.setattr(mask_mod, "time", types.SimpleNamespace(perf_counter=time.perf_counter, thread_time=cpu))
    nat = dataclasses.replace(native(), module=_TimedModule(native().module, cpu))
    builder = TreeMaskBuilder(threads=1, native=nat)
    for seed in (1, 2, 3):
        ms, (nxt, sib, tok) = _batch(seed, k=3)
        builder.build([MaskRequest(matcher=m) for m in ms], nxt, sib, tok, VOCAB)
        assert builder.native_walks == seed == cpu.ticks
        assert builder.native_cpu_s == pytest.approx(0.25 * seed)


def test_walks_the_native_call_reports_failed_are_walked_again_in_python_within_the_time_limit(caplog):
    """Requests 1 and 3 fail inside the native call (its status WALK_FAILED, the error under kind "w"): ``finish``
    resets their rows, walks them again in Python from their intact matchers, and the mask is the Python walk's,
    request for request -- the natively walked requests 0 and 2 (each next to a failed one) keep their rows. One
    warning names both requests' errors. Request 4, a host grammar, is walked in Python against the time limit taken
    when ``finish`` starts (60 s: nothing times out)."""
    ms, (nxt, sib, tok) = _batch(11, k=5)
    reqs = [MaskRequest(matcher=m, request_id=f"r{i}") for i, m in enumerate(ms[:4])]
    # a host grammar object over the last matcher (walked in Python, never natively), whose fills never fail here
    reqs.append(MaskRequest(grammar=BrokenGrammar(ms[4], ok_fills=10**6), request_id="r4"))
    ref = TreeMaskBuilder(threads=1).build(reqs, nxt, sib, tok, VOCAB)
    want, want_valid = ref.bitmask.clone(), ref.valid_nodes
    assert bool((want[N:2 * N] != -1).any(dim=1)[1:].any()) and bool((want[3 * N:4 * N] != -1).any(dim=1)[1:].any())
    before = [G.next_token_bitmask(m, VOCAB) for m in ms]

    builder = TreeMaskBuilder(threads=1, native=WrongHandles([ms[1], ms[3]], VOCAB), time_limit_s=60.0)
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = builder.build(reqs, nxt, sib, tok, VOCAB)
    assert builder.native_walks == 1  # the native call ran (and reported the two walks failed)
    assert got.failed == [] and got.timed_out == []
    assert torch.equal(got.bitmask, want) and got.valid_nodes == want_valid
    assert all(torch.equal(G.next_token_bitmask(m, VOCAB), b) for m, b in zip(ms, before))
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(msgs) == 1, msgs
    head, tail = "sglang-eagle-overlap: native tree walk raised for 2 request(s) (", "); walking them again one by one"
    assert msgs[0].startswith(head) and msgs[0].endswith(tail), msgs[0]
    errors = msgs[0][len(head) : -len(tail)].split("; ")
    assert len(errors) == 2, errors
    assert all(e.startswith("Mismatched type") and e.endswith("CompiledGrammar`") for e in errors), errors


def test_a_build_the_native_walk_does_not_apply_to_feeds_the_waiting_runs_before_it_walks():
    """A builder that has the native module but an injected clock (the native walk runs on the real clock only)
    walks in Python, so it feeds the ledger plan's waiting runs itself, first: the mask is the one of the matchers
    advanced over their runs, and every run is fed once, whole."""
    from sglang_eagle_overlap.core import Run
    from sglang_eagle_overlap.core.ledger import AcceptLedger

    rng = random.Random(17)
    fresh, advanced, trees, runs = [], [], [], []
    for _ in range(3):
        doc = list(G.doc_tokens("regex", rng, VOCAB))
        p = rng.randrange(2, len(doc) - 4)
        fresh.append(G.matcher("regex", VOCAB))
        advanced.append(G.matcher("regex", VOCAB, doc[:p]))
        runs.append(doc[:p])
        trees.append(eagle_tree(rng, 4, 3, N, doc[p : p + 3], VOCAB, matcher=advanced[-1], extra_tokens=(EOS_ID,)))
    nxt, sib, tok = stack_trees(trees)
    want = TreeMaskBuilder(threads=1).build([MaskRequest(matcher=m) for m in advanced], nxt, sib, tok, VOCAB)

    led = AcceptLedger(native=native())
    plan = led.plan()
    plan.add([Run(f"r{i}", object(), m, 0, run) for i, (m, run) in enumerate(zip(fresh, runs))])
    assert len(plan) == 3  # all three wait for a native call
    builder = TreeMaskBuilder(threads=1, native=native(), clock=lambda: 0.0)
    got = builder.build([MaskRequest(matcher=m) for m in fresh], nxt, sib, tok, VOCAB, feeds=plan)
    assert builder.native_walks == 0
    assert torch.equal(got.bitmask, want.bitmask) and got.valid_nodes == want.valid_nodes
    assert [list(o.retained) for o in plan.out] == runs and led.tokens_fed == sum(map(len, runs))
