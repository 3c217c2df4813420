"""Prompts, grammars and small helpers shared by the engine tests."""

from __future__ import annotations

import json
from typing import Any

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a small city",
    "List of items:",
    "Summer morning by the river",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24}

# Short, bounded grammars so even the random model finishes inside max_new_tokens.
REGEX = r"(yes|no|maybe), [0-9]{2} (red|green|blue)\."
EBNF = 'root ::= "answer: " ("alpha" | "beta" | "gamma") " " [0-9] [0-9]? "."'


def ebnf_matches(text: str) -> bool:
    import re

    return re.fullmatch(r"answer: (alpha|beta|gamma) [0-9][0-9]?\.", text) is not None


def accept_length(meta: dict[str, Any]) -> float:
    """Tokens per verify step as SGLang reports it for one request (completion tokens / verify steps)."""
    verify = meta.get("spec_verify_ct") or 0
    return meta["completion_tokens"] / verify if verify else 0.0


def output_ids(out: dict[str, Any]) -> list[int]:
    ids = out.get("output_ids")
    if ids is None:
        ids = out["meta_info"].get("output_ids")
    return list(ids) if ids is not None else []


def schema_str(schema: dict[str, Any]) -> str:
    return json.dumps(schema)
