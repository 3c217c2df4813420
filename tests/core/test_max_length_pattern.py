"""The rewrite of ``core/schema.py`` against real xgrammar: a string schema's ``maxLength`` / ``minLength`` and the
pattern the rewrite puts in their place admit the same strings apart from raw control characters, token by token.

Property-based (hypothesis), on the installed xgrammar (0.2.1 on the SGLang 0.5.16 venv, 0.2.7 on 0.5.23), with a small
raw vocabulary built here (no hub tokenizer): printable ASCII one character per token, and multi-character tokens
holding quotes, backslashes and escape sequences, control characters (alone and inside words), DEL / C1 / line
separators, accented, CJK and astral characters. For bounds drawn from 0..12 plus the project's bound edge (128),
each pair is compiled with ``GrammarCompiler.compile_json_schema`` as SGLang compiles a request (``any_whitespace``
off), the rewritten side from ``rewrite_max_length_strings``' own output:

* ``test_same_documents_apart_from_control_characters``: a document ``{"a": "<text>"}`` is accepted whole by the
  rewritten grammar iff xgrammar's ``maxLength`` grammar accepts it and ``<text>`` has no U+0000-U+001F; every
  document the rewritten grammar accepts validates against the ORIGINAL schema with ``jsonschema``;
* ``test_same_masks_apart_from_control_character_tokens``: along random token paths of the rewritten grammar (for the
  bound edge, from a few characters before it), at every step, a token is in the rewritten grammar's bitmask iff it
  is in the ``maxLength`` grammar's and holds no control character (and both matchers accept the path).

Either fails if the rewrite changed the bounds or the character class, or admitted escapes. The examples are
derandomised: a failure reproduces.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Tuple

import jsonschema
import pytest
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_eagle_overlap.core.schema import rewrite_max_length_strings

CONTROL = frozenset(chr(c) for c in range(0x20))
PREFIX = '{"a": "'  # xgrammar's separators with any_whitespace=False (how SGLang's CPU tests compile)
SUFFIX = '"}'
BOUND = 128

# The characters documents and tokens are made of: every kind the two grammars could treat differently.
CHARS = ([chr(c) for c in range(0x20, 0x7f)] + ["\x00", "\x01", "\t", "\n", "\x0b", "\r", "\x1b", "\x1f", "\x7f",
                                                 "\x85", "\u00e9", "\u2028", "\u65e5", "\U0001F600"])
MULTI = ["ab", "Green", " river", "\\n", '\\"', "\\u0041", '"}', '", ', 'x"', "a\x01b", "\tx", "\u65e5\u672c",
         "\u00e9t\u00e9", "\U0001F600!", "12345", "     "]
VOCAB: List[str] = CHARS + MULTI + ["</s>"]
STOP = len(VOCAB) - 1
HAS_CONTROL = [any(ch in CONTROL for ch in tok) for tok in VOCAB]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=1)
def _compiler() -> Any:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP]), cache_enabled=False)


def _object(string_schema: Dict[str, Any]) -> Dict[str, Any]:
    return {"type": "object", "properties": {"a": string_schema}, "required": ["a"], "additionalProperties": False}


@functools.lru_cache(maxsize=None)
def _pair(lo: int, hi: int) -> Tuple[Dict[str, Any], Any, Any]:
    """(the original schema, xgrammar's compile of it, xgrammar's compile of the rewrite's output)."""
    original = _object({"type": "string", "minLength": lo, "maxLength": hi, "description": "annotations stay"})
    rewrite = rewrite_max_length_strings(original, BOUND)
    assert [r.pointer for r in rewrite.rewritten] == ["#/properties/a"], rewrite
    compiler = _compiler()
    as_sent = compiler.compile_json_schema(json.dumps(original), any_whitespace=False)
    rewritten = compiler.compile_json_schema(json.dumps(rewrite.schema), any_whitespace=False)
    return original, as_sent, rewritten


def _accepts_document(compiled: Any, document: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return bool(matcher.accept_string(document)) and bool(matcher.accept_token(STOP)) and matcher.is_terminated()


def _allowed(matcher: Any) -> List[bool]:
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(bitmask)
    row = bitmask[0].tolist()
    return [bool((row[t // 32] >> (t % 32)) & 1) for t in range(len(VOCAB))]


bounds = st.one_of(
    st.tuples(st.integers(0, 12), st.integers(0, 12)).map(lambda p: (min(p), max(p))),
    st.sampled_from([(0, BOUND), (BOUND - 2, BOUND), (BOUND, BOUND)]),
)


@_settings(400)
@given(bound=bounds, text=st.one_of(st.text(st.sampled_from(CHARS), max_size=16),
                                    st.lists(st.sampled_from(VOCAB[:-1]), max_size=10).map("".join)))
def test_same_documents_apart_from_control_characters(bound, text):
    lo, hi = bound
    if hi == BOUND:  # the large bounds are checked around their edge, not on their short prefixes
        text = "x" * (BOUND - 4) + text
    original, as_sent, rewritten = _pair(lo, hi)
    document = PREFIX + text + SUFFIX
    by_max_length = _accepts_document(as_sent, document)
    by_pattern = _accepts_document(rewritten, document)
    has_control = any(ch in CONTROL for ch in text)
    assert by_pattern == (by_max_length and not has_control), (lo, hi, text, by_max_length, by_pattern)
    if by_pattern:
        jsonschema.validate(json.loads(document), original)


@_settings(120)
@given(bound=bounds, data=st.data())
def test_same_masks_apart_from_control_character_tokens(bound, data):
    lo, hi = bound
    _, as_sent, rewritten = _pair(lo, hi)
    m_len, m_pat = xgr.GrammarMatcher(as_sent), xgr.GrammarMatcher(rewritten)
    if hi == BOUND:  # the large bounds: start a few characters before their edge
        start = PREFIX + "x" * (BOUND - 4)
        assert m_len.accept_string(start) and m_pat.accept_string(start)
    steps = 0
    while not m_pat.is_terminated() and steps < 40:
        by_max_length, by_pattern = _allowed(m_len), _allowed(m_pat)
        differ = [VOCAB[t] for t in range(len(VOCAB))
                  if by_pattern[t] != (by_max_length[t] and not HAS_CONTROL[t])]
        assert differ == [], (lo, hi, steps, differ)
        choices = [t for t in range(len(VOCAB)) if by_pattern[t]]
        assert choices, (lo, hi, steps, "the rewritten grammar allows nothing before terminating")
        token = data.draw(st.sampled_from(choices))
        assert m_pat.accept_token(token) and m_len.accept_token(token), (lo, hi, steps, VOCAB[token])
        steps += 1
    assert m_len.is_terminated() == m_pat.is_terminated()


def test_the_two_grammars_differ_where_they_should():
    # Guard: the properties above are not vacuous. A control character inside the string is where they differ.
    original, as_sent, rewritten = _pair(0, 12)
    assert _accepts_document(as_sent, PREFIX + "x\x01y" + SUFFIX)
    assert not _accepts_document(rewritten, PREFIX + "x\x01y" + SUFFIX)
    assert _accepts_document(rewritten, PREFIX + "x" * 12 + SUFFIX)
    assert not _accepts_document(rewritten, PREFIX + "x" * 13 + SUFFIX)
    _, _, bounded_below = _pair(3, 5)
    assert not _accepts_document(bounded_below, PREFIX + "xy" + SUFFIX)
    assert _accepts_document(bounded_below, PREFIX + "\U0001F600\u00e9\u65e5" + SUFFIX)  # code points, not bytes
