"""Grammar-forced drafts on a grammar whose forced text never ends: a JSON schema with no finite document (``node``
requires ``next``, itself a ``node``) forces ``{"next": {"next": ...`` forever, and xgrammar's
``find_jump_forward_string`` then allocates until the process runs out of memory. Such a grammar is found when its
request is admitted (:func:`forcing_is_bounded`: some rule matches no finite string) and never asked for forced text;
ordinary grammars keep theirs. The end-to-end check runs in a subprocess with a capped address space and a timeout,
so a search that never ends fails this test, not the machine running it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_eagle_overlap.core.forced import forcing_is_bounded

ROOT = Path(__file__).resolve().parents[2]

NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"],
        "additionalProperties": False}
ENDLESS = {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}
# the same recursion with ``next`` optional: ``{}`` ends it
ENDS = {"$defs": {"node": dict(NODE, required=[])}, "$ref": "#/$defs/node"}

# A vocabulary worked out by hand: every character of '{"next": ' and '}' alone, plus '{"' and 'next' (a character
# outside it encodes as 99).
_CHILD = textwrap.dedent(r'''
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    import xgrammar as xgr
    from sglang_eagle_overlap.core.forced import ForcedDrafts
    VOCAB = ["</s>", "{", '"', "n", "e", "x", "t", ":", " ", "}", '{"', "next"]
    def encode(s):
        out, i = [], 0
        while i < len(s):
            best = max((t for t in range(1, len(VOCAB)) if s.startswith(VOCAB[t], i)), key=lambda t: len(VOCAB[t]),
                       default=None)
            out.append(99 if best is None else best)  # 99: a character outside the vocabulary
            i += 1 if best is None else len(VOCAB[best])
        return out
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[0]))
    limit = 3 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {}
    for name, schema in json.loads(sys.argv[2]).items():
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgr.GrammarMatcher(grammar)
        f = ForcedDrafts(width=6, require_admission=True)
        f.encode = encode
        admitted = f.admit(matcher, grammar)
        assert matcher.accept_string('{"')
        f.begin(1)
        f.record(matcher, 0)
        toks = f.continuation(matcher)
        assert matcher.accept_string('next": '), "the matcher's state is unchanged"
        out[name] = [admitted, list(toks), f.recorded_nodes]
    print(json.dumps(out))
''')


def test_an_endless_forced_text_is_never_searched_and_an_ending_one_still_is():
    """In a process capped at 3 GiB, after '{"': the endless schema is not admitted and records nothing (no search);
    the ending one is admitted and forces 'next": ' there (the only key), tokenized 'next' '"' ':' ' ' (ids 11 2 7 8:
    no token of this vocabulary spans two of them, so none is held back)."""
    schemas = json.dumps({"endless": ENDLESS, "ends": ENDS})
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT), schemas], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["endless"] == [False, [], 0]
    assert out["ends"] == [True, [11, 2, 7, 8], 1]


@pytest.mark.parametrize("text, bounded", [
    ('root ::= "a" root', False),  # every 'a' forces another
    ('root ::= "a" root | "b"', True),
    ('root ::= x "c"\nx ::= ("a" x)*', True),  # the star may match nothing
    ('root ::= x "c"\nx ::= ("a" x)+', False),  # the plus needs one x, which needs one more
    ('root ::= ("a" | "b"){2,4} [^a\\]]+ (=("c"))', True),  # repetition range, negated class, lookahead
    ('root ::= (x){0,3} "c"\nx ::= "a" x', False),  # x is unproductive even where root does not need it
    ('root ::= Regex("^[a-z]{2}$", json_string=true) "c"', True),
    ('root ::= TagDispatch(("<a>", x))\nx ::= "b"', False),  # not modelled: vouches for nothing
])
def test_which_grammars_have_forced_text_that_ends(text, bounded):
    assert forcing_is_bounded(text) is bounded


def test_schema_grammars_compiled_by_xgrammar():
    """Compiled JSON schemas as served: the endless one, it inside an anyOf beside an integer (a document exists, but
    the object branch still forces forever), the optional recursion, an ordinary schema with a pattern, bounds and an
    enum, and a long chain of definitions, open and closed into a cycle."""
    import xgrammar as xgr
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["</s>", "a"], stop_token_ids=[0]))

    def bounded(schema: object) -> bool:
        return forcing_is_bounded(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))

    ordinary = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "age": {"type": "integer", "minimum": 3},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}, "e": {"enum": ["a", 1, None]}}}
    assert not bounded(ENDLESS)
    assert not bounded({"$defs": {"node": NODE}, "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/node"}]})
    assert bounded(ENDS)
    assert bounded(ordinary)
    assert forcing_is_bounded(compiler.compile_builtin_json_grammar())
    # a chain of 60 required definitions ends at an integer; closed into a cycle it never ends
    chain = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
             for i in range(60)}
    chain["d60"] = {"type": "integer"}
    assert bounded({"$defs": chain, "$ref": "#/$defs/d0"})
    chain["d60"] = {"$ref": "#/$defs/d0"}
    assert not bounded({"$defs": chain, "$ref": "#/$defs/d0"})


def test_admission_is_decided_once_per_grammar_and_remembered_per_matcher(monkeypatch):
    """In this process (no forced text is asked for, so nothing can run away): ``admit`` answers the schema's verdict,
    asks :func:`forcing_is_bounded` once per compiled grammar however many matchers share it, answers a matcher it
    has seen without asking again, and drops the entries of freed grammars and matchers (a new grammar is judged on
    its own)."""
    import gc

    import xgrammar as xgr

    from sglang_eagle_overlap.core import forced as forced_mod
    from sglang_eagle_overlap.core.forced import ForcedDrafts

    asked = []

    def counting(grammar: object) -> bool:
        asked.append(id(grammar))  # not the object: the map must be free to drop it
        return forcing_is_bounded(grammar)

    monkeypatch.setattr(forced_mod, "forcing_is_bounded", counting)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["</s>", "{", '"', "next", "}"], stop_token_ids=[0]))
    ends = compiler.compile_json_schema(json.dumps(ENDS), any_whitespace=False)
    endless = compiler.compile_json_schema(json.dumps(ENDLESS), any_whitespace=False)
    f = ForcedDrafts(width=4, require_admission=True)
    first, second = xgr.GrammarMatcher(ends), xgr.GrammarMatcher(ends)
    assert f.admit(first, ends) is True
    assert f.admit(second, ends) is True and asked == [id(ends)]  # the grammar's verdict, decided once
    looping = xgr.GrammarMatcher(endless)
    assert f.admit(looping, endless) is False and asked == [id(ends), id(endless)]
    assert f.admit(looping, ends) is False and len(asked) == 2  # a matcher seen before: its own verdict, no question
    del first, second, ends
    gc.collect()
    assert len(f._verdicts) == 1 and len(f._bounded) == 1  # the freed grammar's and matchers' entries are gone
    again = compiler.compile_json_schema(json.dumps(ENDS), any_whitespace=False)
    assert f.admit(xgr.GrammarMatcher(again), again) is True and len(asked) == 3  # a new grammar object: judged anew
