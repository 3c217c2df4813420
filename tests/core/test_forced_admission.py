"""Which matchers ``ForcedDrafts`` asks for forced text: with ``require_admission`` (the integration's setting) only
those whose grammar :meth:`ForcedDrafts.admit` found bounded; without it every matcher not found unbounded. Only
bounded grammars are asked here (an unbounded one would search forever: that case runs in a capped subprocess in
``test_forced_unbounded.py``)."""

from __future__ import annotations

import json

import pytest

from sglang_eagle_overlap.core.forced import ForcedDrafts

# every character of '{"next": ' and '}' alone, plus '{"' and 'next'
VOCAB = ["</s>", "{", '"', "n", "e", "x", "t", ":", " ", "}", '{"', "next"]
# an object with one optional key, recursive: '{}' ends it, so its forced text always ends
ENDS = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                           "additionalProperties": False}}, "$ref": "#/$defs/node"}


def encode(s: str) -> list:
    """Longest match first over VOCAB (ids 1..11); a character outside it encodes as 99."""
    out, i = [], 0
    while i < len(s):
        best = max((t for t in range(1, len(VOCAB)) if s.startswith(VOCAB[t], i)), key=lambda t: len(VOCAB[t]),
                   default=None)
        out.append(99 if best is None else best)
        i += 1 if best is None else len(VOCAB[best])
    return out


@pytest.fixture
def grammar():
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[0]))
    return compiler.compile_json_schema(json.dumps(ENDS), any_whitespace=False)


def _matcher(grammar):
    """A matcher after '{"': the grammar forces 'next": ' there (the only key), tokens 'next' '"' ':' ' ' = 11 2 7 8
    (no token of this vocabulary spans two of them, so none is held back)."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(grammar)
    assert m.accept_string('{"')
    return m


@pytest.mark.parametrize("require_admission", [True, False])
def test_an_admitted_matcher_is_asked_and_one_never_admitted_only_without_require_admission(grammar,
                                                                                             require_admission):
    f = ForcedDrafts(width=6, require_admission=require_admission)
    f.encode = encode
    admitted, unseen = _matcher(grammar), _matcher(grammar)
    assert f.admit(admitted, grammar) is True
    assert f.continuation(admitted) == (11, 2, 7, 8)
    assert f.continuation(unseen) == (() if require_admission else (11, 2, 7, 8))
    f.begin(2)
    f.record(admitted, 0)
    f.record(unseen, 1)
    assert f.recorded_nodes == (1 if require_admission else 2)
