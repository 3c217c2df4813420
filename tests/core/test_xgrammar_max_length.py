"""Pins an upstream xgrammar behaviour users must know about: ``maxLength`` strings admit raw control characters.

xgrammar (0.2.1, and 0.2.7) compiles a JSON-schema string with ``maxLength``/``minLength`` to
``"\"" [^"\\\r\n]{min,max} "\""``, while its unbounded JSON string is ``[^\0-\x1f"\\\r\n]`` plus escapes. So under
``maxLength`` a raw U+0000-U+001F character (except CR, LF) is grammar-valid, and the sampled text is then not
JSON: ``json.loads`` rejects it. Seen on a GPU with temperature sampling (``{"city": ", 674 895\x11\x12\x13"}`` under
``maxLength: 12``); greedy CPU tests do not hit it. Not caused by the plugin; on SGLang 0.5.23 its
``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN`` (``core/schema.py``) compiles such strings as the pattern of the last test
instead (``tests/core/test_max_length_pattern.py`` checks that rewrite against xgrammar).

These tests use xgrammar alone (no SGLang, no model) and are written to FAIL once upstream fixes it, so the note in
docs/troubleshooting.md ("Known upstream limits") and the workaround get revisited instead of going stale.
"""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

xgr = pytest.importorskip("xgrammar")

XGRAMMAR = md.version("xgrammar")
PREFIX = '{"a": "'  # xgrammar's default separators with any_whitespace=False (what SGLang's CPU tests use)
CONTROL = [chr(c) for c in range(0x20)]
FIXED_BY_UPSTREAM = (
    f"xgrammar {XGRAMMAR} no longer admits raw control characters in maxLength strings: upstream fixed it. Update "
    "docs/troubleshooting.md (\"Known upstream limits\": which xgrammar versions are affected, the pattern "
    "workaround), reconsider settings.MAX_LENGTH_PATTERN_BOUNDS, and turn this test into a check that the installed "
    "versions are fixed."
)


def _schema(**string_keywords) -> str:
    return json.dumps({
        "type": "object",
        "properties": {"a": {"type": "string", **string_keywords}},
        "required": ["a"],
        "additionalProperties": False,
    })


@pytest.fixture(scope="module")
def compiler():
    # Two tokens: "x" and a stop token. accept_string walks the grammar byte by byte, independent of the vocabulary.
    info = xgr.TokenizerInfo(["x", "</s>"], stop_token_ids=[1])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _admits(compiler, schema: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
    return bool(matcher.accept_string(text))


def _complete_document_accepted(compiler, schema: str, document: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False))
    return bool(matcher.accept_string(document)) and bool(matcher.accept_token(1)) and matcher.is_terminated()


def test_unbounded_string_rejects_every_raw_control_character(compiler):
    # The reference behaviour (JSON forbids raw U+0000-U+001F inside strings).
    schema = _schema()
    admitted = [hex(ord(c)) for c in CONTROL if _admits(compiler, schema, PREFIX + "x" + c)]
    assert admitted == [], f"xgrammar {XGRAMMAR}: the unbounded JSON string admits raw control characters {admitted}"
    assert _admits(compiler, schema, PREFIX + "x\\u0001")  # the escaped form stays possible


def test_max_length_string_admits_raw_control_characters(compiler):
    schema = _schema(maxLength=12)
    admitted = [c for c in CONTROL if _admits(compiler, schema, PREFIX + "x" + c)]
    if not admitted:
        pytest.fail(FIXED_BY_UPSTREAM)
    # Exactly the class xgrammar compiles to today: everything but CR and LF.
    assert sorted(map(ord, admitted)) == [c for c in range(0x20) if c not in (0x0A, 0x0D)], (
        f"xgrammar {XGRAMMAR} changed which raw control characters a maxLength string admits: "
        f"{[hex(ord(c)) for c in admitted]}. {FIXED_BY_UPSTREAM}"
    )
    # The consequence a user sees: a complete, grammar-accepted output that is not JSON.
    document = '{"a": "x\x11\x12\x13"}'
    assert _complete_document_accepted(compiler, schema, document)
    with pytest.raises(json.JSONDecodeError):
        json.loads(document)


def test_max_length_still_bounds_the_length(compiler):
    # Guard: the tests above are about the character class, not a maxLength that stopped working.
    schema = _schema(maxLength=12)
    assert _admits(compiler, schema, PREFIX + "x" * 12)
    assert not _admits(compiler, schema, PREFIX + "x" * 13)


def test_pattern_workaround_rejects_control_characters(compiler):
    # The workaround of docs/troubleshooting.md: the same bound as a pattern whose class excludes U+0000-U+001F. Like
    # xgrammar's own maxLength string it admits no escape sequences; measured no slower to compile or mask up to 128
    # characters.
    schema = _schema(pattern='^[^\\x00-\\x1f"\\\\]{0,12}$')
    assert [hex(ord(c)) for c in CONTROL if _admits(compiler, schema, PREFIX + "x" + c)] == []
    assert _admits(compiler, schema, PREFIX + "x" * 12) and not _admits(compiler, schema, PREFIX + "x" * 13)
    assert _complete_document_accepted(compiler, schema, '{"a": "Green river"}')
