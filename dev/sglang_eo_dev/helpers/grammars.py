"""Test/benchmark grammars, generators of documents they accept, and compiled-grammar / SGLang-grammar factories.

Grammars: ``nested`` (nested JSON schema), ``pattern`` (JSON schema with string patterns and an enum), ``ebnf`` (a
small statement language), ``regex`` (phone numbers). Compiled grammars are cached per process.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any, Dict, List, Tuple

__all__ = [
    "GRAMMARS",
    "NESTED_SCHEMA",
    "PATTERN_SCHEMA",
    "EBNF",
    "REGEX",
    "compiled",
    "matcher",
    "next_token_bitmask",
    "doc_text",
    "doc_tokens",
    "nested_doc_text",
    "pattern_doc_text",
    "ebnf_doc_text",
    "regex_doc_text",
    "sglang_grammar",
    "ensure_sglang_importable",
    "CorruptMatcher",
]

NESTED_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string"},
                                "qty": {"type": "integer"},
                                "price": {"type": "number"},
                            },
                            "required": ["sku", "qty", "price"],
                        },
                    },
                },
                "required": ["id", "items"],
            },
        },
    },
    "required": ["name", "age", "active", "address", "tags", "orders"],
}

PATTERN_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "email": {"type": "string", "pattern": "^[a-z]{2,12}@[a-z]{2,10}\\.(com|org|net)$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "integer"},
        "notes": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]{1,40}$"}},
    },
    "required": ["id", "email", "date", "status", "score", "notes"],
}

EBNF = r"""
root ::= "BEGIN\n" stmt+ "END"
stmt ::= ident " = " expr ";\n"
expr ::= term (" " op " " term)*
op ::= "+" | "-" | "*"
term ::= ident | num | "(" expr ")"
ident ::= [a-z] [a-z0-9_]*
num ::= [0-9]+
"""

REGEX = r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext [0-9]{1,4})?"

GRAMMARS = ("nested", "pattern", "ebnf", "regex")

_W = "alpha beta gamma delta omega river stone maple cedar north south lake hill park main oak".split()


def _word(rng: random.Random) -> str:
    return rng.choice(_W)


def _phrase(rng: random.Random, lo: int = 1, hi: int = 4) -> str:
    return " ".join(_word(rng) for _ in range(rng.randint(lo, hi)))


def nested_doc_text(rng: random.Random) -> str:
    doc = {
        "name": _phrase(rng, 2, 3).title(),
        "age": rng.randint(1, 99),
        "active": rng.random() < 0.5,
        "address": {"street": f"{rng.randint(1, 999)} {_word(rng).title()} St", "city": _word(rng).title(),
                    "zip": f"{rng.randint(10000, 99999)}"},
        "tags": [_word(rng) for _ in range(rng.randint(0, 4))],
        "orders": [
            {"id": rng.randint(1, 10**6),
             "items": [{"sku": f"{_word(rng)[:3].upper()}-{rng.randint(100, 999)}", "qty": rng.randint(1, 20),
                        "price": round(rng.uniform(0.5, 500.0), 2)} for _ in range(rng.randint(1, 3))]}
            for _ in range(rng.randint(1, 3))
        ],
    }
    return json.dumps(doc, indent=rng.choice([None, 2]))


def pattern_doc_text(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    doc = {
        "id": "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(3)) + f"-{rng.randint(0, 9999):04d}",
        "email": "".join(rng.choice(letters) for _ in range(rng.randint(2, 12))) + "@"
                 + "".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) + rng.choice([".com", ".org", ".net"]),
        "date": f"20{rng.randint(0, 99):02d}-{rng.randint(1, 12):02d}-{rng.randint(1, 29):02d}",
        "status": rng.choice(["active", "inactive", "pending"]),
        "score": rng.randint(-100, 1000),
        "notes": [_phrase(rng, 1, 5)[:40] for _ in range(rng.randint(0, 3))],
    }
    return json.dumps(doc)


def _expr(rng: random.Random, depth: int = 0) -> str:
    terms = []
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.4:
            terms.append(_word(rng) + (str(rng.randint(0, 9)) if rng.random() < 0.3 else ""))
        elif r < 0.8 or depth >= 2:
            terms.append(str(rng.randint(0, 9999)))
        else:
            terms.append("(" + _expr(rng, depth + 1) + ")")
    out = terms[0]
    for t in terms[1:]:
        out += f" {rng.choice('+-*')} {t}"
    return out


def ebnf_doc_text(rng: random.Random) -> str:
    body = "".join(f"{_word(rng)}_{i} = {_expr(rng)};\n" for i in range(rng.randint(1, 6)))
    return "BEGIN\n" + body + "END"


def regex_doc_text(rng: random.Random) -> str:
    s = f"({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
    if rng.random() < 0.5:
        s = "+1 " + s
    if rng.random() < 0.5:
        s += f" ext {rng.randint(1, 9999)}"
    return s


_DOCS = {"nested": nested_doc_text, "pattern": pattern_doc_text, "ebnf": ebnf_doc_text, "regex": regex_doc_text}


def doc_text(grammar: str, rng: random.Random) -> str:
    return _DOCS[grammar](rng)


def doc_tokens(grammar: str, rng: random.Random, vocab_size: int) -> Tuple[int, ...]:
    """Token ids of a fresh valid document, followed by EOS (the grammar terminates on it)."""
    from sglang_eo_dev.helpers.tokenizers import EOS_ID, encode

    return encode(doc_text(grammar, rng), vocab_size) + (EOS_ID,)


@functools.lru_cache(maxsize=None)
def _compiler(vocab_size: int) -> Any:
    import xgrammar as xgr

    from sglang_eo_dev.helpers.tokenizers import tokenizer_info

    return xgr.GrammarCompiler(tokenizer_info(vocab_size), max_threads=2)


@functools.lru_cache(maxsize=None)
def compiled(grammar: str, vocab_size: int) -> Any:
    """``xgrammar.CompiledGrammar`` of a named grammar for a vocabulary (cached)."""
    c = _compiler(vocab_size)
    if grammar == "nested":
        return c.compile_json_schema(json.dumps(NESTED_SCHEMA), any_whitespace=True)
    if grammar == "pattern":
        return c.compile_json_schema(json.dumps(PATTERN_SCHEMA), any_whitespace=True)
    if grammar == "ebnf":
        return c.compile_grammar(EBNF)
    if grammar == "regex":
        return c.compile_regex(REGEX)
    raise ValueError(f"unknown grammar {grammar!r}; expected one of {GRAMMARS}")


def matcher(grammar: str, vocab_size: int, prefix: List[int] = (), cls: Any = None) -> Any:
    """A fresh ``xgrammar.GrammarMatcher`` (or of its subclass ``cls``) advanced over ``prefix``."""
    import xgrammar as xgr

    m = (cls or xgr.GrammarMatcher)(compiled(grammar, vocab_size), max_rollback_tokens=-1)
    for t in prefix:
        if not m.accept_token(int(t)):
            raise ValueError(f"prefix token {t} rejected by {grammar}")
    return m


def next_token_bitmask(m: Any, vocab_size: int) -> Any:
    """One-row xgrammar bitmask of the tokens ``m`` (an ``xgrammar.GrammarMatcher``) allows next; all-allowed (-1)
    once it terminated."""
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(1, vocab_size)
    if not m.is_terminated():
        m.fill_next_token_bitmask(bm, 0)
    return bm


def ensure_sglang_importable() -> None:
    """``import sglang`` pulls torchvision via transformers; the CPU venvs need the project's compat hook for that."""
    try:
        from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook
    except ImportError:
        return  # a venv with a matching torchvision needs nothing
    install_import_hook()


def sglang_grammar(grammar: str, vocab_size: int, prefix: List[int] = ()) -> Any:
    """SGLang's real ``XGrammarGrammar`` (of the running venv) over a fresh matcher advanced over ``prefix``."""
    ensure_sglang_importable()
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar

    g = XGrammarGrammar(matcher(grammar, vocab_size, prefix), vocab_size, compiled(grammar, vocab_size), None)
    for t in prefix:
        g.accepted_tokens.append(int(t))
    return g


@functools.lru_cache(maxsize=None)
def guidance_tokenizer(vocab_size: int) -> Any:
    """``llguidance.LLTokenizer`` of the cached BPE, ``vocab_size`` wide, EOS the stop token (as SGLang builds it)."""
    import llguidance.hf

    from sglang_eo_dev.helpers.tokenizers import EOS_ID, hf_tokenizer

    return llguidance.hf.from_tokenizer(hf_tokenizer(vocab_size), vocab_size, eos_token=EOS_ID)


def guidance_source(grammar: str, strict: bool = False) -> str:
    """llguidance's grammar text of a named grammar (JSON schemas and the regex; llguidance takes no xgrammar EBNF).
    JSON: flexible whitespace (SGLang's default), or with ``strict`` none but the documents' ``", "`` / ``": "``
    separators (SGLang's ``--constrained-json-disable-any-whitespace``; keys and punctuation are then forced)."""
    import llguidance

    options = ({"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "} if strict else None)
    if grammar == "nested":
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(NESTED_SCHEMA), defaults=options))
    if grammar == "pattern":
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PATTERN_SCHEMA), defaults=options))
    if grammar == "regex":
        return str(llguidance.grammar_from("regex", REGEX))
    raise ValueError(f"no llguidance form of {grammar!r}; expected nested, pattern or regex")


def guidance_grammar(grammar: str, vocab_size: int, prefix: List[int] = (), strict: bool = False) -> Any:
    """SGLang's real ``GuidanceGrammar`` (of the running venv) of a named grammar (:func:`guidance_source`), advanced
    over ``prefix``."""
    ensure_sglang_importable()
    from sglang.srt.constrained.llguidance_backend import GuidanceGrammar

    g = GuidanceGrammar(guidance_tokenizer(vocab_size), guidance_source(grammar, strict))
    for t in prefix:
        g.accept_token(int(t))
    return g


class CorruptMatcher:
    """A stand-in for a broken xgrammar matcher: accepts every token, then raises when asked for a mask row (it breaks
    the batched native walk and the per-request walk alike). Put it in ``XGrammarGrammar.matcher`` to inject a
    grammar that fails during the tree mask build."""

    def is_terminated(self) -> bool:
        return False

    def accept_token(self, token: int) -> bool:
        return True

    def rollback(self, k: int) -> None:
        pass

    def fill_next_token_bitmask(self, bitmask: Any, idx: int) -> None:
        raise RuntimeError("boom: corrupt matcher")


class Recorder:
    """A ledger grammar that accepts everything and records what it was fed (the exactly-once tests)."""

    def __init__(self) -> None:
        self.fed: List[int] = []

    def accept_token(self, token: int) -> bool:
        self.fed.append(token)
        return True

    def is_terminated(self) -> bool:
        return False
