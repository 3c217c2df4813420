"""Prompt + JSON-schema dataset for the serving benchmark (generated locally, deterministic for a seed).

Eight real-world-shaped schema families (user profile, order, calendar event, product review, HTTP access log, recipe,
support ticket, sensor report). Each case draws, from its own seeded RNG, which optional fields exist and which of
them are required, enum value subsets, string length limits, array sizes and the facts quoted in the prompt, so the
dataset varies but is identical for equal ``(n, seed)``.

Strings carry ``maxLength``, arrays ``maxItems`` and integers ``minimum``/``maximum``, as production schemas usually
do; it also keeps documents finite when the model is a tiny random one. The features a case exercises are computed
by walking its schema (:func:`schema_features`), not declared by hand.

Usage::

    from benchmarks.schemas import make_dataset
    for case in make_dataset(16, seed=0):
        case.prompt, case.schema, case.features

Two fixed schema shapes with a valid instance each, for engine-free mask benchmarks
(``benchmarks/bench_mask_states.py --rewrite``): :data:`TOOL_CALL_SCHEMA` (a function call: a ``const`` name and
arguments with bounded strings, a ``format`` string and one string over the pattern bound) and
:data:`EXTRACTION_SCHEMA` (fields extracted from an invoice: many ``maxLength`` strings, some filled close to their
bound).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Tuple

__all__ = ["EXTRACTION_INSTANCE", "EXTRACTION_SCHEMA", "FEATURES", "FAMILIES", "TOOL_CALL_INSTANCE",
           "TOOL_CALL_SCHEMA", "Case", "make_dataset", "schema_features"]

FEATURES: Tuple[str, ...] = ("nested", "array", "enum", "pattern", "optional")

_FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas", "Keiko", "Luis"]
_LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Silva", "Kowalski", "Haddad", "Novak", "Byrne", "Ferreira"]
_CITIES = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lyon", "Austin", "Porto", "Seoul", "Tallinn"]
_PRODUCTS = ["espresso grinder", "trail shoes", "noise-cancelling headphones", "standing desk", "rice cooker",
             "e-reader", "camping stove", "mechanical keyboard"]
_DISHES = ["lentil soup", "mushroom risotto", "chicken tagine", "banana bread", "shakshuka", "pad thai", "miso ramen",
           "ratatouille", "fish tacos", "palak paneer", "pierogi", "jollof rice"]


def _str(rng: random.Random, lo: int = 8, hi: int = 24) -> Dict[str, Any]:
    return {"type": "string", "maxLength": rng.randint(lo, hi)}


def _int(lo: int, hi: int) -> Dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(rng: random.Random, values: List[str], k_min: int = 2) -> Dict[str, Any]:
    k = rng.randint(min(k_min, len(values)), len(values))
    return {"type": "string", "enum": sorted(rng.sample(values, k))}


def _array(rng: random.Random, items: Dict[str, Any], lo: int = 2, hi: int = 4) -> Dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(lo, hi)}


def _obj(rng: random.Random, required: Dict[str, Any], optional: Dict[str, Any]) -> Dict[str, Any]:
    """An object with all ``required`` fields and a random, non-empty-when-possible subset of ``optional`` ones, some
    of which may still become required (never all of them: at least one kept field stays optional)."""
    props = dict(required)
    req = list(required)
    opt_names = list(optional)
    keep = rng.sample(opt_names, rng.randint(min(1, len(opt_names)), len(opt_names))) if opt_names else []
    promoted = [name for name in opt_names if name in keep and rng.random() < 0.25]
    if keep and len(promoted) == len(keep):
        promoted.pop()  # at least one kept field stays optional
    for name in opt_names:  # keep declaration order stable
        if name in keep:
            props[name] = optional[name]
    req += promoted
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _user_profile(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    address = _obj(rng, {"city": _str(rng), "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"}},
                   {"street": _str(rng, 12, 32), "country": _enum(rng, ["DE", "FR", "JP", "KE", "PT", "US"])})
    schema = _obj(rng, {"name": _str(rng), "age": _int(0, 120), "address": address},
                  {"email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,8}\\.(com|org|net)$"},
                   "tags": _array(rng, _str(rng, 4, 12)), "newsletter": {"type": "boolean"}})
    who, city = _person(rng), rng.choice(_CITIES)
    prompt = (f"Create the user profile for {who}, {rng.randint(19, 80)} years old, living in {city} "
              f"(postal code {rng.randint(10000, 99999)}).")
    return schema, prompt


def _order(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    item = _obj(rng, {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "quantity": _int(1, 20)},
                {"unit_price_cents": _int(1, 100000), "gift_wrap": {"type": "boolean"}})
    schema = _obj(rng, {"order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                        "status": _enum(rng, ["pending", "paid", "shipped", "delivered", "cancelled"]),
                        "items": _array(rng, item)},
                  {"shipping": _obj(rng, {"method": _enum(rng, ["standard", "express", "pickup"])},
                                    {"tracking": {"type": "string", "pattern": "^[A-Z0-9]{10}$"}}),
                   "notes": _str(rng, 10, 40)})
    prompt = (f"Order from {_person(rng)}: {rng.randint(1, 5)} x {rng.choice(_PRODUCTS)}, shipped to "
              f"{rng.choice(_CITIES)}. Return the order record.")
    return schema, prompt


def _calendar_event(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    attendee = _obj(rng, {"name": _str(rng)}, {"role": _enum(rng, ["organizer", "required", "optional", "resource"])})
    schema = _obj(rng, {"title": _str(rng, 10, 30),
                        "start": {"type": "string",
                                  "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]$"},
                        "duration_minutes": _int(5, 480), "attendees": _array(rng, attendee)},
                  {"location": _str(rng), "recurring": {"type": "boolean"},
                   "visibility": _enum(rng, ["public", "private", "confidential"])})
    prompt = (f"Schedule a {rng.choice([15, 30, 45, 60, 90])}-minute meeting with {_person(rng)} and "
              f"{_person(rng)} in {rng.choice(_CITIES)} next week.")
    return schema, prompt


def _product_review(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    schema = _obj(rng, {"product": _str(rng, 8, 30), "rating": _int(1, 5),
                        "sentiment": _enum(rng, ["negative", "neutral", "positive", "mixed"])},
                  {"pros": _array(rng, _str(rng, 6, 20)), "cons": _array(rng, _str(rng, 6, 20)),
                   "verified_purchase": {"type": "boolean"},
                   "reviewer": _obj(rng, {"handle": {"type": "string", "pattern": "^@[a-z0-9_]{3,12}$"}},
                                    {"country": _enum(rng, ["BR", "CA", "IN", "NG", "SE"])})})
    prompt = (f"Summarize this review of the {rng.choice(_PRODUCTS)}: '{rng.choice(['Great', 'Decent', 'Awful'])} "
              f"value, {rng.choice(['arrived late', 'works well', 'a bit noisy'])}.'")
    return schema, prompt


def _http_log(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    header = _obj(rng, {"name": {"type": "string", "pattern": "^[A-Za-z-]{2,20}$"}, "value": _str(rng, 4, 24)}, {})
    schema = _obj(rng, {"method": _enum(rng, ["GET", "POST", "PUT", "PATCH", "DELETE"]),
                        "path": {"type": "string", "pattern": "^/[a-z0-9/_-]{1,30}$"}, "status": _int(100, 599)},
                  {"latency_ms": _int(0, 60000), "headers": _array(rng, header),
                   "client": _obj(rng, {"ip": {"type": "string",
                                               "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"}},
                                  {"agent": _str(rng, 6, 24)})})
    prompt = (f"Parse this access log line: {rng.choice(['GET', 'POST'])} /api/v{rng.randint(1, 3)}/items "
              f"{rng.choice([200, 201, 404, 500])} {rng.randint(3, 900)}ms from 10.0.{rng.randint(0, 255)}.7")
    return schema, prompt


def _recipe(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    ingredient = _obj(rng, {"item": _str(rng, 4, 20), "quantity": _int(1, 1000)},
                      {"unit": _enum(rng, ["g", "ml", "tbsp", "tsp", "cup", "piece"])})
    schema = _obj(rng, {"name": _str(rng, 8, 30), "servings": _int(1, 12),
                        "ingredients": _array(rng, ingredient, 2, 5)},
                  {"steps": _array(rng, _str(rng, 10, 40)), "vegetarian": {"type": "boolean"},
                   "difficulty": _enum(rng, ["easy", "medium", "hard"])})
    prompt = (f"Write a recipe card for {rng.choice(_DISHES)} for {rng.randint(2, 6)} people, ready in "
              f"{rng.choice([20, 30, 40, 45, 60, 90])} minutes.")
    return schema, prompt


def _support_ticket(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    schema = _obj(rng, {"ticket_id": {"type": "string", "pattern": "^[A-Z]{2,4}-[0-9]{1,5}$"},
                        "priority": _enum(rng, ["P0", "P1", "P2", "P3"]),
                        "customer": _obj(rng, {"name": _str(rng)},
                                         {"tier": _enum(rng, ["free", "pro", "enterprise"]),
                                          "account_age_days": _int(0, 5000)})},
                  {"labels": _array(rng, _enum(rng, ["billing", "bug", "login", "performance", "feature-request"])),
                   "resolved": {"type": "boolean"}, "assignee": _str(rng)})
    prompt = (f"Triage: {_person(rng)} cannot {rng.choice(['log in', 'download invoices', 'export data'])} "
              f"since {rng.choice(['Monday', 'yesterday', 'the last update'])}.")
    return schema, prompt


def _sensor_report(rng: random.Random) -> Tuple[Dict[str, Any], str]:
    reading = _obj(rng, {"metric": _enum(rng, ["temperature", "humidity", "pressure", "wind", "pm25"]),
                         "value": _int(-100, 2000)}, {"unit": _str(rng, 1, 6)})
    schema = _obj(rng, {"station": {"type": "string", "pattern": "^[A-Z]{4}[0-9]{2}$"},
                        "readings": _array(rng, reading, 2, 5)},
                  {"location": _obj(rng, {"city": _str(rng)}, {"elevation_m": _int(-500, 9000)}),
                   "status": _enum(rng, ["ok", "degraded", "offline"])})
    prompt = (f"Station report from {rng.choice(_CITIES)}: {rng.randint(-5, 35)} C, {rng.randint(10, 99)}% humidity, "
              f"{rng.randint(980, 1040)} hPa.")
    return schema, prompt


FAMILIES: Dict[str, Callable[[random.Random], Tuple[Dict[str, Any], str]]] = {
    "user_profile": _user_profile,
    "order": _order,
    "calendar_event": _calendar_event,
    "product_review": _product_review,
    "http_log": _http_log,
    "recipe": _recipe,
    "support_ticket": _support_ticket,
    "sensor_report": _sensor_report,
}


TOOL_CALL_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "create_calendar_event"},
        "arguments": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 64, "description": "shown in the calendar"},
                "location": {"type": "string", "maxLength": 48},
                "start": {"type": "string", "format": "date-time"},
                "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                "attendees": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1,
                              "maxItems": 8},
                "notes": {"type": "string", "maxLength": 400},
            },
            "required": ["title", "location", "start", "duration_minutes", "attendees", "notes"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
TOOL_CALL_INSTANCE: Dict[str, Any] = {
    "name": "create_calendar_event",
    "arguments": {
        "title": "Quarterly roadmap review with the platform and data teams",
        "location": "Building 4, room 212 (Lisbon office)",
        "start": "2026-12-03T14:30:00Z",
        "duration_minutes": 90,
        "attendees": ["Ada Okafor", "Bruno Lindqvist", "Chiara Moreau <c.moreau@example.org>"],
        "notes": "Bring the capacity plan and the list of open incidents; we decide on the Q1 migration order.",
    },
}
EXTRACTION_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "vendor": {"type": "string", "maxLength": 48},
        "contact": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 32}, "email": {"type": "string", "maxLength": 48},
                           "phone": {"type": "string", "minLength": 7, "maxLength": 20}},
            "required": ["name", "email", "phone"],
            "additionalProperties": False,
        },
        "invoice_number": {"type": "string", "minLength": 3, "maxLength": 16},
        "currency": {"enum": ["EUR", "GBP", "USD"]},
        "total": {"type": "number", "minimum": 0},
        "line_items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"description": {"type": "string", "maxLength": 40},
                               "sku": {"type": "string", "maxLength": 12},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 999}},
                "required": ["description", "sku", "quantity"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 20,
        },
        "summary": {"type": "string", "maxLength": 96},
    },
    "required": ["vendor", "contact", "invoice_number", "currency", "total", "line_items", "summary"],
    "additionalProperties": False,
}
EXTRACTION_INSTANCE: Dict[str, Any] = {
    "vendor": "Ferreira & Novak Industrial Supplies Ltd.",
    "contact": {"name": "Ines Haddad-Kowalski", "email": "accounts.receivable@ferreira-novak.pt",
                "phone": "+351 21 555 0198"},
    "invoice_number": "FNI-2026-11-0457",
    "currency": "EUR",
    "total": 18432.75,
    "line_items": [
        {"description": "Stainless hex bolts M8x40, box of 200", "sku": "HB-M840-200", "quantity": 12},
        {"description": "Nylon lock nuts M8, box of 500", "sku": "LN-M8-500", "quantity": 6},
        {"description": "Angle grinder discs 125 mm (25 pack)", "sku": "AGD125-25", "quantity": 40},
        {"description": "Safety gloves, cut level C, size 9", "sku": "SG-C9", "quantity": 150},
        {"description": "Pallet delivery, Porto depot", "sku": "DLV-PRT", "quantity": 1},
        {"description": "Thread-locking adhesive, 50 ml", "sku": "TLA-50", "quantity": 24},
    ],
    "summary": "Consumables and fasteners for the November maintenance stop, delivered to the Porto depot.",
}


@dataclass(frozen=True)
class Case:
    """One benchmark request: ``prompt`` is sent with ``schema`` (grammar on) or alone (grammar off)."""

    family: str
    prompt: str
    schema: Dict[str, Any]
    features: FrozenSet[str]

    @property
    def schema_json(self) -> str:
        return json.dumps(self.schema)  # declaration order: xgrammar emits properties in this order


def schema_features(schema: Dict[str, Any]) -> FrozenSet[str]:
    """Which of :data:`FEATURES` a schema uses, found by walking it."""
    found = set()

    def walk(node: Any, depth: int) -> None:
        if not isinstance(node, dict):
            return
        if "enum" in node:
            found.add("enum")
        if "pattern" in node:
            found.add("pattern")
        if node.get("type") == "array":
            found.add("array")
            walk(node.get("items"), depth)
        if node.get("type") == "object":
            props = node.get("properties", {})
            if depth > 0:
                found.add("nested")
            if set(props) - set(node.get("required", [])):
                found.add("optional")
            for child in props.values():
                walk(child, depth + 1)

    walk(schema, 0)
    return frozenset(found)


def make_dataset(n: int, seed: int = 0) -> List[Case]:
    """``n`` cases cycling through :data:`FAMILIES` (so any ``n >= 8`` covers every family), each from an RNG seeded by
    ``(seed, index)`` only: case ``i`` is the same whatever ``n`` is."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    names = list(FAMILIES)
    cases = []
    for i in range(n):
        family = names[i % len(names)]
        rng = random.Random(zlib.crc32(f"{seed}:{i}:{family}".encode()))
        schema, task = FAMILIES[family](rng)
        prompt = (f"Request {i + 1}. {task}\n"
                  "Answer with a single JSON object that follows the schema, and nothing else.\n")
        cases.append(Case(family, prompt, schema, schema_features(schema)))
    return cases
