"""The forced text's unstable tail as drafts: the last tokens of ``encode(forced text)`` that could merge with what the
model writes next (a key's ``'":"'`` before the value) are drafted too with ``draft_tail``; the tokens a following
character merged them into are that position's alternatives, so a draft model that writes the merge keeps its token.
Hand-worked on the tiny vocabulary of ``test_forced_drafts.py`` (``'"'`` followed by ``a`` or ``,`` is one token,
``'b"'`` followed by ``}`` too)."""

from __future__ import annotations

import pytest
import torch

from sglang_eagle_overlap.core import MaskRequest
from sglang_eagle_overlap.core.forced import ForcedDrafts, ForcedTokens, stable_tokens, tokenize_forced
from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from tests.core.test_forced_drafts import (CLOSE, KEY, OPEN, Q, QA, QCOLON, QCOMMA, A, B, BQCLOSE, TINY, _chain,
                                           tiny_decode, tiny_encode, tiny_matcher)


@pytest.mark.parametrize("s, want", [
    # the closing '"' merges with a following 'a' or ','
    ('{"key":"', ForcedTokens((OPEN, Q, KEY, QCOLON, Q), 4, ((), (), (), (), (QA, QCOMMA)))),
    # 'b"' + '}' is one token: position 1 merges, and position 2's '"' merges with 'a' or ','
    ('ab"', ForcedTokens((A, B, Q), 1, ((), (BQCLOSE,), (QA, QCOMMA)))),
    ("}", ForcedTokens((CLOSE,), 1, ((),))),  # nothing merges
    ("", ForcedTokens((), 0, ())),
])
def test_tokenize_forced_hand_worked(s, want):
    """The tokens, the stable prefix every probe keeps, and per tail position the tokens the probes merged there
    (first seen first); ``stable_tokens`` is the stable prefix; the batch encoder gives the same."""
    assert tokenize_forced(tiny_encode, s) == want
    assert tokenize_forced(tiny_encode, s, lambda texts: [tiny_encode(t) for t in texts]) == want
    assert stable_tokens(tiny_encode, s) == want.tokens[: want.stable]


def _recorded(draft_tail: bool, prefix=(OPEN,), width: int = 8) -> list:
    """Slot 0 of one root node recorded at ``prefix`` (tokens, then each position's alternatives)."""
    f = ForcedDrafts(width=width, draft_tail=draft_tail)
    f.encode, f.decode = tiny_encode, tiny_decode
    f.begin(1)
    f.record(tiny_matcher(prefix), 0)
    f.upload("cpu")
    assert f._table is not None
    return f._table[0, 0].tolist()


def test_with_draft_tail_the_merging_tail_is_drafted_with_its_merges_as_alternatives():
    """At '{' the grammar forces '"key":"'. Held back: '"' 'key' '":' (the last '"' may merge). Drafted: '"' 'key' '":'
    '"', and the last position's alternatives are the merges '"a' and '",' (its prefix alternatives: none, '"' is one
    character); the other positions keep their prefix alternatives ('k', 'ke' for 'key'; '"' for '":')."""
    e = [-1] * 4
    held = _recorded(False)
    assert [r[0] for r in held] == [Q, KEY, QCOLON] + [-1] * 5
    tail = _recorded(True)
    assert [r[0] for r in tail] == [Q, KEY, QCOLON, Q] + [-1] * 4
    assert tail[3][1:] == [QA, QCOMMA, -1, -1]
    assert tail[:3] == held[:3] and tail[4:] == [[-1] + e] * 4
    # the width bounds the tail as it bounds the rest
    assert [r[0] for r in _recorded(True, width=3)] == [Q, KEY, QCOLON]


def test_a_text_that_is_all_tail_is_drafted_only_with_draft_tail():
    """After '{"key":' the forced text is '"', which may merge whole: nothing held back is left; drafted, it is one
    token with the merges as alternatives."""
    assert _recorded(False, (OPEN, Q, KEY, QCOLON))[0][0] == -1
    assert _recorded(True, (OPEN, Q, KEY, QCOLON))[0] == [Q, QA, QCOMMA, -1, -1]


@pytest.mark.parametrize("old, want", [
    (A, Q),  # the draft model's guess differs: the tail replaces it
    (QA, QA),  # it wrote a merge ('"a': the value starts with 'a'): its token is kept
])
def test_the_next_step_drafts_the_tail_unless_the_draft_model_wrote_a_merge(old, want):
    """A build at '{' (its root node forces '"key":"'), the verify accepts the root only, and the target writes '"':
    the next step's chain '"' b b <old> gets 'key' '":' and the tail '"' below the root, except where the draft
    model's own token at the tail's position is one of its merges."""
    f = ForcedDrafts(width=8, draft_tail=True)
    f.encode, f.decode = tiny_encode, tiny_decode
    res = TreeMaskBuilder().build([MaskRequest(matcher=tiny_matcher([OPEN]))], torch.tensor([[1, 2, -1]]),
                                  torch.full((1, 3), -1), torch.tensor([[OPEN, Q, KEY]]), len(TINY), forced=f)
    assert not res.failed
    f.upload("cpu")
    f.after_verify(torch.tensor([[0, -1, -1, -1]], dtype=torch.int32), ["r"])
    draft = torch.tensor([Q, B, B, old])
    f.apply(draft, _chain(1, 4), ["r"], chain=True)
    assert draft.tolist() == [Q, KEY, QCOLON, want]
