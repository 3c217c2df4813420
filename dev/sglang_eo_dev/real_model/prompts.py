"""Prompts and JSON schemas for the real model: the draft's training set and held-apart evaluation prompts.

The schemas have the shapes users send (extraction, classification with an enum, tool arguments, nested records,
arrays, a pattern, ``anyOf``). Prompts are chat messages (rendered with the model's chat template by the caller).

* :func:`training_requests` -- deterministic (``seed``) prompts built from templates x entities; a share of them with
  a schema (the draft is judged on schema-constrained decoding), the rest free: chat, reasoning-style, tool call.
* :data:`HELD_APART` -- evaluation prompts whose texts (people, products, places, questions) never occur in the
  training set; they use the same schema families. :func:`held_apart_requests` returns them.

Invariant: no held-apart user message is a training user message (checked by the unit test).
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Optional

__all__ = ["Request", "SCHEMAS", "HELD_APART", "TOOL", "held_apart_requests", "training_requests", "messages"]

SYSTEM = "You are a helpful assistant. When asked for JSON, answer with JSON only."

SCHEMAS: dict[str, dict[str, Any]] = {
    # extraction: flat record with a few types
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    # classification: enum + number
    "sentiment": {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number"},
        },
        "required": ["sentiment", "confidence"],
        "additionalProperties": False,
    },
    # tool arguments with a pattern and an enum
    "weather_args": {
        "type": "object",
        "properties": {
            "location": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        },
        "required": ["location", "unit", "date"],
        "additionalProperties": False,
    },
    # nested record with an array of objects
    "order": {
        "type": "object",
        "properties": {
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name", "email"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"}},
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["customer", "items"],
        "additionalProperties": False,
    },
    # array of strings + boolean
    "recipe": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "ingredients": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 6},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["title", "ingredients", "vegetarian"],
        "additionalProperties": False,
    },
    # anyOf: either a found answer or an explicit unknown
    "answer": {
        "type": "object",
        "properties": {
            "answer": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "sources": {"type": "integer"},
        },
        "required": ["answer", "sources"],
        "additionalProperties": False,
    },
}

# One tool for the tool-call prompts (OpenAI function shape); its parameters are the weather_args schema.
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather forecast for a place and a date.",
        "parameters": SCHEMAS["weather_args"],
    },
}


@dataclasses.dataclass(frozen=True)
class Request:
    """One chat prompt; ``schema`` names an entry of :data:`SCHEMAS` (None: free answer)."""

    user: str
    schema: Optional[str] = None

    def schema_json(self) -> Optional[str]:
        return json.dumps(SCHEMAS[self.schema]) if self.schema else None


def messages(req: Request) -> list[dict[str, str]]:
    """The chat messages for ``req`` (system + user)."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": req.user}]


_FIRST = ("Maria", "John", "Aisha", "Kenji", "Lucas", "Elena", "Omar", "Sofia", "David", "Mei", "Peter", "Fatima",
          "Ivan", "Chloe", "Ravi", "Anna", "Tom", "Laura", "Hassan", "Julia")
_LAST = ("Lopez", "Smith", "Khan", "Tanaka", "Silva", "Petrova", "Haddad", "Rossi", "Brown", "Chen", "Novak",
         "Garcia", "Müller", "Dubois", "Patel", "Berg", "Walker", "Moreau", "Ali", "Costa")
_CITIES = ("Madrid", "Boston", "Karachi", "Osaka", "Lisbon", "Sofia", "Beirut", "Milan", "Denver", "Shanghai",
           "Prague", "Seville", "Kyiv", "Lyon", "Mumbai", "Oslo", "Leeds", "Nantes", "Cairo", "Porto")
_PRODUCTS = ("laptop", "desk lamp", "coffee mug", "notebook", "backpack", "headphones", "water bottle", "keyboard",
             "phone case", "umbrella", "running shoes", "tea kettle")
_REVIEWS_POS = ("I love this {p}, it works perfectly.", "The {p} arrived early and the quality is great.",
                "Best {p} I have ever bought.", "Really happy with the {p}, would buy again.")
_REVIEWS_NEG = ("The {p} broke after two days.", "Terrible {p}, it stopped working and support never answered.",
                "I regret buying this {p}.", "The {p} is cheap plastic and arrived damaged.")
_REVIEWS_NEU = ("The {p} is okay, nothing special.", "It is a {p}. It does what it says.",
                "The {p} arrived on Tuesday.", "Average {p} for the price.")
_DISHES = ("tomato soup", "pancakes", "chicken curry", "guacamole", "lentil stew", "fried rice", "apple pie",
           "greek salad", "beef tacos", "mushroom risotto", "banana bread", "vegetable omelette")
_QUESTIONS = ("What is the boiling point of water at sea level?", "Who wrote Romeo and Juliet?",
              "What is the largest planet in the solar system?", "How many legs does a spider have?",
              "What is the capital of Japan?", "What gas do plants absorb from the air?",
              "What is the name of my neighbour's cat?", "How many days are in a leap year?",
              "Which ocean is the largest?", "What was I thinking about yesterday?")
_CHAT = ("Give me three tips for a good night's sleep.", "Explain what a database index is in two sentences.",
         "Write a short thank-you note to a colleague.", "What are the benefits of regular exercise?",
         "Describe a sunny day at the beach.", "How do I make a cup of tea?",
         "Summarize why recycling matters.", "What should I pack for a weekend hiking trip?")
_REASON = ("A train leaves at 3 pm and travels for 2 hours. When does it arrive? Think step by step.",
           "If I have 5 apples and give away 2, how many are left? Explain your reasoning.",
           "Is 17 a prime number? Reason it out.", "What is 12 times 4? Show the steps.",
           "Tom is older than Ann and Ann is older than Bob. Who is the youngest? Think it through.",
           "A shirt costs 20 dollars with 25 percent off. What is the price? Work it out.")


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _templated(rng: random.Random, first: tuple, last: tuple, cities: tuple, products: tuple, dishes: tuple,
               questions: tuple) -> list[Request]:
    """One request per schema family, drawn with ``rng`` from the given entity pools."""
    name = f"{rng.choice(first)} {rng.choice(last)}"
    city = rng.choice(cities)
    age = rng.randint(19, 80)
    prod = rng.choice(products)
    review = rng.choice(rng.choice((_REVIEWS_POS, _REVIEWS_NEG, _REVIEWS_NEU))).format(p=prod)
    prod2 = rng.choice(products)
    dish = rng.choice(dishes)
    q = rng.choice(questions)
    email = f"{name.split()[0].lower()}@example.com"
    return [
        Request(f'Extract the person as JSON (name, age, city): "{name}, {age}, lives in {city}."', "person"),
        Request(f'Classify the sentiment of this review as JSON: "{review}"', "sentiment"),
        Request(f"Call get_weather for {city} in celsius on {_date(rng)}. Reply with the arguments as JSON.",
                "weather_args"),
        Request(f"{name} ({email}) ordered {rng.randint(1, 5)} {prod} and {rng.randint(1, 3)} {prod2}. "
                "Write the order as JSON.", "order"),
        Request(f"Give a simple recipe for {dish} as JSON.", "recipe"),
        Request(f"{q} Answer as JSON with the number of sources you used; null if you do not know.", "answer"),
    ]


def training_requests(n_rounds: int = 6, seed: int = 0) -> list[Request]:
    """``n_rounds`` x one request per schema family, plus free chat, reasoning-style and tool-call prompts."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    for _ in range(n_rounds):
        reqs += _templated(rng, _FIRST, _LAST, _CITIES, _PRODUCTS, _DISHES, _QUESTIONS)
    reqs += [Request(c) for c in _CHAT[:4]]
    reqs += [Request(r) for r in _REASON[:3]]
    reqs += [Request(f"What's the weather in {c} tomorrow? Use the get_weather tool: answer with a JSON object "
                     f'{{"name": "get_weather", "arguments": {{...}}}}.') for c in _CITIES[:2]]
    seen, out = set(), []
    for r in reqs:
        if (r.user, r.schema) not in seen:
            seen.add((r.user, r.schema))
            out.append(r)
    return out


# Held-apart entity pools: no name, city, product, dish or question is shared with the training pools.
_H_FIRST = ("Nora", "Samuel", "Yuki", "Carlos", "Ingrid", "Tariq")
_H_LAST = ("Okafor", "Lindqvist", "Nakamura", "Herrera", "Schmidt", "Farouk")
_H_CITIES = ("Dublin", "Nairobi", "Kyoto", "Valencia", "Hamburg", "Tunis")
_H_PRODUCTS = ("blender", "bicycle helmet", "desk chair", "electric toothbrush")
_H_DISHES = ("pumpkin soup", "falafel wraps", "carrot cake", "shrimp paella")
_H_QUESTIONS = ("What is the freezing point of water in Celsius?", "Who painted the Mona Lisa?",
                "What is my sister's favourite colour?", "How many continents are there?")

HELD_APART: list[Request] = _templated(random.Random(1234), _H_FIRST, _H_LAST, _H_CITIES, _H_PRODUCTS, _H_DISHES,
                                       _H_QUESTIONS) + _templated(random.Random(99), _H_FIRST, _H_LAST, _H_CITIES,
                                                                  _H_PRODUCTS, _H_DISHES, _H_QUESTIONS)


def held_apart_requests() -> list[Request]:
    """The held-apart evaluation prompts (schema-constrained ones; the same texts serve unconstrained runs)."""
    return list(HELD_APART)
