"""Grammar-forced drafts recorded by the native walk (``grammar_batch.cc``: RecordForced) against the Python lockstep
walk (``ForcedDrafts.record``): the same table, bonus keys included, the same learned keys, the same mask, and no
text asked of a matcher whose grammar was not admitted. With the native walk, forced drafts no longer take the
grammar work off the grammar thread (``GrammarStep``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.tokenizers import EOS_ID, hf_tokenizer
from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

VOCAB = 32000


@pytest.fixture(scope="module")
def tok():
    return hf_tokenizer(VOCAB)


def _forced(tok, keys) -> ForcedDrafts:
    f = ForcedDrafts(width=6)
    f.encode = lambda s: tok.encode(s, add_special_tokens=False)
    f.decode = tok.decode
    f._key_counts = dict(keys)
    return f


def _world(seed: int, k: int = 6, n: int = 8):
    """``k`` requests of mixed grammars part-way through a document, with an EAGLE-like tree each whose first drafts
    follow the document; built twice (fresh matchers in the same states) for the two walks."""
    rng = random.Random(seed)
    plans = []
    for _ in range(k):
        g = rng.choice(["regex", "nested", "ebnf"])
        doc = list(G.doc_tokens(g, rng, VOCAB))
        plans.append((g, doc, rng.randrange(0, max(1, len(doc) - 6))))
    trees = []
    for g, doc, p in plans:
        trees.append(eagle_tree(rng, 4, 3, n, doc[p : p + 3], VOCAB, matcher=G.matcher(g, VOCAB, doc[:p]),
                                extra_tokens=(EOS_ID,)))

    def matchers():
        return [G.matcher(g, VOCAB, doc[:p]) for g, doc, p in plans]

    return matchers, stack_trees(trees), plans


def _table(f: ForcedDrafts) -> torch.Tensor:
    f.upload("cpu")
    assert f._table is not None
    return f._table.clone()


@pytest.mark.parametrize("seed", range(4))
def test_the_native_walk_records_the_table_the_python_walk_records(tok, seed):
    """Two builds in a row (the second uses the keys the first learned); one request's grammar is refused (as
    ``admit`` refuses an unbounded one): neither walk asks its matcher, the two tables are equal bit for bit."""
    keys = {tok.encode(s, add_special_tokens=False)[0]: c for s, c in (('",', 3), ('"', 2), (",", 1))}
    f_py, f_cx = _forced(tok, keys), _forced(tok, keys)
    py, cx = TreeMaskBuilder(threads=1), TreeMaskBuilder(threads=1, native=native())
    for build in range(2):
        matchers, (nxt, sib, draft), _ = _world(10 * seed + build)
        ms_py, ms_cx = matchers(), matchers()
        f_py._bounded.set(ms_py[1], False)
        f_cx._bounded.set(ms_cx[1], False)
        want = py.build([MaskRequest(matcher=m) for m in ms_py], nxt, sib, draft, VOCAB, forced=f_py)
        got = cx.build([MaskRequest(matcher=m) for m in ms_cx], nxt, sib, draft, VOCAB, forced=f_cx)
        assert torch.equal(got.bitmask, want.bitmask) and got.valid_nodes == want.valid_nodes
        assert torch.equal(_table(f_cx), _table(f_py)), (seed, build)
        assert (_table(f_cx)[8:16] == -1).all()  # the refused request's rows
        assert f_cx._key_counts == f_py._key_counts and f_cx.keys == f_py.keys
        assert (f_cx.recorded_nodes, f_cx.recorded_keyed) == (f_py.recorded_nodes, f_py.recorded_keyed)
        for a, b in zip(ms_py, ms_cx):  # both walks left every matcher where it was
            assert torch.equal(G.next_token_bitmask(a, VOCAB), G.next_token_bitmask(b, VOCAB))
    assert cx.native_walks == 2 and py.native_walks == 0
    assert f_cx.recorded_nodes > 0


def test_keyed_slots_are_found_by_both_walks(tok):
    """Over a few worlds both walks find nodes with no text of their own but one after a bonus key (JSON string
    values: after the closing quote comes the next key), and agree on them."""
    keys = {tok.encode(s, add_special_tokens=False)[0]: 1 for s in ('"', '",', "}")}
    keyed_py = keyed_cx = 0
    for seed in range(6):
        f_py, f_cx = _forced(tok, keys), _forced(tok, keys)
        matchers, (nxt, sib, draft), _ = _world(100 + seed, k=8)
        TreeMaskBuilder(threads=1).build([MaskRequest(matcher=m) for m in matchers()], nxt, sib, draft, VOCAB,
                                         forced=f_py)
        TreeMaskBuilder(threads=2, native=native()).build([MaskRequest(matcher=m) for m in matchers()], nxt, sib,
                                                          draft, VOCAB, forced=f_cx)
        assert torch.equal(_table(f_cx), _table(f_py)), seed
        keyed_py += f_py.recorded_keyed
        keyed_cx += f_cx.recorded_keyed
    assert keyed_cx == keyed_py > 0


def test_without_forced_drafts_the_native_call_asks_nothing(tok):
    matchers, (nxt, sib, draft), _ = _world(7)
    nat = native()
    ms = matchers()
    mask = torch.full((6 * 8, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    res = nat.step_batch((), (), (), nat.handles(ms), list(range(6)), nxt, sib, draft, mask, VOCAB, None)
    assert res.total > 0 and list(res.forced) == []
    mask.fill_(-1)
    res = nat.step_batch((), (), (), nat.handles(ms), list(range(6)), nxt, sib, draft, mask, VOCAB, None,
                         forced_ok=[1] * 6)
    assert len(res.forced) > 0 and all(r.key == -1 for r in res.forced)  # no keys given: own texts only
    with pytest.raises(ValueError, match="one forced-draft flag per walk matcher"):
        nat.step_batch((), (), (), nat.handles(ms), list(range(6)), nxt, sib, draft, mask, VOCAB, None,
                       forced_ok=[1] * 5)


UNICODE_SCHEMA = {"type": "object", "properties": {"w": {"enum": ["naïve café", "日本語のテキスト", "🙂 emoji ✓", "Ωμέγα"]}},
                  "required": ["w"]}


def _unicode_world(seed: int, k: int = 6, n: int = 6):
    """``k`` requests under an enum of multi-byte words, each at a random state of a random valid path, with a chain
    tree following that path: many nodes sit in the middle of a character (a token ending inside its bytes)."""
    import json

    import xgrammar as xgr

    from sglang_eo_dev.helpers.tokenizers import tokenizer_info

    cg = xgr.GrammarCompiler(tokenizer_info(VOCAB)).compile_json_schema(json.dumps(UNICODE_SCHEMA),
                                                                         any_whitespace=False)
    rng = random.Random(seed)
    plans = []
    for _ in range(k):
        m = xgr.GrammarMatcher(cg)
        path = []
        while len(path) < 30 and not m.is_terminated():
            row = G.next_token_bitmask(m, VOCAB)[0].numpy()
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB])
            t = int(rng.choice(list(allowed)))
            assert m.accept_token(t)
            path.append(t)
        cut = rng.randrange(1, max(2, len(path) - n))
        plans.append((path[:cut], path[cut - 1 : cut - 1 + n]))  # the root is the last committed token

    def matchers():
        out = []
        for prefix, _ in plans:
            m = xgr.GrammarMatcher(cg)
            for t in prefix:
                assert m.accept_token(t)
            out.append(m)
        return out

    nxt = torch.full((k, n), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, n)
    tok = torch.tensor([(chain + [0] * n)[:n] for _, chain in plans], dtype=torch.int64)
    return matchers, (nxt, torch.full((k, n), -1, dtype=torch.int64), tok)


def test_a_matcher_in_the_middle_of_a_character_forces_no_text_and_breaks_no_build(tok):
    """xgrammar's forced text from the middle of a multi-byte character is the rest of its bytes: no str (its Python
    API raises ``UnicodeDecodeError``), nothing to tokenize. Both walks leave such nodes without a continuation and
    build the same table and mask, without an error (a native call whose result could not be read would be taken as
    never made, and its feeds made twice)."""
    keys = {tok.encode(s, add_special_tokens=False)[0]: 1 for s in ('"', '",', "}")}
    mid = 0
    for seed in range(4):
        matchers, (nxt, sib, draft) = _unicode_world(seed)
        for m in matchers():  # the premise: some roots sit inside a character
            try:
                m.find_jump_forward_string()
            except UnicodeDecodeError:
                mid += 1
        f_py, f_cx = _forced(tok, keys), _forced(tok, keys)
        ms_py, ms_cx = matchers(), matchers()
        want = TreeMaskBuilder(threads=1).build([MaskRequest(matcher=m) for m in ms_py], nxt, sib, draft, VOCAB,
                                                forced=f_py)
        cx = TreeMaskBuilder(threads=1, native=native())
        got = cx.build([MaskRequest(matcher=m) for m in ms_cx], nxt, sib, draft, VOCAB, forced=f_cx)
        assert not want.failed and not got.failed and cx.native_walks == 1
        assert torch.equal(got.bitmask, want.bitmask) and torch.equal(_table(f_cx), _table(f_py)), seed
        for a, b in zip(ms_py, ms_cx):
            assert torch.equal(G.next_token_bitmask(a, VOCAB), G.next_token_bitmask(b, VOCAB))
    assert mid > 0
