"""``core/forced.py`` at its edges (written for the mutation run's survivors, see ``tests/core/MUTANTS.md``): the
table's buffer across builds, rows out of range, the encoder cache's bound, and the prefix-alternative lookup's
limits. Hand-worked values on the tiny vocabulary of ``test_forced_drafts.py`` or on encoders written here."""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from sglang_eagle_overlap.core import forced as forced_mod
from sglang_eagle_overlap.core.forced import ALTERNATIVES, BONUS_KEYS, ForcedDrafts, prefix_alternatives
from tests.core.test_forced_drafts import (CLOSE, K, KE, KEY, OPEN, Q, QCOLON, _ab, _chain, _forced_after, _load,
                                           tiny_decode, tiny_encode)


class Forcing:
    """A matcher stand-in (``JumpForward``) whose state forces ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def find_jump_forward_string(self) -> str:
        return self.text


def _forced(width: int = 4) -> ForcedDrafts:
    f = ForcedDrafts(width=width)
    f.encode = tiny_encode
    return f


def _tokens(f: ForcedDrafts) -> List[List[int]]:
    """The uploaded table's forced tokens, row by row."""
    f.upload("cpu")
    assert f._table is not None
    return f._table[:, 0, :, 0].tolist()


def test_width_below_two_is_refused():
    with pytest.raises(ValueError, match=r"^forced-draft width must be >= 2 \(the root check and one draft\), got 1$"):
        ForcedDrafts(width=1)
    assert ForcedDrafts(width=2).width == 2


def test_each_build_starts_from_empty_rows_and_the_buffer_grows_with_the_tree():
    """Rows recorded by one build are gone in the next (``begin``), whether the buffer is reused (3 rows, then 2) or
    regrown (past its first 64 rows); only rows below ``begin``'s count are recorded or uploaded."""
    f = _forced(width=4)
    e = [-1] * 4
    f.begin(3)
    f.record(Forcing('"key":"'), 0)
    f.record(Forcing('":"'), 2)
    f.record(Forcing('":"'), 3)  # past this build's rows: not recorded
    assert _tokens(f) == [[Q, KEY, QCOLON, -1], e, [QCOLON, -1, -1, -1]]
    assert f.recorded_nodes == 2
    f.begin(2)
    f.record(Forcing('":"'), 1)
    assert _tokens(f) == [e, [QCOLON, -1, -1, -1]]  # row 0 of the last build is empty again
    f.begin(70)
    f.record(Forcing('":"'), 69)
    rows = _tokens(f)
    assert len(rows) == 70 and rows[69] == [QCOLON, -1, -1, -1] and all(r == e for r in rows[:69])


def test_nothing_is_recorded_before_the_first_build_and_an_empty_build_uploads_no_table():
    f = _forced()
    f.record(Forcing('"key":"'), 0)  # no begin yet: no table to write
    assert f.recorded_nodes == 0
    f.upload("cpu")
    assert f._table is None
    f.begin(0)
    f.upload("cpu")
    assert f._table is None


def test_clear_rows_forgets_exactly_the_rows_given():
    f = _forced(width=2)
    f.begin(4)
    for row in range(4):
        f.record(Forcing('{"key":"'), row)
    f.clear_rows(1, 3)
    assert _tokens(f) == [[OPEN, Q], [-1, -1], [-1, -1], [OPEN, Q]]


def test_the_continuation_cache_is_bounded(monkeypatch):
    """Past ``_CACHE_MAX`` forced strings the cache starts over (a long-running server sees unboundedly many): it
    never holds more, and what it gives is unchanged."""
    monkeypatch.setattr(forced_mod, "_CACHE_MAX", 2)
    f = _forced()
    texts = ['"key":"', '":"', "}", '"key":"']
    got = []
    for text in texts:
        got.append(f.continuation(Forcing(text)))
        assert len(f._cache) <= 2
    assert got == [(Q, KEY, QCOLON), (QCOLON,), (CLOSE,), (Q, KEY, QCOLON)]
    assert set(f._cache) == {("}", False), ('"key":"', False)}  # cleared at the third string, then refilled


def test_a_state_that_forces_nothing_has_no_continuation_and_no_row():
    f = _forced()
    f.begin(2)
    f.record(Forcing(""), 0)
    f.record(Forcing('"'), 1)  # forced, but all of it held back
    assert f.continuation(Forcing("")) == () and f.continuation(Forcing('"')) == ()
    assert f.recorded_nodes == 0 and _tokens(f) == [[-1] * 4, [-1] * 4]


def test_a_token_that_decodes_to_nothing_stops_the_lookup():
    """A token whose text is empty (a special token) cannot be placed in the forced text: it is looked up (its position
    gets the tokens spelling a prefix from there on) but positions past it get nothing."""

    def decode(ids: Sequence[int]) -> str:
        return "" if list(ids) == [0] else tiny_decode(ids)

    s = '"key":"'
    assert prefix_alternatives(tiny_encode, decode, s, (Q, 0, QCOLON)) == ((), (K, KE, KEY))
    assert prefix_alternatives(tiny_encode, decode, s, (Q, KEY, QCOLON)) == ((), (K, KE), (Q,))


def _x_tokens(s: str) -> List[int]:
    """An encoder in which every run of up to 30 'x' is one token (its id: its length)."""
    out = []
    while s:
        k = len(s) - len(s.lstrip("x"))
        if k == 0:
            out.append(99)
            s = s[1:]
            continue
        out.append(min(k, 30))
        s = s[min(k, 30):]
    return out


def _x_decode(ids: Sequence[int]) -> str:
    return "".join("x" * i for i in ids)


def test_alternatives_are_single_tokens_of_at_most_sixteen_characters():
    """The lookup tries prefixes up to 16 characters (a longer single token is not looked for, nor a longer prefix
    tokenized), shortest first, up to ``limit``. Forced: 'x' then 'x' * 20 (one token); the prefixes of the 20 x's
    are tokens 1..20."""
    s = "x" * 21
    toks = (1, 20)
    assert prefix_alternatives(_x_tokens, _x_decode, s, toks, limit=100) == ((), tuple(range(1, 17)))
    assert prefix_alternatives(_x_tokens, _x_decode, s, toks) == ((), (1, 2, 3, 4))
    seen: List[str] = []

    def batch(texts: Sequence[str]) -> List[List[int]]:
        seen.extend(texts)
        return [_x_tokens(t) for t in texts]

    prefix_alternatives(_x_tokens, _x_decode, s, toks, encode_batch=batch)
    assert max(len(t) for t in seen) == 16


def test_each_prefix_is_tokenized_once():
    """Positions whose texts overlap share prefixes: each distinct one goes to the encoder once."""
    seen: List[str] = []

    def batch(texts: Sequence[str]) -> List[List[int]]:
        seen.extend(texts)
        return [tiny_encode(t) for t in texts]

    s = '":":":'  # '":' three times: positions 1 and 2 look up '"', '":', '":"', ... from offsets 2 and 4
    toks = tuple(tiny_encode(s))
    assert toks == (QCOLON, QCOLON, QCOLON)
    assert prefix_alternatives(tiny_encode, tiny_decode, s, toks, encode_batch=batch) == ((), (Q,), (Q,))
    assert len(seen) == len(set(seen)) and set(seen) == {'"', '":', '":"', '":":'}


def test_the_table_has_one_column_per_alternative_and_the_forced_token():
    f = _forced(width=3)
    f.decode = tiny_decode
    f.begin(1)
    f.record(Forcing('"key":"'), 0)
    f.upload("cpu")
    assert f._table is not None and tuple(f._table.shape) == (1, 1 + BONUS_KEYS, 3, 1 + ALTERNATIVES)
    assert f._table[0, 0].tolist() == [[Q, -1, -1, -1, -1], [KEY, K, KE, -1, -1], [QCOLON, Q, -1, -1, -1]]
    assert isinstance(f._table, torch.Tensor) and f._table.dtype == torch.int32


# -- the device side: what after_verify keeps and apply writes, at the edges of its inputs -------------------------


def test_the_last_row_of_the_table_can_be_picked():
    """One request whose verify accepted its whole chain (nodes 0..3): the pick is the table's last row."""
    f = _forced_after([[], [], [], [50, 51, 52, 53]], [[0, 1, 2, 3]], ["a"], 4)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 51, 52, 53]


@pytest.mark.parametrize("accept_index", [
    [[0, 1, -1, -1]],  # one row for a batch of two
    [0, 1, 4, -1],  # not [bs, depth + 1]
], ids=["rows-differ", "one-dimensional"])
def test_a_verify_result_that_is_not_the_batchs_keeps_nothing(accept_index):
    """``after_verify`` given an accept index that does not have one row per request keeps no pick: the next step's
    drafts stay as the draft model wrote them (without an error)."""
    f = _forced_after([[], [50, 51, 52, 53], [], [], [60, 61, 62], [], [], []], accept_index, ["a", "b"], 4)
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, _chain(2, 4), ["a", "b"])
    assert draft.tolist() == [50, 7, 8, 9, 60, 7, 8, 9]


def test_a_step_without_a_table_keeps_nothing():
    """A build that recorded no table (no rows) and then a verify: the next step's drafts are left alone."""
    f = ForcedDrafts(width=4)
    f.begin(0)
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 7, 8, 9]


def test_a_discarded_step_counts_none_of_its_replacements():
    """Drafts replaced by ``apply`` in a step that then goes to another verify path (``discard``) are not counted by
    the next ``after_verify``."""
    f = _forced_after([[], [50, 51, 52, 53], [], []], [[0, 1, -1, -1]], ["a"], 4)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 51, 52, 53]
    f.discard()
    f.after_verify(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), ["a"])
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (0, 0, 0, 0)


@pytest.mark.parametrize("next_token", [torch.full((1, 4), -1), torch.full((2,), -1)], ids=["rows-differ", "flat"])
def test_links_that_are_not_the_batchs_replace_nothing(next_token):
    """``apply`` given first-child links without one row per request (or not 2-D) leaves the drafts alone."""
    f, _ = _ab([[], [50, 51, 52, 53], [], [], [], [], [], []])
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, next_token, ["a", "b"])
    assert draft.tolist() == [50, 7, 8, 9, 60, 7, 8, 9]


@pytest.mark.parametrize("chain", [True, False])
def test_the_replacement_stops_at_the_trees_last_node(chain):
    """A chain of 3 nodes after a verify 3 drafts deep, 4 forced tokens at hand: only nodes 1 and 2 can take them
    (levels = n - 1 = 2); request b's root, right after a's last node, is never written."""
    f = _forced_after([[], [50, 51, 52, 53], [], [], [], []], [[0, 1, -1, -1], [3, -1, -1, -1]], ["a", "b"], 3,
                      width=5)
    draft = torch.tensor([50, 7, 8, 60, 7, 8])
    f.apply(draft, _chain(2, 3), ["a", "b"], chain=chain)
    assert draft.tolist() == [50, 51, 52, 60, 7, 8]


@pytest.mark.parametrize("chain", [True, False])
def test_the_replacement_stops_at_the_tables_width(chain):
    """Width 2 (the root check and one draft): whatever the tree's depth (4 nodes) and the verify's (3 drafts), one
    draft is replaced."""
    f = _forced_after([[], [50, 51], [], []], [[0, 1, -1, -1]], ["a"], 4, width=2)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"], chain=chain)
    assert draft.tolist() == [50, 51, 8, 9]


def test_a_request_in_the_first_row_of_a_changed_batch_still_gets_its_tokens():
    """The batch changed (``b`` left, ``c`` is new) and the request kept (``a``) was the previous step's first row: its
    forced tokens are still found (row 0 of the previous step is a row like any other)."""
    f, nxt = _ab([[], [50, 51, 52], [], [], [], [], [], []])
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, nxt, ["a", "c"])
    assert draft.tolist() == [50, 51, 52, 9, 60, 7, 8, 9]


def test_chain_positions_are_cached_per_shape():
    """One ForcedDrafts over steps of two shapes (2 chains of 4, then 1 chain of 6): each step's positions are its own
    shape's, and a shape met again reuses its positions."""
    f, nxt = _ab([[], [50, 51, 52, 53], [], [], [], [], [], []])
    draft = torch.tensor([50, 7, 8, 9, 60, 7, 8, 9])
    f.apply(draft, nxt, ["a", "b"], chain=True)
    assert draft.tolist() == [50, 51, 52, 53, 60, 7, 8, 9]
    g_rows = [[], [], [70, 71, 72, 73], [], [], []]
    f.begin(6)
    _load(f, g_rows)
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, 1, 2, -1]], dtype=torch.int32), ["a"])
    draft = torch.tensor([70, 7, 8, 9, 5, 5])
    f.apply(draft, _chain(1, 6), ["a"], chain=True)
    assert draft.tolist() == [70, 71, 72, 73, 5, 5]
    cpu = torch.device("cpu")
    assert f._positions(2, 4, 3, cpu) is f._positions(2, 4, 3, cpu)
    assert f._positions(1, 6, 3, cpu).tolist() == [1, 2, 3]


def test_token_zero_is_a_forced_token_like_any_other():
    """Token id 0 is an ordinary token in many vocabularies ('!' in GPT-2's): forced, it replaces a draft."""
    f = _forced_after([[], [50, 0, 52], [], []], [[0, 1, -1, -1]], ["a"], 4)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 0, 52, 9]


def test_int32_links_take_the_same_path():
    """First-child links given as int32 (the gather needs int64 indices: they are converted)."""
    f = _forced_after([[], [50, 51, 52, 53], [], []], [[0, 1, -1, -1]], ["a"], 4)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4).to(torch.int32), ["a"])
    assert draft.tolist() == [50, 51, 52, 53]


def test_a_top_path_shorter_than_the_forced_tokens_keeps_what_it_replaced():
    """A tree whose top path (the first-child chain from the root) ends after one draft::

        0 ── 1          top path: node 1 only; forced 51, 52, 53 -> node 1 takes 51
        2 ── 3          (the first-child links of nodes not on the top path: left alone)

    The levels past the path's end must not undo node 1's replacement, nor count anything."""
    f = _forced_after([[], [50, 51, 52, 53], [], []], [[0, 1, -1, -1]], ["a"], 4)
    nxt = torch.tensor([[1, -1, 3, -1]])
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, nxt, ["a"])
    assert draft.tolist() == [50, 51, 8, 9]
    f.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])
    assert (f.proposed, f.changed, f.accepted, f.changed_accepted) == (1, 1, 1, 1)


def test_the_draft_models_first_alternative_stops_the_replacement_too():
    """The draft token at position 2 is the first of that position's prefix alternatives: kept, and everything below
    it (the replacement is a prefix of the top path)."""
    f = _forced_after([[], [50, 51, 52, 53], [], []], [[0, 1, -1, -1]], ["a"], 4)
    assert f._picked is not None
    rows = f._picked[1].clone()
    rows[0, 0, 2, 1:3] = torch.tensor([90, 91])  # position 2's alternatives: 90, then 91
    f._picked = (f._picked[0], rows, f._picked[2])
    draft = torch.tensor([50, 7, 90, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 51, 90, 9]


def test_a_fresh_forced_drafts_does_nothing_before_its_first_build():
    """The first verify step of a server: ``apply`` before any ``after_verify``, and ``after_verify`` before any
    ``upload``, keep and replace nothing (and do not fail)."""
    f = ForcedDrafts(width=4)
    draft = torch.tensor([50, 7, 8, 9])
    f.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 7, 8, 9]
    g = ForcedDrafts(width=4)
    g.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])
    g.apply(draft, _chain(1, 4), ["a"])
    assert draft.tolist() == [50, 7, 8, 9] and (g.proposed, g.accepted) == (0, 0)


def test_upload_without_a_device_keeps_the_table_on_the_host():
    f = _forced(width=2)
    f.begin(1)
    f.record(Forcing('"key":"'), 0)
    f.upload(None)
    assert f._table is not None and f._table.device.type == "cpu" and f._table[0, 0, :, 0].tolist() == [Q, KEY]


def test_the_host_table_is_reused_while_it_is_large_enough():
    """One buffer for every build that fits (its first size is at least 64 rows): no allocation per step."""
    f = _forced(width=4)
    f.begin(10)
    buf = f._host
    for rows in (3, 64, 64, 10):
        f.begin(rows)
        assert f._host is buf, rows
    f.begin(65)
    assert f._host is not buf and f._host is not None and f._host.shape[0] == 65


def test_with_a_batch_encoder_every_lookup_goes_through_it():
    """``encode_batch`` set: a forced string seen first costs exactly two batch calls (its probes, then its prefixes)
    and no call of ``encode`` per string; a string with nothing to look up (one token) costs no prefix call."""
    calls: List[int] = []
    single: List[str] = []

    def batch(texts: Sequence[str]) -> List[List[int]]:
        calls.append(len(texts))
        return [tiny_encode(t) for t in texts]

    def encode(s: str) -> List[int]:
        single.append(s)
        return tiny_encode(s)

    f = ForcedDrafts(width=4)
    f.encode, f.decode, f.encode_batch = encode, tiny_decode, batch
    assert f.continuation(Forcing('"key":"')) == (Q, KEY, QCOLON)
    assert len(calls) == 2 and single == []
    calls.clear()
    assert f.continuation(Forcing("}")) == (CLOSE,)
    assert len(calls) == 1 and single == []  # the probes only: position 0 has no alternatives to look up
    calls.clear()
    assert prefix_alternatives(encode, tiny_decode, "}", (CLOSE,), encode_batch=batch) == ((),)
    assert calls == [] and single == []
