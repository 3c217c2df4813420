"""Grammar-forced drafts, core: the forced continuation per node, the table the mask build fills, the
device pick after the verify and the replacement in the next step's tree (CPU tensors stand in for the device)."""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core.forced import ALTERNATIVES, BONUS_KEYS, ForcedDrafts, prefix_alternatives, stable_tokens
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.tokenizers import encode, hf_tokenizer
from tests.core.test_mask_failures import RaisingMatcher

VOCAB = 32000


@pytest.fixture(scope="module")
def enc():
    tok = hf_tokenizer(VOCAB)
    return lambda s: tok.encode(s, add_special_tokens=False)


def _doc_ids() -> List[int]:
    return list(encode(G.nested_doc_text(random.Random(0)), VOCAB))


# A 15-token vocabulary whose tokenization is worked out by hand: greedy longest match (a character outside it is
# UNKNOWN). Where a string ends matters: '"' followed by 'a' or ',' becomes one token ('"a', '",'), 'b"' followed by
# '}' too ('b"}').
TINY = ["</s>", "{", '"', "k", "ke", "key", '":', ":", "}", "a", "b", '"a', '",', ",", 'b"}']
OPEN, Q, K, KE, KEY, QCOLON, COLON, CLOSE, A, B, QA, QCOMMA, COMMA, BQCLOSE = range(1, 15)
UNKNOWN = 99
# Its grammar: every document is {"key":"<a or b, at least once>"}.
TINY_REGEX = r'\{"key":"[ab]+"\}'


def tiny_encode(s: str) -> List[int]:
    out, i = [], 0
    while i < len(s):
        fits = [t for t in range(1, len(TINY)) if s.startswith(TINY[t], i)]
        best = max(fits, key=lambda t: len(TINY[t]), default=None)
        out.append(UNKNOWN if best is None else best)
        i += 1 if best is None else len(TINY[best])
    return out


def tiny_decode(ids: Sequence[int]) -> str:
    return "".join(TINY[i] for i in ids)


def tiny_matcher(prefix: Sequence[int] = ()):
    import xgrammar as xgr

    grammar = xgr.GrammarCompiler(xgr.TokenizerInfo(TINY, stop_token_ids=[0])).compile_regex(TINY_REGEX)
    m = xgr.GrammarMatcher(grammar, max_rollback_tokens=-1)
    for t in prefix:
        assert m.accept_token(t), TINY[t]
    return m


def test_the_tiny_tokenizer_is_the_one_worked_out_by_hand():
    """The premises of the hand-worked values below."""
    assert tiny_encode('{"key":"') == [OPEN, Q, KEY, QCOLON, Q]
    assert tiny_encode('{"key":"a') == [OPEN, Q, KEY, QCOLON, QA]
    assert tiny_encode('ab"}') == [A, BQCLOSE] and tiny_encode('ab"') == [A, B, Q]
    assert tiny_encode("A") == [UNKNOWN] and tiny_decode([Q, KEY, QCOLON]) == '"key":'
    assert tiny_matcher().find_jump_forward_string() == '{"key":"'


@pytest.mark.parametrize("s, kept", [
    ('{"key":"', (OPEN, Q, KEY, QCOLON)),  # the last '"' is held back: '"a' or '",' may follow
    ('"key":"', (Q, KEY, QCOLON)),
    ('":"', (QCOLON,)),
    ('"', ()),  # all of it held back
    ("}", (CLOSE,)),  # nothing held back: '}' followed by any probe character is still '}' then that character
    ("}}", (CLOSE, CLOSE)),
    (":", (COLON,)),
    ('ab"', (A,)),  # two tokens held back: 'b"' + '}' is one token
    ("", ()),
])
def test_stable_tokens_hand_worked(s, kept):
    """``encode(s)`` without the tail tokens that a following letter, digit, space, quote, bracket, comma or newline
    could merge with, on :data:`TINY`; the batch encoder gives the same."""
    assert stable_tokens(tiny_encode, s) == kept
    assert stable_tokens(tiny_encode, s, lambda texts: [tiny_encode(t) for t in texts]) == kept


def test_prefix_alternatives_hand_worked():
    """Per forced token, the other single tokens spelling a prefix of the text from that token's offset on, shortest
    first, on :data:`TINY`. ``'"key":"'`` is forced as ``'"' 'key' '":'``::

        offset 0  '"'    position 0: the root check, none
        offset 1  'key'  'k', 'ke' spell a prefix of 'key":"' ('key' is the forced token itself)
        offset 4  '":'   '"' spells a prefix of '":"'
    """
    s = '"key":"'
    toks = (Q, KEY, QCOLON)
    assert prefix_alternatives(tiny_encode, tiny_decode, s, toks) == ((), (K, KE), (Q,))
    assert prefix_alternatives(tiny_encode, tiny_decode, s, toks, limit=1) == ((), (K,), (Q,))
    assert prefix_alternatives(tiny_encode, tiny_decode, s, toks[:1]) == ((),)
    # token 1 ('a') does not spell the text at offset 1: it is looked up (now 'key' is another token than the forced
    # one), nothing past it is
    assert prefix_alternatives(tiny_encode, tiny_decode, s, (Q, A, QCOLON)) == ((), (K, KE, KEY))
    # the first token already does not spell the text: position 0 (which never has any) only
    assert prefix_alternatives(tiny_encode, tiny_decode, s, (A, KEY)) == ((),)
    assert prefix_alternatives(tiny_encode, tiny_decode, s, ()) == ()


def test_stable_tokens_hold_back_a_tail_that_merges_with_what_follows(enc):
    for s in ['{"name":', '","age":', 'alpha beta', ': ', '{"', '"]}']:
        toks = stable_tokens(enc, s)
        full = tuple(enc(s))
        assert toks == full[: len(toks)], s
        for probe in ("a", "1", " ", '"', "{", "]"):
            assert tuple(enc(s + probe))[: len(toks)] == toks, (s, probe)
    # a trailing space merges with a following word (" alpha"): held back
    assert len(stable_tokens(enc, ": ")) < len(enc(": "))


def test_continuation_is_the_grammars_forced_text_tokenized():
    """Along the document ``{"key":"ab"}`` of :data:`TINY_REGEX`, the forced text after each token and its stable
    tokens, worked out by hand; at most ``width`` of them; nothing without an encoder."""
    f = ForcedDrafts(width=8)
    m = tiny_matcher()
    assert f.continuation(m) == ()  # no encoder: nothing
    f.encode = tiny_encode
    want = [  # (token accepted next, the continuation before it)
        (OPEN, (OPEN, Q, KEY, QCOLON)),  # '{"key":"'
        (Q, (Q, KEY, QCOLON)),  # '"key":"'
        (KEY, (KEY, QCOLON)),  # 'key":"'
        (QCOLON, (QCOLON,)),  # '":"'
        (Q, ()),  # '"': held back
        (A, ()),  # nothing forced: a, b or the closing quote
        (B, ()),
        (Q, ()),
        (CLOSE, (CLOSE,)),  # '}'
    ]
    for token, continuation in want:
        assert f.continuation(m) == continuation, TINY[token]
        assert m.accept_token(token)
    narrow = ForcedDrafts(width=2)
    narrow.encode = tiny_encode
    assert narrow.continuation(tiny_matcher()) == (OPEN, Q)


def test_continuations_are_accepted_by_the_grammar_on_a_real_tokenizer(enc):
    """On the 32000-token BPE and the nested schema: some states force a continuation, and each is accepted token by
    token from the state it was asked in (a held-back tail that merged, or a tokenization the grammar refuses, would
    not be)."""
    f = ForcedDrafts(width=8)
    f.encode = enc
    m = G.matcher("nested", VOCAB)
    seen = 0
    for t in _doc_ids():
        toks = f.continuation(m)
        seen += bool(toks)
        for k, x in enumerate(toks):
            assert m.accept_token(x), (toks, k)
        m.rollback(len(toks))
        if not m.accept_token(t):
            break
    assert seen >= 3  # keys of the nested schema are forced


def _chain(bs: int, n: int) -> torch.Tensor:
    """First-child links of ``bs`` chains of ``n`` nodes: node d's child is d + 1."""
    nxt = torch.full((bs, n), -1, dtype=torch.int64)
    nxt[:, :-1] = torch.arange(1, n)
    return nxt


# The tree of the build tests (one request, n = 5), its root the last committed token '{' (in the matcher already):
#
#   node 0 '{' ── node 1 '"' ── node 3 'key' ── node 4 '":'
#        └─────── node 2 'a'    (invalid: the grammar wants '"')
TINY_NXT = [[1, 3, -1, 4, -1]]
TINY_SIB = [[-1, 2, -1, -1, -1]]
TINY_TOK = [[OPEN, Q, A, KEY, QCOLON]]


def _tiny_build(width: int, decode=None) -> torch.Tensor:
    """The table of one build of the tree above (request 0) next to an unconstrained request (request 1)."""
    f = ForcedDrafts(width=width)
    f.encode, f.decode = tiny_encode, decode
    nxt = torch.tensor(TINY_NXT * 2)
    sib = torch.tensor(TINY_SIB * 2)
    tok = torch.tensor(TINY_TOK * 2)
    res = TreeMaskBuilder().build([MaskRequest(matcher=tiny_matcher([OPEN])), MaskRequest()], nxt, sib, tok,
                                  len(TINY), forced=f)
    assert not res.failed and res.valid_nodes == 4  # nodes 0, 1, 3, 4
    f.upload("cpu")
    assert f._table is not None and tuple(f._table.shape) == (10, 1 + BONUS_KEYS, width, 1 + ALTERNATIVES)
    assert f.recorded_nodes == 3  # node 4's continuation is empty
    assert (f._table[:, 1:] == -1).all()  # no bonus key learned yet (the build's only root forces text)
    return f._table[:, 0]


def test_build_records_each_valid_nodes_continuation():
    """The table row of a node is the stable tokens of the text forced after that node's path; rows of invalid nodes,
    of nodes forcing nothing stable, and of unconstrained requests stay empty (-1)::

        node 0  after '{'        forces '"key":"'  -> '"' 'key' '":'   (the last '"' held back)
        node 1  after '{"'       forces 'key":"'   -> 'key' '":'
        node 2  invalid                            -> empty
        node 3  after '{"key'    forces '":"'      -> '":'
        node 4  after '{"key":'  forces '"'        -> empty (held back)
    """
    table = _tiny_build(width=6)
    e = -1
    assert table[:5, :, 0].tolist() == [[Q, KEY, QCOLON, e, e, e], [KEY, QCOLON, e, e, e, e], [e] * 6,
                                        [QCOLON, e, e, e, e, e], [e] * 6]
    assert (table[:, :, 1:] == -1).all()  # no decoder: no alternatives
    assert (table[5:] == -1).all()  # the unconstrained request
    assert _tiny_build(width=2)[:5, :, 0].tolist() == [[Q, KEY], [KEY, QCOLON], [e, e], [QCOLON, e], [e, e]]


def _load(f: ForcedDrafts, rows: Sequence[Sequence[int]],
          alternatives: Optional[Dict[Tuple[int, int], Sequence[int]]] = None) -> None:
    """After ``f.begin``: the host table of a build whose flat rows forced ``rows`` (what record() writes for
    matchers whose continuations are these tokens); ``alternatives``: (row, forced position) -> that position's prefix
    alternatives."""
    assert f._host is not None
    for row, toks in enumerate(rows):
        f._host[row, 0, : len(toks), 0] = toks
    for (row, pos), alts in (alternatives or {}).items():
        f._host[row, 0, pos, 1 : 1 + len(alts)] = alts


def _forced_after(rows: Sequence[Sequence[int]], accept_index: Sequence[Any], rids: Sequence[str], n: int,
                  alternatives: Optional[Dict[Tuple[int, int], Sequence[int]]] = None,
                  width: int = 4) -> ForcedDrafts:
    """A ForcedDrafts whose step (``len(rids)`` trees of ``n`` nodes) had the table :func:`_load` writes and then
    accepted ``accept_index`` (flat rows, -1 padded)."""
    f = ForcedDrafts(width=width)
    f.begin(len(rids) * n)
    _load(f, rows, alternatives)
    f.upload("cpu")
    f.after_verify(torch.tensor(accept_index, dtype=torch.int32), list(rids))
    return f


AB_ACCEPTED = [[0, 1, -1, -1], [4, -1, -1, -1]]  # request a accepted nodes 0 and 1 (row 1), b only its root (row 4)


def _ab(rows: Sequence[Sequence[int]]):
    """Two requests ``a``, ``b`` on chains of 4 nodes after a step that accepted :data:`AB_ACCEPTED`: (forced, links)."""
    return _forced_after(rows, AB_ACCEPTED, ["a", "b"], 4), _chain(2, 4)


def test_next_step_gets_the_accepted_nodes_forced_tokens_on_its_top_path():
    rows = [[], [50, 51, 52, 53], [], [], [60, 61, 62], [], [], []]
    f, nxt = _ab(rows)
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])  # roots = the first forced tokens
    f.apply(draft, nxt, ["a", "b"])
    assert draft.tolist() == [50, 51, 52, 53, 60, 61, 62, 9]
    # the counts land with the next verify: it accepts a's first two forced drafts and nothing of b
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, 1, 2, -1], [4, -1, -1, -1]], dtype=torch.int32), ["a", "b"])
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (5, 5, 2, 2)


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
    nxt = _chain(3, n)
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
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (3, 2, 3, 2)


def test_changed_accepted_counts_only_accepted_replacements_that_differ_from_the_draft_models_proposal():
    """An accepted forced token the draft model had proposed itself is not a win of the replacement: it counts in
    ``accepted``, not in ``changed_accepted``; a replacement that differs and is rejected counts in neither."""
    n = 6
    nxt = torch.tensor([[1, 3, -1, 5, -1, -1]])  # top path 0 -> 1 -> 3 -> 5
    f = _forced_after([[70, 71, 72, 73]] + [[]] * (n - 1), [[0, -1, -1, -1]], ["a"], n)
    draft = torch.tensor([70, 71, 2, 3, 4, 5])  # 71 unchanged; 72, 73 replace 3, 5
    f.apply(draft, nxt, ["a"])
    f.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])  # the target took 71, then diverged
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (3, 2, 1, 0)
    # the next step: a changed replacement accepted, an unchanged one rejected
    f2 = _forced_after([[70, 71, 72, 73]] + [[]] * (n - 1), [[0, -1, -1, -1]], ["a"], n)
    draft = torch.tensor([70, 9, 2, 72, 4, 5])  # position 1 changes (9 -> 71), 3 stays 72, 5 changes
    f2.apply(draft, nxt, ["a"])
    f2.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])
    assert (f2.proposed, f2.changed, f2.accepted, f2.changed_accepted) == (3, 2, 1, 1)


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


@pytest.fixture(scope="module")
def dec():
    tok = hf_tokenizer(VOCAB)
    return lambda ids: tok.decode(ids)


def test_prefix_alternatives_are_other_single_tokens_spelling_a_prefix_of_the_forced_text(enc, dec):
    """Each alternative of position i decodes to a prefix of the text left at token i, is not the forced token, and
    there are at most ``limit``; position 0 (the root check) has none. Over JSON-like forced texts some exist."""
    total = 0
    for s in ['","age":', '{"name":"', '"},{"id":', '"]}', '","tags":["', ':{"x":']:
        toks = stable_tokens(enc, s)
        alts = prefix_alternatives(enc, dec, s, toks, limit=3)
        assert len(alts) <= len(toks) and (not alts or alts[0] == ())
        off = 0
        for i, a in enumerate(alts):
            rest = s[off:]
            assert len(a) <= 3 and len(set(a)) == len(a)
            for t in a:
                assert t != toks[i] and rest.startswith(dec([t])) and dec([t]), (s, i, t)
            off += len(dec([toks[i]]))
        total += sum(len(a) for a in alts)
    assert total > 0


def test_prefix_alternatives_stop_where_the_tokens_do_not_spell_the_text(enc, dec):
    s = '","age":'
    toks = stable_tokens(enc, s)
    assert len(toks) >= 2
    bad = (toks[0], enc("zz")[0]) + tuple(toks[2:])  # token 1 spells something else
    alts = prefix_alternatives(enc, dec, s, bad)
    assert len(alts) == 2  # positions 0 and 1 looked up, nothing past the mismatch


def test_the_draft_models_own_tokenization_of_the_forced_text_is_kept():
    """Where the draft model proposed a prefix alternative of a forced position, the replacement stops there: the
    draft's own path from that position on is kept (it is the target's likely tokenization); elsewhere the forced
    tokens replace the draft as before."""
    n = 4
    rows = [[], [50, 51, 52, 53], [], [], [60, 61, 62], [], [], []]
    # request a: 90 / 91 spell a prefix of what 52 starts; request b: 80 of what 61 starts
    f = _forced_after(rows, AB_ACCEPTED, ["a", "b"], n, alternatives={(1, 2): [90, 91], (4, 1): [80]})
    nxt = _chain(2, n)
    draft = torch.tensor([50, 7, 91, 9, 60, 5, 8, 9])  # a: 7 is junk (replaced), 91 an alternative (kept, and 9 after it)
    f.apply(draft, nxt, ["a", "b"])  # b: 5 is junk at position 1: replaced, and position 2 too
    assert draft.tolist() == [50, 51, 91, 9, 60, 61, 62, 9]
    f.after_verify(torch.tensor([[0, 1, 2, 3], [4, -1, -1, -1]], dtype=torch.int32), ["a", "b"])
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (3, 3, 1, 1)
    # an alternative at the first drafted position: nothing replaced
    rows = [[], [50, 51, 52], [], [], [], [], [], []]
    g = _forced_after(rows, AB_ACCEPTED, ["a", "b"], n, alternatives={(1, 1): [51, 92]})
    draft = torch.tensor([50, 92, 8, 9, 0, 0, 0, 0])
    g.apply(draft, nxt, ["a", "b"], chain=True)
    assert draft.tolist()[:4] == [50, 92, 8, 9]
    # a draft token equal to the forced one is no reason to stop, even listed among the alternatives
    h = _forced_after(rows, AB_ACCEPTED, ["a", "b"], n, alternatives={(1, 1): [51]})
    draft = torch.tensor([50, 51, 8, 9, 0, 0, 0, 0])
    h.apply(draft, nxt, ["a", "b"], chain=True)
    assert draft.tolist()[:4] == [50, 51, 52, 9]


def test_build_records_prefix_alternatives_with_a_decoder():
    """With ``decode`` set, each recorded position carries its prefix alternatives (see
    :func:`test_prefix_alternatives_hand_worked`), -1 padded to ``ALTERNATIVES``::

        node 0  '"' 'key' '":'   position 1 ('key'): 'k', 'ke'; position 2 ('":'): '"'
        node 1  'key' '":'       position 1 ('":'): '"'
        node 3  '":'             none (position 0 is the root check)
    """
    table = _tiny_build(width=6, decode=tiny_decode)
    e = [-1] * ALTERNATIVES
    alts = table[:, :, 1:].tolist()
    assert alts[0][:3] == [e, [K, KE, -1, -1], [Q, -1, -1, -1]]
    assert alts[1][:2] == [e, [Q, -1, -1, -1]]
    assert all(row == e for node in (2, 3, 4) for row in alts[node])
    assert all(row == e for node in (0, 1) for row in alts[node][3 if node == 0 else 2:])
    assert all(row == e for node in range(5, 10) for row in alts[node])
    assert table[:5, :, 0].tolist() == _tiny_build(width=6)[:5, :, 0].tolist()  # the forced tokens are unchanged


def test_a_failed_batched_walk_leaves_no_row_of_its_own(enc):
    """The lockstep walk records rows (round 1: the first drafts) before request 1's matcher raises at its second
    draft. The per-request rebuild that follows records no row (forced rows come from the lockstep walk only), so the
    table keeps nothing of the failed attempt: every row is empty (32-node trees: the table is exactly the build's
    rows)."""
    ids = _doc_ids()
    n, width = 32, 6
    f = ForcedDrafts(width=width)
    f.encode = enc
    nxt = torch.full((2, n), -1, dtype=torch.int64)
    nxt[0, 0] = 1
    nxt[1, :3] = torch.tensor([1, 2, 3])
    sib = torch.full((2, n), -1, dtype=torch.int64)
    tok = torch.zeros((2, n), dtype=torch.int64)
    tok[0, :2] = torch.tensor(ids[1:3])
    tok[1, :4] = torch.tensor(ids[1:5])
    assert ids[3] not in (ids[2], ids[4])  # the armed token is request 1's second draft only
    bad = G.matcher("nested", VOCAB, ids[:2], cls=RaisingMatcher)
    bad.armed = ids[3]
    res = TreeMaskBuilder().build([MaskRequest(matcher=G.matcher("nested", VOCAB, ids[:2])), MaskRequest(matcher=bad)],
                                  nxt, sib, tok, VOCAB, forced=f)
    assert res.failed == [(1, f"RuntimeError: boom: token {ids[3]}")]
    # the failed attempt did record rows: round 1, both first drafts (the same state, which forces a continuation)
    assert f.continuation(G.matcher("nested", VOCAB, ids[:3])) and f.recorded_nodes == 2
    f.upload("cpu")
    assert f._table is not None and tuple(f._table.shape) == (2 * n, 1 + BONUS_KEYS, width, 1 + ALTERNATIVES) and bool((f._table == -1).all())


def test_a_batch_encoder_gives_the_same_tokens_and_alternatives_in_one_call_each(enc, dec):
    """``encode_batch`` (the same tokenization, many strings per call) changes nothing in what is found -- held-back
    tails, alternatives, the stop at a token that does not spell the text -- and tokenizes each function's strings in
    one call."""
    calls: List[int] = []

    def batch(texts: Sequence[str]) -> List[List[int]]:
        calls.append(len(texts))
        return [list(enc(t)) for t in texts]

    for s in ['","age":', '{"name":"', '"},{"id":', '"]}', ': ', 'alpha beta', '']:
        calls.clear()
        toks = stable_tokens(enc, s)
        assert stable_tokens(enc, s, batch) == toks and len(calls) == 1, s
        calls.clear()
        assert prefix_alternatives(enc, dec, s, toks, encode_batch=batch) == prefix_alternatives(enc, dec, s, toks)
        assert len(calls) <= 1, s
    bad = (enc('","')[0], enc("zz")[0], enc("age")[0])
    assert (prefix_alternatives(enc, dec, '","age":', bad, encode_batch=batch)
            == prefix_alternatives(enc, dec, '","age":', bad))
    # through the cache: a forced string met first costs two batch calls, then none
    f = ForcedDrafts(width=8)
    f.encode, f.decode, f.encode_batch = enc, dec, batch
    m = G.matcher("nested", VOCAB)
    ref = ForcedDrafts(width=8)
    ref.encode, ref.decode = enc, dec
    fresh_seen = 0
    for t in _doc_ids()[:60]:
        calls.clear()
        s = m.find_jump_forward_string()
        fresh = bool(s) and (s, False) not in f._cache
        got, want = f._entry(m), ref._entry(m)
        assert len(calls) in ((1, 2) if fresh else (0,)), (s, calls)
        fresh_seen += fresh
        assert (got is None) == (want is None), s
        if got is not None and want is not None:
            assert got[0] == want[0] and (got[1] == want[1]).all(), s
        assert m.accept_token(t)
    assert fresh_seen >= 3
