r"""A JSON schema's bounded ``maxLength`` strings as control-character-free patterns, before xgrammar compiles it.

Why: xgrammar compiles a string schema with ``maxLength`` (and ``minLength``) to ``"\"" [^"\\\r\n]{min,max} "\""``.
Near the end of such a string one ``fill_next_token_bitmask`` costs 1-31 ms on a 128k vocabulary, and the class admits
raw U+0000-U+001F other than CR and LF, which JSON forbids. The pattern ``^[^\x00-\x1f"\\]{min,max}$``
(:func:`control_free_pattern`) admits the same strings minus those control characters: no escape sequences either,
the same lengths (xgrammar counts code points in both). Some xgrammar versions compile it to a regex whose fills cost
~0.01 ms, but only up to a repetition bound past which they compile it another way, far slower; the caller passes
that bound (``settings.MAX_LENGTH_PATTERN_BOUNDS``).

What is rewritten, and why it is the same grammar: a string schema is rewritten only when xgrammar compiles it on
its own and the rewrite is provably the same language minus control characters: a ``dict`` whose ``type`` is exactly
``"string"``, whose ``maxLength`` is an integer ``0 <= maxLength <= bound``, whose ``minLength`` (if any) is an
integer ``0 <= minLength <= maxLength``, and whose other keywords are annotations only (:data:`ANNOTATIONS`). A string
with ``pattern``, ``format``, ``enum``, ``const`` or any other keyword is left alone, as is one with bounds out of
range or of the wrong type (xgrammar's own error then stays the request's). The rewritten schema keeps ``type``, the
annotations, and ``pattern`` in place of the lengths.

Where the walk looks: the subschemas xgrammar compiles each on its own (:data:`SUBSCHEMA_MAPS`,
:data:`SUBSCHEMA_SINGLE`, :data:`SUBSCHEMA_LISTS`); ``allOf`` only with one subschema (xgrammar 0.2.1 and 0.2.7
ignore an ``allOf`` of several). Nothing under ``not``, ``if`` / ``then`` / ``else``, ``contains``,
``propertyNames``, ``dependentSchemas`` or ``dependencies``: those constrain something else than the value at that
place, or xgrammar does not implement them, so a rewrite there could not be shown to keep the grammar. A ``$ref``
keeps pointing at the same place (a rewritten subschema keeps its key; xgrammar ignores a ``$ref``'s siblings).

Call order: :func:`rewrite_schema_text` with the schema text a request sent, just before it is compiled; its
``text`` is what to compile (the very input when nothing changed). :func:`rewrite_max_length_strings` is the same walk
on a parsed schema. Both are pure: the input is never modified.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["ANNOTATIONS", "LeftAlone", "SchemaRewrite", "SchemaTextRewrite", "StringRewrite", "control_free_pattern",
           "rewrite_max_length_strings", "rewrite_schema_text"]

# Keywords that do not change which strings a string schema admits (JSON Schema annotations).
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly"})
# Subschema-bearing keywords the walk descends into.
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_SINGLE = ("additionalProperties", "items", "additionalItems", "unevaluatedProperties", "unevaluatedItems")
SUBSCHEMA_LISTS = ("prefixItems", "items", "anyOf", "oneOf", "allOf")
# Keywords that make a string schema something else than a length bound: left alone, named in the reason.
_STRING_SHAPES = ("pattern", "format", "enum", "const")


def control_free_pattern(min_length: int, max_length: int) -> str:
    """The regex that replaces ``minLength``/``maxLength``: any code point but U+0000-U+001F, ``"`` and ``\\``."""
    return '^[^\\x00-\\x1f"\\\\]{%d,%d}$' % (min_length, max_length)


@dataclass(frozen=True, slots=True)
class StringRewrite:
    """One string schema rewritten: where (a JSON pointer into the schema) and its bounds."""

    pointer: str
    min_length: int
    max_length: int


@dataclass(frozen=True, slots=True)
class LeftAlone:
    """One string schema with ``maxLength`` that was not rewritten, and why."""

    pointer: str
    reason: str


@dataclass(frozen=True, slots=True)
class SchemaRewrite:
    """The walk's result: ``schema`` is the input object itself when nothing was rewritten, else a new one (the
    input is never modified); ``rewritten`` and ``left_alone`` in document order."""

    schema: Any
    rewritten: Tuple[StringRewrite, ...]
    left_alone: Tuple[LeftAlone, ...]

    @property
    def changed(self) -> bool:
        return bool(self.rewritten)


@dataclass(frozen=True, slots=True)
class SchemaTextRewrite:
    """What to compile for one schema text: ``text`` is the input string itself unless ``rewrite.changed``.
    ``rewrite`` is None when the text was not walked; ``reason`` then says why (not JSON, ...)."""

    text: str
    rewrite: Optional[SchemaRewrite]
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.rewrite is not None and self.rewrite.changed


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _string_verdict(node: Mapping[str, Any], bound: int) -> Optional[str]:
    """None when ``node`` (a schema with ``maxLength``) can be rewritten, else why not."""
    if node.get("type") != "string":
        return "type is not exactly \"string\""
    shapes = [k for k in _STRING_SHAPES if k in node]
    if shapes:
        return f"has {', '.join(shapes)}"
    others = sorted(k for k in node if k not in ANNOTATIONS and k not in ("type", "maxLength", "minLength"))
    if others:
        return f"has keyword(s) {', '.join(others)}"
    hi = node["maxLength"]
    lo = node.get("minLength", 0)
    if not _is_int(hi) or not _is_int(lo):
        return "minLength / maxLength not integers"
    if not 0 <= lo <= hi:
        return f"bounds out of order ({lo}, {hi})"
    if hi > bound:
        return f"maxLength {hi} over the bound {bound}"
    return None


class _Walk:
    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.rewritten: List[StringRewrite] = []
        self.left_alone: List[LeftAlone] = []

    def node(self, node: Any, pointer: str) -> Any:
        """``node`` itself when nothing under it changed, else a rewritten copy (shallow where unchanged)."""
        if not isinstance(node, dict):
            return node
        if "maxLength" in node:
            why = _string_verdict(node, self.bound)
            if why is None:
                lo, hi = node.get("minLength", 0), node["maxLength"]
                self.rewritten.append(StringRewrite(pointer, lo, hi))
                out: Dict[str, Any] = {}
                for key, value in node.items():
                    if key == "maxLength":
                        out["pattern"] = control_free_pattern(lo, hi)
                    elif key != "minLength":
                        out[key] = value
                return out
            self.left_alone.append(LeftAlone(pointer, why))
        changes: Dict[str, Any] = {}
        for key in SUBSCHEMA_MAPS:
            children = node.get(key)
            if isinstance(children, dict):
                new = {name: self.node(child, f"{pointer}/{key}/{_escape(name)}") for name, child in children.items()}
                if any(new[name] is not children[name] for name in children):
                    changes[key] = new
        for key in SUBSCHEMA_SINGLE:
            child = node.get(key)
            if isinstance(child, dict):
                new_child = self.node(child, f"{pointer}/{key}")
                if new_child is not child:
                    changes[key] = new_child
        for key in SUBSCHEMA_LISTS:
            items = node.get(key)
            if not isinstance(items, list):
                continue
            if key == "allOf" and len(items) != 1:
                continue
            new_items = [self.node(child, f"{pointer}/{key}/{i}") for i, child in enumerate(items)]
            if any(a is not b for a, b in zip(new_items, items)):
                changes[key] = new_items
        if not changes:
            return node
        return {key: changes.get(key, value) for key, value in node.items()}


def rewrite_max_length_strings(schema: Any, bound: int) -> SchemaRewrite:
    """Every string schema of ``schema`` that the module docstring's rules allow, with ``maxLength <= bound``, as
    ``{"type": "string", "pattern": ...}`` plus its annotations. ``bound`` < 0 rewrites nothing."""
    walk = _Walk(bound)
    out = walk.node(schema, "#")
    return SchemaRewrite(out, tuple(walk.rewritten), tuple(walk.left_alone))


class _NotPlainJson(ValueError):
    """The text is JSON Python reads differently from a strict parser (duplicate keys, NaN, numbers out of range)."""


def _pairs(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _NotPlainJson(f"duplicate key {key!r}")
        out[key] = value
    return out


def _finite(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise _NotPlainJson(f"number {raw} out of range")
    return value


def _constant(raw: str) -> Any:
    raise _NotPlainJson(f"{raw} is not JSON")


def rewrite_schema_text(text: str, bound: int) -> SchemaTextRewrite:
    """:func:`rewrite_max_length_strings` on the JSON text ``text``; the result's ``text`` is what to compile.

    Anything the walk cannot read exactly as a strict JSON parser would (not JSON, duplicate keys, ``NaN``, a number
    out of float range, nesting too deep for Python) is returned unchanged, with the reason: the compiler's own error
    path then sees the input as sent. A rewritten schema is serialised with ``json.dumps`` (numbers, strings and key
    order as parsed); one that cannot be encoded as UTF-8 (a lone surrogate escape) is returned unchanged too."""
    try:
        parsed = json.loads(text, object_pairs_hook=_pairs, parse_float=_finite, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and _NotPlainJson are ValueErrors
        return SchemaTextRewrite(text, None, f"not rewritten: {type(exc).__name__}: {exc}")
    try:
        rewrite = rewrite_max_length_strings(parsed, bound)
    except RecursionError:
        return SchemaTextRewrite(text, None, "not rewritten: nested too deep")
    if not rewrite.changed:
        return SchemaTextRewrite(text, rewrite)
    try:
        out = json.dumps(rewrite.schema, ensure_ascii=False)
        out.encode("utf-8")
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        return SchemaTextRewrite(text, None, f"not rewritten: {type(exc).__name__}: {exc}")
    return SchemaTextRewrite(out, rewrite)
