"""Grammar-forced drafts (issue 19), core: the forced continuation per node, the table the mask build fills, the
device pick after the verify and the replacement in the next step's tree (CPU tensors stand in for the device)."""

from __future__ import annotations

import random
from typing import List, Sequence

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest, TreeMaskBuilder
from sglang_eagle_overlap.core.forced import ForcedDrafts, stable_tokens
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.tokenizers import encode, hf_tokenizer

VOCAB = 32000


@pytest.fixture(scope="module")
def enc():
    tok = hf_tokenizer(VOCAB)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _doc_ids() -> List[int]:
    return list(encode(G.nested_doc_text(random.Random(0)), VOCAB))


def test_stable_tokens_hold_back_a_tail_that_merges_with_what_follows(enc):
    for s in ['{"name":', '","age":', 'alpha beta', ': ', '{"', '"]}']:
        toks = stable_tokens(enc, s)
        full = tuple(enc(s))
        assert toks == full[: len(toks)], s
        for probe in ("a", "1", " ", '"', "{", "]"):
            assert tuple(enc(s + probe))[: len(toks)] == toks, (s, probe)
    # a trailing space merges with a following word (" alpha"): held back
    assert len(stable_tokens(enc, ": ")) < len(enc(": "))


def test_continuation_is_the_grammars_forced_text_tokenized(enc):
    f = ForcedDrafts(width=8)
    m = G.matcher("nested", VOCAB)
    assert f.continuation(m) == ()  # no encoder: nothing
    f.encode = enc
    ids = _doc_ids()
    seen = 0
    for t in ids[:80]:
        s = m.find_jump_forward_string()
        toks = f.continuation(m)
        if s:
            assert toks == stable_tokens(enc, s)[:8]
            seen += bool(toks)
        else:
            assert toks == ()
        assert m.accept_token(t)
    assert seen >= 3  # keys of the nested schema are forced
    # the continuation's tokens are accepted by the grammar from that state
    m2 = G.matcher("nested", VOCAB)
    for t in ids:
        toks = f.continuation(m2)
        for k, x in enumerate(toks):
            assert m2.accept_token(x), (toks, k)
        m2.rollback(len(toks))
        if not m2.accept_token(t):
            break


def _chain(bs: int, n: int):
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, n)
    return nxt, torch.full((bs, n), -1, dtype=torch.int64)


def test_build_records_each_valid_nodes_continuation(enc):
    """The table row of a node is the continuation of the grammar state after that node's path; rows of invalid
    nodes and of unconstrained requests stay empty."""
    ids = _doc_ids()
    n, width = 4, 6
    f = ForcedDrafts(width=width)
    f.encode = enc
    prefix = ids[:2]  # the root of the tree is the last committed token
    m = G.matcher("nested", VOCAB, prefix)
    nxt, sib = _chain(2, n)
    tok = torch.tensor([ids[1:1 + n], [1, 2, 3, 4]])
    tok[0, 3] = VOCAB + 5  # out of vocabulary: an invalid node
    res = TreeMaskBuilder().build([MaskRequest(matcher=m), MaskRequest()], nxt, sib, tok, VOCAB, forced=f)
    assert not res.failed
    f.upload("cpu")
    table = f._table
    assert table is not None and tuple(table.shape) == (2 * n, width)
    ref = G.matcher("nested", VOCAB, prefix)
    for node in range(3):
        if node:
            assert ref.accept_token(int(tok[0, node]))
        want = stable_tokens(enc, ref.find_jump_forward_string())[:width] if ref.find_jump_forward_string() else ()
        row = [x for x in table[node].tolist() if x >= 0]
        assert tuple(row) == want, node
    assert (table[3] == -1).all() and (table[n:] == -1).all()


def _forced_after(rows: Sequence[Sequence[int]], accept_index: List[List[int]], rids: List[str],
                  n: int) -> ForcedDrafts:
    """A ForcedDrafts whose step had ``rows`` (flat rows -> tokens) and accepted ``accept_index``."""
    f = ForcedDrafts(width=4)
    f.begin(len(rids) * n)
    for row, toks in enumerate(rows):
        if toks:  # what record() writes for a matcher whose continuation is these tokens
            f._host[row, : len(toks)] = toks
    f.upload("cpu")
    f.after_verify(torch.tensor(accept_index, dtype=torch.int32), rids)
    return f


AB_ACCEPTED = [[0, 1, -1, -1], [4, -1, -1, -1]]  # request a accepted nodes 0 and 1 (row 1), b only its root (row 4)


def _ab(rows: Sequence[Sequence[int]]):
    """Two requests ``a``, ``b`` on chains of 4 nodes after a step that accepted :data:`AB_ACCEPTED`: (forced, links)."""
    return _forced_after(rows, AB_ACCEPTED, ["a", "b"], 4), _chain(2, 4)[0]


def test_next_step_gets_the_accepted_nodes_forced_tokens_on_its_top_path():
    rows = [[], [50, 51, 52, 53], [], [], [60, 61, 62], [], [], []]
    f, nxt = _ab(rows)
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])  # roots = the first forced tokens
    f.apply(draft, nxt, ["a", "b"])
    assert draft.tolist() == [50, 51, 52, 53, 60, 61, 62, 9]
    # the counts land with the next verify: it accepts a's first two forced drafts and nothing of b
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, 1, 2, -1], [4, -1, -1, -1]], dtype=torch.int32), ["a", "b"])
    assert (f.proposed, f.changed, f.accepted) == (5, 5, 2)


def test_no_replacement_when_the_root_is_not_the_first_forced_token_or_the_request_is_new():
    rows = [[], [50, 51, 52], [], [], [60, 61], [], [], []]
    f, nxt = _ab(rows)
    draft = torch.tensor([49, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, nxt, ["a", "c"])  # a wrote another token; c is new (b left the batch)
    assert draft.tolist() == [49, 7, 8, 9, 60, 7, 8, 9]
    f.after_verify(torch.tensor(AB_ACCEPTED, dtype=torch.int32), ["a", "c"])
    assert f.proposed == 0 and f.accepted == 0


def test_rows_follow_requests_when_the_batch_changes():
    n = 4
    rows = [[], [50, 51], [], [], [], [], [60, 61, 62], []]
    f = _forced_after(rows, [[0, 1, -1, -1], [4, 5, 6, -1]], ["a", "b"], n)
    nxt, _ = _chain(3, n)
    draft = torch.tensor([1, 2, 3, 4, 60, 7, 8, 9, 50, 7, 8, 9])
    f.apply(draft, nxt, ["new", "b", "a"])  # reordered, one new
    assert draft.tolist() == [1, 2, 3, 4, 60, 61, 62, 9, 50, 51, 8, 9]


def test_topk_tree_replaces_the_first_child_chain_only():
    n = 6
    # tree: 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}
    nxt = torch.tensor([[1, 3, -1, 5, -1, -1]])
    rows = [[70, 71, 72, 73]] + [[]] * (n - 1)
    f = _forced_after(rows, [[0, -1, -1, -1]], ["a"], n)
    draft = torch.tensor([70, 71, 2, 3, 4, 5])  # the draft model already proposed 71
    f.apply(draft, nxt, ["a"])
    assert draft.tolist() == [70, 71, 2, 72, 4, 73]
    f.after_verify(torch.tensor([[0, 1, 3, 5]], dtype=torch.int32), ["a"])
    assert (f.proposed, f.changed, f.accepted) == (3, 2, 3)


def test_each_pick_is_applied_at_most_once_and_dropped_by_other_verifies():
    rows = [[], [50, 51], [], [], [], [], [], []]
    f, nxt = _ab(rows)
    d1 = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(d1, nxt, ["a", "b"])
    d2 = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(d2, nxt, ["a", "b"])
    assert d1[1] == 51 and d2[1] == 7
    f, nxt = _ab(rows)
    f.discard()
    d3 = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(d3, nxt, ["a", "b"])
    assert d3[1] == 7


def test_not_used_when_the_verify_samples_with_the_drafts_probabilities():
    rows = [[], [50, 51], [], [], [], [], [], []]
    f, nxt = _ab(rows)
    d = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(d, nxt, ["a", "b"], draft_probs_used=True)
    f.after_verify(torch.tensor(AB_ACCEPTED, dtype=torch.int32), ["a", "b"])
    assert d[1] == 7 and f.proposed == 0


def test_replacement_stops_at_the_first_missing_forced_token_and_the_tree_depth():
    n = 4
    rows = [[], [50, 51, -1, 53], [], [], [], [], [], []]
    f, nxt = _ab(rows)
    draft = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(draft, nxt, ["a", "b"])
    assert draft.tolist()[:4] == [50, 51, 8, 9]  # 53 is not contiguous with 51: not used
    # depth bound: accept_index of width 2 (1 draft step) -> at most one replaced draft
    rows = [[], [50, 51, 52, 53], [], [], [], [], [], []]
    f = _forced_after(rows, [[0, 1], [4, -1]], ["a", "b"], n)
    draft = torch.tensor([50, 7, 8, 9, 0, 0, 0, 0])
    f.apply(draft, nxt, ["a", "b"])
    assert draft.tolist()[:4] == [50, 51, 8, 9]


@pytest.mark.parametrize("chain", [False, True])
def test_chain_trees_take_the_same_path_without_a_pointer_chase(chain):
    rows = [[], [50, 51, 52, 53], [], [], [60, 61], [], [], []]
    f, nxt = _ab(rows)
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, nxt, ["a", "b"], chain=chain)
    assert draft.tolist() == [50, 51, 52, 53, 60, 61, 8, 9]
