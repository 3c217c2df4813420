"""Grammar-forced drafts keyed by the bonus token: where a node forces nothing itself (inside a string value), what the
grammar forces after the token the target writes there (the next step's root) goes into the node's other slots, and
the next step takes the slot whose first token is its root. Hand-worked on the tiny vocabulary and grammar of
``test_forced_drafts.py`` (every document is ``{"key":"<a or b>..."}``)."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from tests.core.test_forced_drafts import (CLOSE, KE, KEY, OPEN, Q, QA, QCOLON, A, B, K, TINY, _chain, tiny_decode,
                                           tiny_encode, tiny_matcher)

IN_VALUE = (OPEN, Q, KEY, QCOLON, QA)  # '{"key":"a': inside the value, nothing forced ('a', 'b' or '"' may follow)


def _forced(width: int = 4, bonus_keys: int = 3) -> ForcedDrafts:
    f = ForcedDrafts(width=width, bonus_keys=bonus_keys)
    f.encode, f.decode = tiny_encode, tiny_decode
    return f


def _learn(f: ForcedDrafts, *roots: int) -> None:
    """One build per root, each recording only its root node: a root whose own continuation is not empty counts as
    a bonus key (the roots here: '"' closing the value forces '}', '{' forces '"key":')."""
    prefixes = {Q: IN_VALUE + (B, Q), OPEN: (OPEN,)}
    for root in roots:
        f.begin(2, 2, [root])
        f.record(tiny_matcher(prefixes[root]), 0)


def _slots(f: ForcedDrafts, row: int) -> list:
    """The uploaded table's tokens of ``row``, slot by slot."""
    f.upload("cpu")
    assert f._table is not None
    return f._table[row, :, :, 0].tolist()


def test_a_node_that_forces_nothing_gets_the_continuation_after_each_allowed_bonus_key():
    """Learned keys: '"' twice, '{' once (most frequent first). At '{"key":"a' the node's own slot is empty; '"' is
    allowed there and forces '}' after it: slot 1 is ['"', '}']; '{' is not allowed there: no slot. The matcher is
    left in its node's state."""
    f = _forced()
    _learn(f, Q, OPEN, Q)
    f.begin(1, 1, [QA])
    m = tiny_matcher(IN_VALUE)
    f.record(m, 0)
    e = [-1] * 4
    assert _slots(f, 0) == [e, [Q, CLOSE, -1, -1], e, e]
    assert f.recorded_nodes == 3 and f.recorded_keyed == 1  # the three learning roots, then this node
    assert f.continuation(m) == () and m.accept_token(B) and not m.is_terminated()  # still inside the value


def test_a_node_with_its_own_continuation_tries_no_key_and_keys_need_a_learned_root():
    f = _forced()
    f.begin(1, 1, [OPEN])
    f.record(tiny_matcher(IN_VALUE), 0)  # nothing learned yet: no key to try
    assert _slots(f, 0) == [[-1] * 4] * 4 and f.recorded_keyed == 0
    _learn(f, Q)
    f.begin(1, 1, [QCOLON])
    f.record(tiny_matcher((OPEN, Q, KEY)), 0)  # forces '":' itself: slot 0 only
    assert _slots(f, 0) == [[QCOLON, -1, -1, -1]] + [[-1] * 4] * 3 and f.recorded_keyed == 0


def test_no_bonus_slots_when_switched_off():
    f = _forced(bonus_keys=0)
    _learn(f, Q)
    f.begin(1, 1, [QA])
    f.record(tiny_matcher(IN_VALUE), 0)
    assert _slots(f, 0) == [[-1] * 4] and f.recorded_keyed == 0
    with pytest.raises(ValueError, match="bonus keys must be >= 0"):
        ForcedDrafts(bonus_keys=-1)


def test_only_the_most_frequent_keys_are_tried():
    """One key per node: '"' (learned twice) before '{' (once); the other order would try only '{', not allowed at
    '{"key":"a', and leave the node without a slot."""
    f = _forced(bonus_keys=1)
    _learn(f, OPEN, Q, Q)
    f.begin(1, 1, [QA])
    f.record(tiny_matcher(IN_VALUE), 0)
    assert _slots(f, 0) == [[-1] * 4, [Q, CLOSE, -1, -1]]


def test_the_key_count_is_bounded_and_keeps_the_frequent_keys(monkeypatch):
    """Past ``_KEYS_MAX`` counted tokens the rarer half is forgotten and the rest halved (at least 1 each)."""
    from sglang_eagle_overlap.core import forced as forced_mod

    monkeypatch.setattr(forced_mod, "_KEYS_MAX", 4)
    f = ForcedDrafts(bonus_keys=2)
    for t in [10, 10, 10, 10, 10, 9, 9, 8, 7]:  # the frequent tokens are not the smallest ids
        f._learn_key(t)
    assert f._key_counts == {10: 5, 9: 2, 8: 1, 7: 1}
    f._learn_key(11)  # a fifth token: keep 10 and 9, halved (rounded down)
    assert f._key_counts == {10: 2, 9: 1} and all(type(c) is int for c in f._key_counts.values())
    f.begin(1)
    assert f._keys == (10, 9)


class _KeyedStandIn:
    """A matcher stand-in forcing nothing in its state and ``after[t]`` after a key ``t`` (``'"key":"'`` after token
    99 unless told; any other token is refused)."""

    def __init__(self, after=None) -> None:
        self.taken: list = []
        self.after = {99: '"key":"'} if after is None else after

    def find_jump_forward_string(self) -> str:
        return self.after[self.taken[0]] if len(self.taken) == 1 else ""

    def accept_token(self, t: int) -> bool:
        if t not in self.after:
            return False
        self.taken.append(t)
        return True

    def rollback(self, k: int) -> None:
        del self.taken[len(self.taken) - k:]

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("width, want", [(4, [99, Q, KEY, QCOLON]), (3, [99, Q, KEY])])
def test_a_keyed_slot_holds_the_key_and_at_most_width_minus_one_forced_tokens(width, want):
    f = _forced(width=width)
    f._key_counts = {99: 1, 5: 3}  # 5 is tried first and refused
    f.begin(1, 1, [7])
    m = _KeyedStandIn()
    f.record(m, 0)
    assert _slots(f, 0)[1] == want and m.taken == []


def _table_with_slots(rows: int, slots: dict) -> ForcedDrafts:
    """A ForcedDrafts after a build whose host table holds ``slots``: (row, slot) -> tokens."""
    f = ForcedDrafts(width=4, bonus_keys=2)
    f.begin(rows)
    assert f._host is not None
    for (row, slot), toks in slots.items():
        f._host[row, slot, : len(toks), 0] = toks
    f.upload("cpu")
    return f


@pytest.mark.parametrize("root, want", [
    (40, [40, 41, 42, 43]),  # slot 1's key
    (30, [30, 31, 8, 9]),  # slot 2's key: one forced token after it
    (50, [50, 51, 8, 9]),  # the node's own continuation
    (7, [7, 7, 8, 9]),  # no slot begins with the root: nothing replaced
])
def test_the_next_step_takes_the_slot_whose_first_token_is_its_root(root, want):
    for chain in (True, False):
        f = _table_with_slots(4, {(1, 0): [50, 51], (1, 1): [40, 41, 42, 43], (1, 2): [30, 31]})
        f.after_verify(torch.tensor([[0, 1, -1, -1]], dtype=torch.int32), ["a"])
        draft = torch.tensor([root, 7, 8, 9])
        f.apply(draft, _chain(1, 4), ["a"], chain=chain)
        assert draft.tolist() == want, chain


def test_a_changed_batch_still_finds_each_requests_slot():
    """Request b moves to the first row of the next batch and a new request c takes the second: b's keyed slot is
    found by its root, c gets nothing."""
    f = _table_with_slots(8, {(5, 1): [40, 41, 42]})
    f.after_verify(torch.tensor([[0, -1, -1, -1], [4, 5, -1, -1]], dtype=torch.int32), ["a", "b"])
    draft = torch.tensor([40, 7, 8, 9, 40, 7, 8, 9])
    f.apply(draft, _chain(2, 4), ["b", "c"])
    assert draft.tolist() == [40, 41, 42, 9, 40, 7, 8, 9]


def test_build_then_next_step_end_to_end_and_the_mask_is_unchanged():
    """Two builds through the mask builder's lockstep walk. The first (root '"' closing the value) teaches the key
    '"'. The second walks the chain 'a' 'b' below the root '"a' (inside the value); its mask equals a build without
    forced drafts (trying a key leaves the matcher where it was); the verify accepts all three nodes; the next step's
    root is '"' (the target closed the value): its first draft becomes the forced '}'."""
    def build(prefix: Sequence[int], toks: Sequence[int], forced=None):
        n = len(toks)
        nxt = torch.tensor([list(range(1, n)) + [-1]])
        sib = torch.full((1, n), -1)
        res = TreeMaskBuilder().build([MaskRequest(matcher=tiny_matcher(prefix))], nxt, sib, torch.tensor([toks]),
                                      len(TINY), forced=forced)
        assert not res.failed
        return res

    f = _forced()
    build(IN_VALUE + (B, Q), [Q, CLOSE, 0], f)
    res = build(IN_VALUE, [QA, A, B], f)
    plain = build(IN_VALUE, [QA, A, B])
    assert res.bitmask is not None and plain.bitmask is not None and torch.equal(res.bitmask, plain.bitmask)
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, 1, 2]], dtype=torch.int32), ["r"])
    draft = torch.tensor([Q, A, A])
    f.apply(draft, _chain(1, 3), ["r"])
    assert draft.tolist() == [Q, CLOSE, A]
    assert (f.proposed, f.changed) == (0, 0)  # counted by the next after_verify
    f.after_verify(torch.tensor([[0, 1, -1]], dtype=torch.int32), ["r"])
    assert (f.proposed, f.changed, f.accepted) == (1, 1, 1)


def test_each_key_gets_its_own_slot_in_key_order_and_the_node_counts_once():
    """Three learned keys the grammar allows, two slots: the two most frequent are tried and fill slots 1 and 2, in
    key order; a second such node counts as a second keyed node."""
    f = _forced(bonus_keys=2)
    f._key_counts = {40: 3, 41: 2, 42: 1}
    f.begin(2)
    for row in (0, 1):
        f.record(_KeyedStandIn({40: "}", 41: "b", 42: "a"}), row)
    assert _slots(f, 0) == [[-1] * 4, [40, CLOSE, -1, -1], [41, B, -1, -1]] and f.recorded_keyed == 2


def test_the_text_after_a_key_gets_alternatives_from_its_first_token_on():
    """After a key, the text's first token is a draft too (the key is the root check): its prefix alternatives are
    kept ('k', 'ke' for 'key'), as for every later position; a node's own text gets none at position 0."""
    f = _forced()
    f._key_counts = {99: 1}
    f.begin(2)
    f.record(_KeyedStandIn({99: 'key":"'}), 0)
    f.upload("cpu")
    assert f._table is not None
    row = f._table[0, 1].tolist()
    assert [r[0] for r in row] == [99, KEY, QCOLON, -1]
    assert row[1][1:] == [K, KE, -1, -1] and row[2][1:] == [Q, -1, -1, -1]


def test_a_row_past_the_builds_table_is_ignored():
    """``record`` / ``record_found`` / ``record_tokens`` of a row outside this build's table write nothing and raise
    nothing (the table holds at least 64 rows; a row past them too)."""
    f = _forced()
    f._key_counts = {99: 1}
    f.begin(2)
    for row in (2, 64, 500):
        f.record(_KeyedStandIn(), row)
        f.record_found([(row, -1, "}"), (row + 1, 99, "}")], [OPEN])
        f.record_tokens([CLOSE], row)
    f.upload("cpu")
    assert f._table is not None and f._table.shape[0] == 2 and (f._table == -1).all()
    assert f.recorded_nodes == 0 and f.recorded_keyed == 0


def test_a_bonus_key_may_be_token_zero():
    """Token id 0 is an ordinary token in many vocabularies: found as a key by the native walk, its text goes to a
    keyed slot (key -1 alone marks a node's own text)."""
    f = _forced()
    f.begin(2)
    f.record_found([(0, 0, "}"), (1, -1, "}")], [OPEN])
    f.upload("cpu")
    assert f._table is not None
    assert f._table[0, :, :, 0].tolist()[:2] == [[-1] * 4, [0, CLOSE, -1, -1]]
    assert f._table[1, :, :, 0].tolist()[:2] == [[CLOSE, -1, -1, -1], [-1] * 4]


def test_every_requests_root_teaches_its_key_not_only_the_first():
    """A build of two requests of 2 nodes: the second request's root (row 2) forces text, so its root token is
    counted as a key; an inner node (row 3) with text teaches nothing."""
    f = _forced()
    f.begin(4, 2, [OPEN, Q])
    f.record_found([(2, -1, "}"), (3, -1, "}")], [OPEN, Q])
    assert f._key_counts == {Q: 1}
