"""llguidance rows of the tree mask (``MaskRequest.guidance``): the batched lockstep walk vs SGLang's own
``generate_token_bitmask`` over real ``GuidanceGrammar`` objects (the installed SGLang of this venv).

Each scenario builds one batch twice, at the same grammar states: SGLang's grammars for upstream's mask, a second set
mapped through the plugin's ``mask_request_for`` (which hands the bare ``LLMatcher`` beside the grammar). The masks
must be bit-identical with one fill thread and with llguidance's thread pool, the batched walk must be the one that
ran, and every grammar must be back in its entry state. A grammar that breaks the batched fill fails alone; a build
over its time limit keeps exact roots.
"""

from __future__ import annotations

import logging
import random
import zlib
from types import SimpleNamespace
from typing import Any, Callable, List, Tuple

import pytest
import torch

from sglang_eagle_overlap.core.mask import MaskRequest, TreeMaskBuilder, bitmask_width
from sglang_eagle_overlap.integration.requests import mask_request_for
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.clocks import CpuClock
from sglang_eo_dev.helpers.tokenizers import EOS_ID, hf_tokenizer
from sglang_eo_dev.helpers.trees import Tree, eagle_tree, stack_trees

from .test_mask_equivalence import upstream_mask

VOCAB = 32000
SHAPES = [(1, 3, 4), (4, 3, 8), (8, 5, 41)]


def _doc(grammar: str, rng: random.Random, strict: bool) -> Tuple[int, ...]:
    """A valid document of ``grammar``; with ``strict``, a one-line one (a strict grammar takes no other)."""
    doc = G.doc_tokens(grammar, rng, VOCAB)
    while strict and "\n" in hf_tokenizer(VOCAB).decode(list(doc)):
        doc = G.doc_tokens(grammar, rng, VOCAB)
    return doc


class Batch:
    """``bs`` requests of ``grammar`` at random points of a valid document (a third near its end, so EOS and
    terminating nodes occur in trees), every ``free_every``-th one unconstrained; ``strict``: JSON without flexible
    whitespace (:func:`~sglang_eo_dev.helpers.grammars.guidance_source`)."""

    def __init__(self, grammar: str, topk: int, steps: int, n: int, bs: int, seed: int, free_every: int = 4,
                 strict: bool = False):
        rng = random.Random(seed)
        self.up: List[Any] = []
        self.ours: List[Any] = []
        trees: List[Tree] = []
        for i in range(bs):
            doc = _doc(grammar, rng, strict)
            pos = max(0, len(doc) - rng.randint(1, steps + 1)) if rng.random() < 0.3 else rng.randrange(len(doc))
            prefix, truth = list(doc[:pos]), list(doc[pos:])
            if free_every and i % free_every == free_every - 1:
                trees.append(eagle_tree(rng, topk, steps, n, truth, VOCAB))
                self.up.append(SimpleNamespace(grammar=None))
                self.ours.append(SimpleNamespace(grammar=None, rid=f"r{i}", finished=lambda: False))
                continue
            # side branches drawn from what the grammar allows (xgrammar's view of the same language)
            trees.append(eagle_tree(rng, topk, steps, n, truth, VOCAB, matcher=G.matcher(grammar, VOCAB, prefix),
                                    extra_tokens=(EOS_ID,)))
            self.up.append(SimpleNamespace(grammar=G.guidance_grammar(grammar, VOCAB, prefix, strict)))
            self.ours.append(SimpleNamespace(grammar=G.guidance_grammar(grammar, VOCAB, prefix, strict), rid=f"r{i}",
                                             finished=lambda: False))
        self.n = n
        self.nxt, self.sib, self.tok = stack_trees(trees)

    def rows(self) -> List[MaskRequest]:
        return [mask_request_for(r) for r in self.ours]

    def states(self) -> List[Any]:
        """Each grammar's state: its next-token mask and its termination flag."""
        return [(bytes(r.grammar.ll_matcher.compute_bitmask()), r.grammar.finished)
                for r in self.ours if r.grammar is not None]


def _builder(threads: int, **kw: Any) -> TreeMaskBuilder:
    return TreeMaskBuilder(threads=threads, **kw)


@pytest.mark.parametrize("grammar", ["nested", "nested-strict", "pattern", "regex"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{t}-steps{s}-n{n}" for t, s, n in SHAPES])
def test_batched_guidance_walk_is_sglangs_mask(grammar, shape):
    topk, steps, n = shape
    name, strict = grammar.split("-")[0], grammar.endswith("-strict")
    batch = Batch(name, topk, steps, n, bs=6, seed=zlib.crc32(f"{grammar}{shape}".encode()) & 0xFFFF, strict=strict)
    want = upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB)
    assert want is not None
    rows = batch.rows()
    assert all(r.guidance is r_src.grammar.ll_matcher for r, r_src in zip(rows, batch.ours) if r_src.grammar)
    for threads in (1, 2):
        before = batch.states()
        builder = _builder(threads)
        got = builder.build(rows, batch.nxt, batch.sib, batch.tok, VOCAB)
        assert not got.failed and not got.timed_out
        assert builder.guidance_walks == 1, "the llguidance rows did not take the batched walk"
        assert got.guidance_walked is True  # what the step counts as a guidance step
        assert torch.equal(got.bitmask, want), (grammar, shape, threads)
        assert batch.states() == before, "a grammar was left in another state than it entered with"
    # the scenario reaches past the roots: some non-root node of a constrained request has a filled row
    filled = (want != -1).any(dim=1).view(-1, n)
    assert bool(filled[:, 1:].any()), "no non-root row was filled: the walk was not exercised"


def test_guidance_rows_reused_buffer_resets_rows_the_walk_does_not_reach():
    """Two builds on one builder: the second batch's unreached rows read all-allowed whatever the first wrote."""
    builder = _builder(2)
    first = Batch("nested", 4, 3, 8, bs=6, seed=1, free_every=0)
    builder.build(first.rows(), first.nxt, first.sib, first.tok, VOCAB)
    second = Batch("regex", 4, 3, 8, bs=6, seed=2)
    got = builder.build(second.rows(), second.nxt, second.sib, second.tok, VOCAB)
    assert torch.equal(got.bitmask, upstream_mask(second.up, second.nxt, second.sib, second.tok, VOCAB))


class _BrokenMatcher:
    """An llguidance matcher whose fills raise (what the batched walk hands to llguidance)."""

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        raise RuntimeError("injected llguidance fill fault")

    def is_error(self) -> bool:
        return False

    def get_error(self) -> str:
        return ""


class _BrokenGrammar:
    """The host grammar of that matcher: accepts and rolls back like the real one, fails when asked for a row."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def accept_token(self, token: int) -> Any:
        return self.inner.accept_token(token)

    def rollback(self, k: int) -> None:
        self.inner.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self.inner.is_terminated())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        raise RuntimeError("injected grammar fault")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_grammar_that_breaks_the_batched_fill_fails_alone(threads):
    batch = Batch("nested", 4, 3, 8, bs=5, seed=3, free_every=0)
    want = upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB)
    rows = batch.rows()
    bad = 2
    rows[bad] = MaskRequest(None, _BrokenGrammar(batch.ours[bad].grammar), rows[bad].request_id, _BrokenMatcher())
    before = batch.states()
    builder = _builder(threads)
    got = builder.build(rows, batch.nxt, batch.sib, batch.tok, VOCAB)
    assert [i for i, _ in got.failed] == [bad] and "injected grammar fault" in got.failed[0][1]
    n = batch.n
    assert bool((got.bitmask[bad * n : (bad + 1) * n] == -1).all()), "the failed request's rows must be all-allowed"
    for i in range(5):
        if i != bad:
            assert torch.equal(got.bitmask[i * n : (i + 1) * n], want[i * n : (i + 1) * n]), i
    assert builder.guidance_walks == 0  # the batched walk stopped; every row was walked one by one
    assert batch.states() == before


def test_time_limit_keeps_exact_roots_and_leaves_the_rest_all_allowed():
    batch = Batch("nested", 4, 3, 8, bs=4, seed=4, free_every=0)
    want = upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB)
    ticks = iter(range(1000))
    builder = _builder(1, time_limit_s=0.5, clock=lambda: float(next(ticks)))  # every clock read is a second later
    before = batch.states()
    got = builder.build(batch.rows(), batch.nxt, batch.sib, batch.tok, VOCAB)
    n = batch.n
    walked = [i for i in range(4) if (want[i * n + 1 : (i + 1) * n] != -1).any()]
    assert walked, "no request had a row past its root to drop"
    assert sorted(got.timed_out) == walked  # those that had more to fill ran out of time
    assert builder.guidance_walks == 1  # the batched walk itself timed them out: no request-by-request fallback
    for i in range(4):
        assert torch.equal(got.bitmask[i * n], want[i * n]), f"request {i}: root row not exact"
        assert bool((got.bitmask[i * n + 1 : (i + 1) * n] == -1).all()), f"request {i}: rows past the root"
    assert batch.states() == before


def test_a_walk_within_its_time_limit_fills_every_row_and_each_build_counts():
    """A clock that does not move: the limit is never reached, every row is SGLang's; a second build with the same
    builder is the second batched walk."""
    batch = Batch("nested", 4, 3, 8, bs=4, seed=4, free_every=0)
    want = upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB)
    builder = _builder(1, time_limit_s=0.5, clock=lambda: 100.0)
    for walks in (1, 2):
        got = builder.build(batch.rows(), batch.nxt, batch.sib, batch.tok, VOCAB)
        assert not got.timed_out and not got.failed and torch.equal(got.bitmask, want)
        assert builder.guidance_walks == walks


class _ErrorStateMatcher:
    """A real llguidance matcher that reports llguidance's error state after its fills (llguidance signals grammar
    errors that way, never by raising)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.inner.unsafe_compute_mask_ptr(ptr, size)

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "injected parser error"


def test_a_matcher_left_in_llguidances_error_state_stops_the_batched_walk(caplog):
    batch = Batch("nested", 4, 3, 8, bs=4, seed=5, free_every=0)
    want = upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB)
    rows = batch.rows()
    bad = 1
    inner = batch.ours[bad].grammar
    rows[bad] = MaskRequest(None, _BrokenGrammar(inner), rows[bad].request_id, _ErrorStateMatcher(inner.ll_matcher))
    builder = _builder(1)
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = builder.build(rows, batch.nxt, batch.sib, batch.tok, VOCAB)
    assert builder.guidance_walks == 0, "a fill that left its matcher in error must not pass as a mask row"
    assert ("batched llguidance tree walk failed (ValueError: llguidance matcher error: injected parser error)"
            in caplog.records[0].getMessage())  # llguidance's own error text, as its matcher reported it
    assert [i for i, _ in got.failed] == [bad]
    n = batch.n
    for i in range(4):
        if i != bad:
            assert torch.equal(got.bitmask[i * n : (i + 1) * n], want[i * n : (i + 1) * n]), i


def _open_nodes(grammar: Any, tree_nxt: List[int], tree_sib: List[int], tree_tok: List[int]) -> dict:
    """Independent reference: node -> llguidance's fast-forward tokens after its path, for every valid node whose
    grammar is not terminated (the rows the build fills), walked recursively through the grammar's own API."""
    out = {}
    ll = grammar.ll_matcher

    def allowed(t: int) -> bool:
        bits = ll.compute_bitmask()
        return 0 <= t < VOCAB and bool((bits[t // 8] >> (t % 8)) & 1)

    def visit(node: int) -> None:
        while node >= 0:
            t = tree_tok[node]
            if allowed(t):
                grammar.accept_token(t)
                if not grammar.is_terminated():
                    out[node] = list(ll.compute_ff_tokens())
                    visit(tree_nxt[node])
                grammar.rollback(1)
            node = tree_sib[node]

    if not grammar.is_terminated():
        out[0] = list(ll.compute_ff_tokens())
        visit(tree_nxt[0])
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_forced_drafts_of_llguidance_rows_are_its_fast_forward_tokens(threads):
    from sglang_eagle_overlap.core.forced import ForcedDrafts

    batch = Batch("nested", 4, 3, 8, bs=5, seed=6, strict=True)  # keys and punctuation forced
    forced = ForcedDrafts(width=6)
    got = _builder(threads).build(batch.rows(), batch.nxt, batch.sib, batch.tok, VOCAB, forced=forced)
    assert not got.failed
    n, table = batch.n, forced._host
    recorded = 0
    for i, r in enumerate(batch.up):
        rows = table[i * n : (i + 1) * n, 0, :, 0]
        if r.grammar is None:
            assert (rows == -1).all()
            continue
        want = _open_nodes(r.grammar, batch.nxt[i].tolist(), batch.sib[i].tolist(), batch.tok[i].tolist())
        for node in range(n):
            ff = want.get(node, [])[:6]
            assert rows[node, : len(ff)].tolist() == ff and (rows[node, len(ff) :] == -1).all(), (i, node, ff)
            recorded += bool(ff)
    assert recorded > 0, "no node had a forced continuation: the table was not exercised"
    assert forced.recorded_nodes == recorded


def _mixed(seed: int, grammar: str = "regex", strict: bool = False, xgrammar: str = ""):
    """Rows of every walk in one batch: four llguidance rows (the batched llguidance walk), two plain xgrammar
    matchers (the xgrammar lockstep walk) and one llguidance grammar handed without its matcher (a host grammar:
    walked request by request), each at a point of a valid document of ``grammar`` (of ``xgrammar`` for the xgrammar
    rows, if given) with rows past its root. Returns the rows, the tree and the index lists of the three kinds."""
    batch = Batch(grammar, 4, 3, 8, bs=4, seed=seed, free_every=0, strict=strict)
    rng = random.Random(seed)
    rows = batch.rows()
    trees: List[Tree] = []
    for kind in ("xgrammar", "xgrammar", "host"):
        g = xgrammar if kind == "xgrammar" and xgrammar else grammar
        doc = _doc(g, rng, strict)
        pos = rng.randrange(0, len(doc) - 3)
        prefix, truth = list(doc[:pos]), list(doc[pos:])
        trees.append(eagle_tree(rng, 4, 3, 8, truth, VOCAB, matcher=G.matcher(g, VOCAB, prefix),
                                extra_tokens=(EOS_ID,)))
        if kind == "xgrammar":
            rows.append(MaskRequest(matcher=G.matcher(g, VOCAB, prefix), request_id=f"x{len(rows)}"))
        else:
            rows.append(MaskRequest(grammar=G.guidance_grammar(grammar, VOCAB, prefix, strict), request_id="host"))
    nxt, sib, tok = stack_trees(trees)
    tree = (torch.cat([batch.nxt, nxt]), torch.cat([batch.sib, sib]), torch.cat([batch.tok, tok]))
    return rows, tree, {"guidance": [0, 1, 2, 3], "xgrammar": [4, 5], "host": [6]}


def test_every_walk_of_one_build_adds_its_valid_nodes_and_the_host_grammar_gets_the_time_limit():
    """One build takes the xgrammar lockstep walk, then the batched llguidance walk, then the host grammar's walk.
    On a clock that does not move (the limit never reached) the mask is, row for row, what each kind's own build
    gives and the valid nodes are the sum of the three walks'. On a clock that moves a second per read (limit 0.5 s),
    the host grammar's walk, which starts after the llguidance walk, still runs against the limit: it keeps its exact
    root and times out."""
    rows, (nxt, sib, tok), kinds = _mixed(21)
    n = 8
    want = torch.full((len(rows) * n, bitmask_width(VOCAB)), -1, dtype=torch.int32)
    want_valid = {}
    for kind, idx in kinds.items():
        part = _builder(1).build([rows[i] for i in idx], nxt[idx], sib[idx], tok[idx], VOCAB)
        assert not part.failed and not part.timed_out
        want_valid[kind] = part.valid_nodes
        for j, i in enumerate(idx):
            want[i * n : (i + 1) * n] = part.bitmask[j * n : (j + 1) * n]
    assert all(want_valid[k] > 1 for k in kinds), want_valid  # each kind walked past its roots

    builder = _builder(1, time_limit_s=0.5, clock=lambda: 100.0)
    got = builder.build(rows, nxt, sib, tok, VOCAB)
    assert not got.failed and not got.timed_out and got.guidance_walked
    assert torch.equal(got.bitmask, want)
    assert got.valid_nodes == sum(want_valid.values())

    ticks = iter(range(1000))
    builder = _builder(1, time_limit_s=0.5, clock=lambda: float(next(ticks)))
    got = builder.build(rows, nxt, sib, tok, VOCAB)
    host = kinds["host"][0]
    assert host in got.timed_out and not got.failed
    assert torch.equal(got.bitmask[host * n], want[host * n])
    assert bool((got.bitmask[host * n + 1 : (host + 1) * n] == -1).all())


class _TimedBatchFills:
    """xgrammar's batch matcher, each batched fill moving the CPU clock."""

    def __init__(self, inner: Any, cpu: CpuClock) -> None:
        self.inner, self.cpu = inner, cpu

    def batch_fill_next_token_bitmask(self, *args: Any) -> Any:
        self.cpu.tick()
        return self.inner.batch_fill_next_token_bitmask(*args)


class _OnFill:
    """An llguidance matcher that calls ``before`` before each of its fills (which may raise instead)."""

    def __init__(self, inner: Any, before: Callable[[], None]) -> None:
        self.inner, self.before = inner, before

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        self.before()
        self.inner.unsafe_compute_mask_ptr(ptr, size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_native_cpu_seconds_sum_the_gil_free_fills_of_both_walks_over_builds(monkeypatch):
    """``native_cpu_s`` is the calling thread's CPU time inside the GIL-free fills -- xgrammar's batched fills and
    llguidance's -- summed over builds. The thread's CPU clock here moves only inside those fills (a quarter second
    each), so the sum is exact: fills x 0.25 s; the host grammar's own fills (Python, under the GIL) add nothing."""
    import types
    import time as time_mod

    import xgrammar

    from sglang_eagle_overlap.core import mask as mask_mod

    cpu = CpuClock(per_tick=0.25)
    monkeypatch.setattr(mask_mod, "time", types.SimpleNamespace(perf_counter=time_mod.perf_counter, thread_time=cpu))
    real = xgrammar.BatchGrammarMatcher
    monkeypatch.setattr(xgrammar, "BatchGrammarMatcher", lambda threads: _TimedBatchFills(real(threads), cpu))
    rows, (nxt, sib, tok), kinds = _mixed(22)
    for i in kinds["guidance"]:
        r = rows[i]
        rows[i] = MaskRequest(None, r.grammar, r.request_id, _OnFill(r.guidance, cpu.tick))
    builder = _builder(1)
    for builds in (1, 2):
        got = builder.build(rows, nxt, sib, tok, VOCAB)
        assert got.guidance_walked and not got.failed
        assert cpu.ticks > 2 * builds  # both walks filled rows in each build
        assert builder.native_cpu_s == pytest.approx(0.25 * cpu.ticks)


def test_a_failed_batched_llguidance_walk_forgets_its_rows_forced_texts_and_only_theirs(caplog):
    """Forced drafts over one batch of xgrammar rows (a regex with literal parts) and llguidance rows (strict JSON:
    keys and punctuation forced), an xgrammar row first and one after the llguidance rows. One llguidance matcher
    raises on its second fill, after the roots' forced texts were recorded: the batched walk stops with one warning
    naming the error and the rows it hands back, every llguidance row's forced texts are forgotten (the
    request-by-request walk that redoes them records none), and the xgrammar rows keep theirs, as in the same build
    without the fault. The mask is exact either way."""
    from sglang_eagle_overlap.core.forced import ForcedDrafts

    from sglang_eo_dev.helpers.tokenizers import encode

    rows, (nxt, sib, tok), kinds = _mixed(23, "nested", strict=True, xgrammar="regex")
    order = [4, 0, 1, 2, 3, 5, 6]  # an xgrammar row before the llguidance rows, one after
    rows = [rows[i] for i in order]
    nxt, sib, tok = nxt[order], sib[order], tok[order]
    guided, xgr_rows, n = [1, 2, 3, 4], [0, 5], 8

    def table(forced):
        return forced._host[: len(rows) * n, 0, :, 0]

    def drafts():
        f = ForcedDrafts(width=6)
        f.encode = lambda text: list(encode(text, VOCAB))  # xgrammar's forced text is text (llguidance's, tokens)
        return f

    ok = drafts()
    want = _builder(1).build(rows, nxt, sib, tok, VOCAB, forced=ok)
    want_mask = want.bitmask.clone()
    assert want.guidance_walked
    # forced texts were recorded in the llguidance rows (at the roots, before the fault's fill) and in both xgrammar
    # rows
    assert any(bool((table(ok)[i * n] != -1).any()) for i in guided)
    assert all(bool((table(ok)[i * n : (i + 1) * n] != -1).any()) for i in xgr_rows)

    bad = 2
    r = rows[bad]
    fills = []

    def second_fill_raises() -> None:  # the root's fill works, the next raises: the roots' texts are recorded by then
        fills.append(1)
        if len(fills) > 1:
            raise RuntimeError("injected llguidance fill fault")

    rows[bad] = MaskRequest(None, r.grammar, r.request_id, _OnFill(r.guidance, second_fill_raises))
    forced = drafts()
    with caplog.at_level(logging.WARNING, logger="sglang_eagle_overlap.core.mask"):
        got = _builder(1).build(rows, nxt, sib, tok, VOCAB, forced=forced)
    assert not got.guidance_walked and not got.failed and torch.equal(got.bitmask, want_mask)
    assert [m.getMessage() for m in caplog.records if m.levelno >= logging.WARNING] == [
        "sglang-eagle-overlap: batched llguidance tree walk failed (RuntimeError: injected llguidance fill fault); "
        "walking its 4 request(s) one by one"]
    for i in guided:
        assert bool((table(forced)[i * n : (i + 1) * n] == -1).all()), i
    for i in xgr_rows:
        assert torch.equal(torch.as_tensor(table(forced)[i * n : (i + 1) * n]),
                           torch.as_tensor(table(ok)[i * n : (i + 1) * n])), i


def test_a_pooled_walk_over_more_rows_than_a_row_has_words_is_sglangs_mask():
    """llguidance's pooled fill is told the mask's row count (it bounds each row it writes): with 26 requests of 41
    nodes the mask has 1,066 rows, more than its 1,000 words a row (the last request's rows all lie past 1,000), and
    the pooled walk (two fill threads) still fills every row as SGLang does."""
    batch = Batch("regex", 8, 5, 41, bs=26, seed=31, free_every=0)
    assert len(batch.rows()) * batch.n > bitmask_width(VOCAB)
    builder = _builder(2)
    got = builder.build(batch.rows(), batch.nxt, batch.sib, batch.tok, VOCAB)
    assert builder.guidance_walks == 1 and not got.failed and not got.timed_out
    assert torch.equal(got.bitmask, upstream_mask(batch.up, batch.nxt, batch.sib, batch.tok, VOCAB))
