"""The schema walk of ``core/schema.py``: which string schemas become control-character-free patterns, which are left
alone and why, where the walk looks, the bound's edges, and the text-level entry's pass-through cases.

Pure Python, no xgrammar: the grammar-level equivalence is ``test_max_length_pattern.py``'s."""

from __future__ import annotations

import copy
import json
from typing import Any, Dict

import pytest

from sglang_eagle_overlap.core.schema import (
    ANNOTATIONS,
    StringRewrite,
    control_free_pattern,
    rewrite_max_length_strings,
    rewrite_schema_text,
)

BOUND = 128


def s(**kw: Any) -> Dict[str, Any]:
    return {"type": "string", **kw}


def pattern(lo: int, hi: int) -> Dict[str, Any]:
    return {"type": "string", "pattern": control_free_pattern(lo, hi)}


def test_the_pattern_is_the_documented_one():
    assert control_free_pattern(1, 12) == '^[^\\x00-\\x1f"\\\\]{1,12}$'


def test_a_bounded_string_becomes_the_pattern_and_keeps_its_annotations():
    node = s(maxLength=12, minLength=2, description="a name", title="Name", examples=["Ada"], default="x")
    out = rewrite_max_length_strings(node, BOUND)
    assert out.schema == {"type": "string", "pattern": control_free_pattern(2, 12), "description": "a name",
                          "title": "Name", "examples": ["Ada"], "default": "x"}
    assert out.rewritten == (StringRewrite("#", 2, 12),) and out.left_alone == () and out.changed
    assert "minLength" not in out.schema and "maxLength" not in out.schema


def test_min_length_defaults_to_zero():
    assert rewrite_max_length_strings(s(maxLength=5), BOUND).schema == pattern(0, 5)


@pytest.mark.parametrize("extra, reason", [
    ({"pattern": "^a+$"}, "has pattern"),
    ({"format": "email"}, "has format"),
    ({"enum": ["a", "b"]}, "has enum"),
    ({"const": "a"}, "has const"),
    ({"anyOf": [{"minLength": 1}]}, "has keyword(s) anyOf"),
    ({"$ref": "#/$defs/x"}, "has keyword(s) $ref"),
    ({"nullable": True}, "has keyword(s) nullable"),
    ({"contentEncoding": "base64"}, "has keyword(s) contentEncoding"),
])
def test_strings_with_other_constraints_are_left_alone(extra, reason):
    node = s(maxLength=12, **extra)
    out = rewrite_max_length_strings(node, BOUND)
    assert out.schema is node and not out.changed
    assert [(a.pointer, a.reason) for a in out.left_alone] == [("#", reason)]


@pytest.mark.parametrize("node, reason", [
    ({"maxLength": 5}, "type is not exactly \"string\""),  # xgrammar ignores maxLength without a type
    ({"type": ["string"], "maxLength": 5}, "type is not exactly \"string\""),
    ({"type": ["string", "null"], "maxLength": 5}, "type is not exactly \"string\""),
    (s(maxLength=5.0), "minLength / maxLength not integers"),
    (s(maxLength=True), "minLength / maxLength not integers"),
    (s(maxLength="5"), "minLength / maxLength not integers"),
    (s(maxLength=5, minLength=1.0), "minLength / maxLength not integers"),
    (s(maxLength=-1), "bounds out of order (0, -1)"),
    (s(maxLength=2, minLength=3), "bounds out of order (3, 2)"),
    (s(maxLength=5, minLength=-1), "bounds out of order (-1, 5)"),
    (s(maxLength=BOUND + 1), f"maxLength {BOUND + 1} over the bound {BOUND}"),
])
def test_what_cannot_be_shown_equivalent_is_left_alone(node, reason):
    out = rewrite_max_length_strings(node, BOUND)
    assert out.schema is node and [a.reason for a in out.left_alone] == [reason]


@pytest.mark.parametrize("lo, hi", [(0, 0), (0, 1), (BOUND, BOUND), (0, BOUND), (7, 7)])
def test_bound_edges_are_rewritten(lo, hi):
    assert rewrite_max_length_strings(s(minLength=lo, maxLength=hi), BOUND).schema == pattern(lo, hi)


def test_a_negative_bound_rewrites_nothing():
    node = s(maxLength=0)
    assert rewrite_max_length_strings(node, -1).schema is node


def test_strings_without_max_length_are_not_touched_or_reported():
    node = {"type": "object", "properties": {"a": s(minLength=3), "b": s()}}
    out = rewrite_max_length_strings(node, BOUND)
    assert out.schema is node and out.rewritten == () and out.left_alone == ()


def _everywhere() -> Dict[str, Any]:
    """One bounded string under every keyword the walk descends into, and one under each it must not."""
    leaf = s(maxLength=4)
    return {
        "type": "object",
        "properties": {"p": copy.deepcopy(leaf), "deep": {"type": "object", "properties": {"q": copy.deepcopy(leaf)}}},
        "patternProperties": {"^x_": copy.deepcopy(leaf)},
        "additionalProperties": copy.deepcopy(leaf),
        "unevaluatedProperties": copy.deepcopy(leaf),
        "$defs": {"d/1": copy.deepcopy(leaf), "e~": copy.deepcopy(leaf)},
        "definitions": {"old": copy.deepcopy(leaf)},
        "anyOf": [copy.deepcopy(leaf), {"type": "null"}],
        "oneOf": [copy.deepcopy(leaf)],
        "allOf": [copy.deepcopy(leaf)],
        "not": copy.deepcopy(leaf),
        "if": copy.deepcopy(leaf), "then": copy.deepcopy(leaf), "else": copy.deepcopy(leaf),
        "propertyNames": copy.deepcopy(leaf),
        "dependentSchemas": {"p": copy.deepcopy(leaf)},
        "dependencies": {"p": copy.deepcopy(leaf)},
        "contains": copy.deepcopy(leaf),
    }


def test_the_walk_reaches_every_subschema_keyword_and_no_other():
    schema = _everywhere()
    before = copy.deepcopy(schema)
    out = rewrite_max_length_strings(schema, BOUND)
    assert schema == before  # pure: the input is untouched
    assert sorted(r.pointer for r in out.rewritten) == sorted([
        "#/properties/p", "#/properties/deep/properties/q", "#/patternProperties/^x_", "#/additionalProperties",
        "#/unevaluatedProperties", "#/$defs/d~11", "#/$defs/e~0", "#/definitions/old", "#/anyOf/0", "#/oneOf/0",
        "#/allOf/0"])
    for key in ("not", "if", "then", "else", "propertyNames", "contains"):
        assert out.schema[key] is schema[key], key
    for key in ("dependentSchemas", "dependencies"):
        assert out.schema[key] is schema[key], key
    assert out.schema["anyOf"][1] is schema["anyOf"][1]
    assert out.schema["$defs"]["d/1"] == pattern(0, 4)


def test_arrays_items_prefix_items_and_tuple_items():
    schema = {"type": "array", "items": s(maxLength=3), "prefixItems": [s(maxLength=1), {"type": "integer"}],
              "additionalItems": s(maxLength=2), "unevaluatedItems": s(maxLength=5)}
    out = rewrite_max_length_strings(schema, BOUND).schema
    assert out["items"] == pattern(0, 3) and out["prefixItems"][0] == pattern(0, 1)
    assert out["prefixItems"][1] is schema["prefixItems"][1]
    assert out["additionalItems"] == pattern(0, 2) and out["unevaluatedItems"] == pattern(0, 5)
    tuple_form = {"type": "array", "items": [s(maxLength=3), s(maxLength=300)]}
    out2 = rewrite_max_length_strings(tuple_form, BOUND)
    assert out2.schema["items"][0] == pattern(0, 3) and out2.schema["items"][1] is tuple_form["items"][1]
    assert [a.pointer for a in out2.left_alone] == ["#/items/1"]


def test_an_all_of_with_several_subschemas_is_not_entered():
    # xgrammar ignores an allOf of several subschemas: a rewrite there could not be checked against anything
    schema = {"allOf": [s(maxLength=3), s(minLength=1)]}
    out = rewrite_max_length_strings(schema, BOUND)
    assert out.schema is schema and out.rewritten == ()


def test_refs_keep_pointing_at_the_rewritten_definition():
    schema = {"$defs": {"short": s(maxLength=8, description="short text")},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/short"}, "b": {"$ref": "#/$defs/short"}}}
    out = rewrite_max_length_strings(schema, BOUND).schema
    assert out["$defs"]["short"] == {"type": "string", "pattern": control_free_pattern(0, 8),
                                     "description": "short text"}
    assert out["properties"] is schema["properties"]  # the refs themselves are unchanged


def test_unchanged_subtrees_are_shared_and_changed_ones_copied():
    schema = {"type": "object", "properties": {"a": s(maxLength=3), "b": {"type": "integer"}},
              "required": ["a", "b"]}
    out = rewrite_max_length_strings(schema, BOUND).schema
    assert out is not schema and out["properties"] is not schema["properties"]
    assert out["properties"]["b"] is schema["properties"]["b"] and out["required"] is schema["required"]
    assert list(out) == list(schema)  # key order kept


def test_non_dict_schemas_pass_through():
    for node in (True, False, None, 3, "x", []):
        assert rewrite_max_length_strings(node, BOUND).schema is node


def test_a_max_length_string_nested_under_a_left_alone_one_is_still_walked():
    # a string schema with maxLength and anyOf is left alone, but its anyOf branches are walked
    node = s(maxLength=5, anyOf=[s(maxLength=3)])
    out = rewrite_max_length_strings(node, BOUND)
    assert [a.pointer for a in out.left_alone] == ["#"] and [r.pointer for r in out.rewritten] == ["#/anyOf/0"]
    assert out.schema["maxLength"] == 5 and out.schema["anyOf"][0] == pattern(0, 3)


# -- the text entry --------------------------------------------------------------------------------------------------
def test_text_unchanged_is_the_very_input():
    text = '{"type":  "object", "properties": {"a": {"type": "string"}}}'
    out = rewrite_schema_text(text, BOUND)
    assert out.text is text and not out.changed and out.rewrite is not None


def test_text_rewritten_round_trips_everything_else():
    schema = {"type": "object", "description": "Straße, 日本 and 😀", "properties": {
        "a": s(maxLength=3), "n": {"type": "number", "minimum": 0.1, "maximum": 12345678901234567890}}}
    out = rewrite_schema_text(json.dumps(schema), BOUND)
    assert out.changed
    back = json.loads(out.text)
    assert back["description"] == schema["description"] and back["properties"]["n"] == schema["properties"]["n"]
    assert back["properties"]["a"] == pattern(0, 3)
    assert "日本" in out.text  # written as UTF-8, not re-escaped


@pytest.mark.parametrize("text", [
    "$$ANY$$",  # SGLang's "any JSON" key
    "{not json",
    '{"type": "string", "maxLength": 3, "maxLength": 4}',  # duplicate keys: parsers disagree on which wins
    '{"type": "string", "maxLength": 3, "x": NaN}',
    '{"type": "string", "maxLength": 3, "x": Infinity}',
    '{"type": "string", "maxLength": 3, "x": 1e400}',
    '{"type": "string", "maxLength": 3, "description": "\\ud800"}',  # a lone surrogate cannot be written as UTF-8
    "[" * 100_000 + "]" * 100_000,  # deeper than Python's parser goes
    "",
])
def test_text_the_walk_cannot_read_exactly_passes_through(text):
    out = rewrite_schema_text(text, BOUND)
    assert out.text is text and not out.changed
    assert out.reason.startswith("not rewritten")


def test_annotations_are_only_keywords_that_admit_every_string():
    assert ANNOTATIONS == {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                           "writeOnly"}
