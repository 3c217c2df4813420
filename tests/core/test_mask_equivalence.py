"""TreeMaskBuilder vs SGLang's own ``generate_token_bitmask`` / ``traverse_tree`` (the installed SGLang of this venv).

Every scenario builds the same batch twice -- SGLang's real ``XGrammarGrammar`` objects for upstream, a second set at
the same grammar state for the plugin (mapped through ``mask_request_for``) -- and requires the bitmasks to be
bit-identical for every strategy (lockstep, native, python) and thread count (1, 2). Rows of grammar-invalid or
terminating nodes must be all-allowed (-1), and every matcher must be back in its entry state afterwards.

Tree shapes (node 0 = committed root; first child = true continuation; ``x`` = random / often invalid)::

    topk 1, 3 steps (chain)        topk 4, 3 steps, 8 nodes          EOS inside a tree
    0 - 1 - 2 - 3                  0 - 1 - 2 - 3                     0 - 1 - 2(EOS) - 3   <- 3 never visited
                                   |   |   `- 6x                         `- 4x
                                   |   `- 5x - 7x
                                   `- 4x

Padded tree: nodes past the real ones have -1 links and junk tokens; padded requests have no grammar.
"""

from __future__ import annotations

import inspect
import random
import zlib
from collections import Counter
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.integration.requests import mask_request_for
from sglang_eagle_overlap.core.mask import TreeMaskBuilder, neutralize_timed_out_drafts
from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.tokenizers import EOS_ID
from sglang_eo_dev.helpers.trees import Tree, allowed_tokens, eagle_tree, stack_trees

G.ensure_sglang_importable()
from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject  # noqa: E402
from sglang.srt.speculative import spec_utils  # noqa: E402

# "lockstep+cxx": the lockstep walk through the plugin's native module (core/native.py), one call per build.
CONFIGS = [(s, t) for s in ("lockstep", "lockstep+cxx", "native", "python") for t in (1, 2)]


def make_builder(strategy: str, threads: int, **kw) -> TreeMaskBuilder:
    if strategy == "lockstep+cxx":
        return TreeMaskBuilder(strategy="lockstep", threads=threads, native=native(), **kw)
    return StrategyMaskBuilder(strategy=strategy, threads=threads, **kw)
SHAPES = [(1, 3, 4), (1, 5, 6), (4, 3, 8), (4, 4, 13), (8, 5, 41), (8, 5, 64)]


def upstream_mask(reqs, nxt, sib, tok, vocab) -> Optional[torch.Tensor]:
    """SGLang's own mask (both signatures: 0.5.16 takes ``verify_input``, 0.5.23 does not)."""
    fn = spec_utils.generate_token_bitmask
    if "verify_input" in inspect.signature(fn).parameters:
        out = fn(reqs, SimpleNamespace(grammar=None), nxt, sib, tok, vocab)
    else:
        out, _ = fn(reqs, nxt, sib, tok, vocab)
    return None if out is None else out.clone()


def node_states(matcher, tree: Tree, vocab: int) -> List[str]:
    """Independent recursive reference: 'open' (row filled), 'terminal' or 'invalid' (row stays -1) per node."""
    n = len(tree.tok)
    states = ["invalid"] * n

    def visit(node: int) -> None:
        while node >= 0:
            t = tree.tok[node]
            allowed = 0 <= t < vocab and t in set(allowed_tokens(matcher, vocab).tolist())
            if allowed and matcher.accept_token(t):
                if matcher.is_terminated():
                    states[node] = "terminal"
                else:
                    states[node] = "open"
                    visit(tree.nxt[node])
                matcher.rollback(1)
            node = tree.sib[node]

    if matcher.is_terminated():
        states[0] = "terminal"
    else:
        states[0] = "open"
        visit(tree.nxt[0])
    return states


class Scenario:
    def __init__(self, grammar, vocab, topk, steps, n, bs, seed, *, unconstrained_every=0, padded_requests=0,
                 real_nodes=None, p_oov=0.0, eos=True, near_end=0.3, grammars_mix=None):
        rng = random.Random(seed)
        self.vocab, self.n = vocab, n
        self.up, self.ours, self.trees, self.matchers = [], [], [], []
        for i in range(bs):
            g_name = grammars_mix[i % len(grammars_mix)] if grammars_mix else grammar
            padded = i >= bs - padded_requests
            free = unconstrained_every and i % unconstrained_every == unconstrained_every - 1
            if padded:
                tree = Tree(nxt=[-1] * n, sib=[-1] * n, tok=[0] * n, parent=[-1] * n)
                self._add(None, None, tree)
                continue
            doc = G.doc_tokens(g_name, rng, vocab)
            if rng.random() < near_end:
                pos = max(0, len(doc) - rng.randint(1, steps + 1))
            else:
                pos = rng.randrange(len(doc))
            prefix, truth = list(doc[:pos]), list(doc[pos:])
            if free:
                tree = eagle_tree(rng, topk, steps, n, truth, vocab, real_nodes=real_nodes)
                self._add(None, None, tree)
                continue
            g_up = G.sglang_grammar(g_name, vocab, prefix)
            g_ours = G.sglang_grammar(g_name, vocab, prefix)
            tree = eagle_tree(rng, topk, steps, n, truth, vocab, matcher=g_ours.matcher, real_nodes=real_nodes,
                              p_oov=p_oov, extra_tokens=(EOS_ID,) if eos else ())
            self._add(g_up, g_ours, tree)
        self.nxt, self.sib, self.tok = stack_trees(self.trees)
        self.counts = Counter()  # node states seen by check(): proves a scenario exercises what it claims

    def _add(self, g_up, g_ours, tree):
        self.up.append(SimpleNamespace(grammar=g_up))
        self.ours.append(SimpleNamespace(grammar=g_ours, rid=f"r{len(self.ours)}", finished=lambda: False))
        self.trees.append(tree)

    def reference(self):
        return upstream_mask(self.up, self.nxt, self.sib, self.tok, self.vocab)

    def check(self, configs=CONFIGS, wrap=None):
        ref = self.reference()
        reqs = [mask_request_for(r) for r in self.ours] if wrap is None else wrap(self.ours)
        for strategy, threads in configs:
            before = [(G.next_token_bitmask(r.grammar.matcher, self.vocab), len(r.grammar.accepted_tokens))
                      for r in self.ours if r.grammar is not None]
            builder = make_builder(strategy, threads)
            if threads > 1:
                # Every lockstep round on the C++ thread pool (the policy is only a speed knob).
                builder.parallel_min_fills, builder.parallel_min_work_s = 1, 0.0
            got = builder.build(reqs, self.nxt, self.sib, self.tok, self.vocab)
            label = f"strategy={strategy} threads={threads}"
            native_rows = any(isinstance(q.matcher, xgr.GrammarMatcher) for q in reqs)
            assert builder.native_walks == (strategy == "lockstep+cxx" and native_rows and ref is not None), label
            if ref is None:
                assert got.bitmask is None, label
                continue
            assert got.bitmask is not None, label
            assert got.timed_out == [], label
            filled = 0  # rows the reference walk fills ("open" nodes) over the batch
            for i, r in enumerate(self.ours):
                rows = got.bitmask[i * self.n : (i + 1) * self.n]
                if r.grammar is None:
                    assert bool((rows == -1).all()), f"{label}: unconstrained request {i} must stay all-allowed"
                    continue
                states = node_states(r.grammar.matcher, self.trees[i], self.vocab)
                self.counts.update(f"{st}-root" if node == 0 else st for node, st in enumerate(states))
                filled += states.count("open")
                for node, st in enumerate(states):
                    if st == "open":
                        assert torch.equal(rows[node], ref[i * self.n + node]), f"{label}: req {i} node {node}"
                        assert not bool((rows[node] == -1).all()), f"{label}: req {i} node {node} not filled"
                    else:
                        assert bool((rows[node] == -1).all()), f"{label}: req {i} {st} node {node} must be -1"
                assert torch.equal(rows, ref[i * self.n : (i + 1) * self.n]), f"{label}: req {i}"
            assert torch.equal(got.bitmask, ref), label
            assert got.valid_nodes == filled, f"{label}: valid_nodes {got.valid_nodes} != {filled} filled rows"
            after = [(G.next_token_bitmask(r.grammar.matcher, self.vocab), len(r.grammar.accepted_tokens))
                     for r in self.ours if r.grammar is not None]
            for (b, bl), (a, al) in zip(before, after):
                assert torch.equal(a, b) and al == bl, f"{label}: matcher not restored"
        return ref


@pytest.mark.parametrize("vocab", [32000, 128000])
@pytest.mark.parametrize("grammar", ["nested", "pattern", "ebnf", "regex"])
@pytest.mark.parametrize("topk,steps,n", SHAPES, ids=[f"topk{k}-steps{s}-n{n}" for k, s, n in SHAPES])
def test_matches_upstream(grammar, vocab, topk, steps, n):
    bs = 4 if n < 64 else 2
    # crc32, not hash(): str hashes are salted per process, which would draw different trees on every run
    seed = zlib.crc32(f"{grammar}-{vocab}-{topk}-{steps}-{n}".encode()) % 10**6
    Scenario(grammar, vocab, topk, steps, n, bs, seed=seed).check()


@pytest.mark.parametrize("seed", range(6))
def test_random_trees_with_invalid_and_oov_tokens(seed):
    """Side nodes: mostly random (invalid) tokens, some >= vocab_size, some EOS; valid side branches too."""
    sc = Scenario("nested", 32000, 4, 4, 16, 3, seed=100 + seed, p_oov=0.3)
    sc.check(configs=CONFIGS[:1])
    assert sc.counts["open"] >= 3 and sc.counts["invalid"] >= 3, sc.counts
    assert any(t >= 32000 for tr in sc.trees for t in tr.tok), "no out-of-vocabulary token drawn"
    sc.check()


def test_eos_and_termination_inside_tree():
    """Requests 1-3 tokens before the document end: the true path reaches EOS and its children are never visited::

        0 - a - '}' - EOS - x   <- x stays -1
    """
    terminal = 0
    for seed in range(4):
        for sc in (Scenario("pattern", 32000, 4, 5, 13, 4, seed=200 + seed, near_end=1.0),
                   Scenario("regex", 128000, 1, 5, 6, 4, seed=300 + seed, near_end=1.0)):
            sc.check()
            terminal += sc.counts["terminal"]
    assert terminal >= 4, "EOS was never reached inside a tree"


def test_terminated_root_stays_all_allowed():
    """A request whose grammar already terminated: every row -1 (SGLang never fills them)."""
    rng = random.Random(7)
    sc = Scenario("regex", 32000, 1, 3, 4, 2, seed=7)
    doc = G.doc_tokens("regex", rng, 32000)
    for reqs in (sc.up, sc.ours):
        reqs[0].grammar = G.sglang_grammar("regex", 32000, list(doc))
        assert reqs[0].grammar.is_terminated()
    sc.check()


def test_padded_trees_and_padded_requests():
    """Trees with fewer real nodes than n (-1 links, junk tokens) and trailing requests with no grammar."""
    Scenario("nested", 32000, 4, 3, 16, 6, seed=11, real_nodes=7, padded_requests=2).check()
    Scenario("ebnf", 128000, 8, 5, 64, 3, seed=12, real_nodes=20, padded_requests=1).check()


def test_mixed_constrained_and_unconstrained_batch():
    Scenario(None, 32000, 4, 3, 8, 9, seed=13, unconstrained_every=3,
             grammars_mix=["nested", "pattern", "ebnf", "regex"]).check()


def test_all_unconstrained_batch_has_no_mask():
    sc = Scenario("nested", 32000, 4, 3, 8, 3, seed=14, unconstrained_every=1)
    assert sc.reference() is None
    sc.check()


class WrappedGrammar(BaseGrammarObject):
    """A non-xgrammar grammar object (like SGLang's reasoning wrapper): delegates to an inner grammar object."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    @property
    def accepted_tokens(self):
        return self.inner.accepted_tokens

    @property
    def matcher(self):  # only for the test's own state checks; the plugin must not take the native path for this
        return self.inner.matcher

    def accept_token(self, token: int) -> None:
        self.calls += 1
        self.inner.accept_token(token)

    def rollback(self, k: int) -> None:
        self.inner.rollback(k)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def allocate_vocab_mask(self, vocab_size, batch_size, device):
        return self.inner.allocate_vocab_mask(vocab_size, batch_size, device)

    def fill_vocab_mask(self, vocab_mask, idx) -> None:
        self.inner.fill_vocab_mask(vocab_mask, idx)


def test_non_xgrammar_object_takes_python_walk():
    sc = Scenario("nested", 32000, 4, 4, 13, 4, seed=15, unconstrained_every=4)
    for r in sc.up + sc.ours:
        if r.grammar is not None:
            r.grammar = WrappedGrammar(r.grammar)
    reqs = [mask_request_for(r) for r in sc.ours]
    assert all(q.matcher is None for q in reqs), "a wrapper must not be mistaken for XGrammarGrammar"
    assert any(q.grammar is not None for q in reqs)
    sc.check()
    assert any(r.grammar.calls for r in sc.ours if r.grammar is not None)


@pytest.mark.parametrize("strategy", ["lockstep", "lockstep+cxx", "native", "python"])
def test_time_limit(strategy):
    """Timed-out requests: reported, root row exact, other rows -1, matcher restored; drafts neutralised."""
    sc = Scenario("nested", 128000, 8, 5, 64, 3, seed=16, near_end=0.0)
    ref = sc.reference()
    reqs = [mask_request_for(r) for r in sc.ours]
    before = [G.next_token_bitmask(r.grammar.matcher, sc.vocab) for r in sc.ours]
    builder = make_builder(strategy, 2, time_limit_s=1e-9)
    got = builder.build(reqs, sc.nxt, sc.sib, sc.tok, sc.vocab)
    n = sc.n
    if strategy in ("lockstep", "lockstep+cxx", "python"):
        assert sorted(got.timed_out) == [0, 1, 2]
    else:
        assert got.timed_out, "a 64-node tree over a 128k vocabulary cannot be traversed in 1 us"
    assert builder.timeouts == len(got.timed_out)
    for i in range(3):
        rows = got.bitmask[i * n : (i + 1) * n]
        if i in got.timed_out:
            assert torch.equal(rows[0], ref[i * n]), f"req {i}: root row must be exact"
            assert bool((rows[1:] == -1).all()), f"req {i}: non-root rows must be all-allowed"
        else:
            assert torch.equal(rows, ref[i * n : (i + 1) * n])
        after = G.next_token_bitmask(sc.ours[i].grammar.matcher, sc.vocab)
        assert torch.equal(after, before[i]), f"req {i}: matcher not restored"
    # Matchers stay usable: a build without a limit is exact afterwards.
    again = make_builder(strategy, 2).build(reqs, sc.nxt, sc.sib, sc.tok, sc.vocab)
    assert torch.equal(again.bitmask, ref)

    draft = sc.tok.reshape(-1).clone()
    neutralize_timed_out_drafts(draft, got.timed_out, n)
    view = draft.view(-1, n)
    for i in range(3):
        if i in got.timed_out:
            assert int(view[i, 0]) == int(sc.tok[i, 0])
            assert bool((view[i, 1:] == -1).all())
        else:
            assert torch.equal(view[i], sc.tok[i])


def test_neutralize_noop_and_2d():
    t = torch.arange(12).view(3, 4).clone()
    neutralize_timed_out_drafts(t, [], 4)
    assert torch.equal(t, torch.arange(12).view(3, 4))
    neutralize_timed_out_drafts(t, [1], 4)
    assert t.tolist() == [[0, 1, 2, 3], [4, -1, -1, -1], [8, 9, 10, 11]]


def test_rejects_bad_shapes():
    sc = Scenario("regex", 32000, 1, 3, 4, 2, seed=17)
    reqs = [mask_request_for(r) for r in sc.ours]
    with pytest.raises(ValueError, match="retrieve_next_token"):
        TreeMaskBuilder(strategy="lockstep").build(reqs[:1], sc.nxt, sc.sib, sc.tok, sc.vocab)
    with pytest.raises(ValueError, match="retrieve_next_sibling"):
        TreeMaskBuilder(strategy="lockstep").build(reqs, sc.nxt, sc.sib[:, :3], sc.tok, sc.vocab)
    with pytest.raises(ValueError, match="draft_tokens"):
        StrategyMaskBuilder(strategy="native").build(reqs, sc.nxt, sc.sib, sc.tok[:, :3], sc.vocab)
    with pytest.raises(ValueError, match="strategy"):
        StrategyMaskBuilder(strategy="bogus")  # type: ignore[arg-type]
