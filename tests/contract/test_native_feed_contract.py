"""Contract (both bands, the installed SGLang): a run the plugin feeds to the bare matcher of SGLang's real
``XGrammarGrammar`` (``plugin_state.feed_request``: the ledger's native feed plus ``record_on_xgrammar``)
leaves that object as SGLang's own ``accept_token`` loop leaves it -- matcher state, ``accepted_tokens``,
``current_token`` -- for a plain run, a run the grammar terminates, a rejected token, and a run after termination.
If SGLang's wrapper starts keeping other state, or stops being a matcher with two lists, this fails."""

from __future__ import annotations

import random

import pytest

from sglang_eagle_overlap.integration.requests import feed_run, is_xgrammar
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.plugin_state import feed_request
from sglang_eo_dev.helpers.steps import make_step

VOCAB = 32000


def _sglang_loop(grammar, tokens):
    """SGLang's own feed of a run (the loop of ``_accept_grammar_tokens``): stop at termination, raise on rejection."""
    for t in tokens:
        grammar.accept_token(t)
        if grammar.is_terminated():
            break


def _state(g):
    return (bool(g.matcher.is_terminated()), list(g.accepted_tokens), getattr(g, "current_token", None),
            G.next_token_bitmask(g.matcher, VOCAB).tolist())


def _req(grammar, output_ids):
    """A real SGLang ``Req`` of the installed band that produced ``output_ids``, with ``grammar``."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "", [1, 2, 3], SamplingParams(max_new_tokens=4096))
    req.output_ids.extend(output_ids)
    req.grammar = grammar
    return req


def _doc():
    return list(G.doc_tokens("regex", random.Random(11), VOCAB))


@pytest.mark.parametrize("case", ["plain", "terminates", "rejected", "after_end"])
def test_native_feed_leaves_sglangs_grammar_as_its_own_accept_would(case, monkeypatch):
    doc = _doc()
    bad = next(t for t in range(VOCAB) if t not in doc)  # a token the regex document never uses
    at = {"plain": 2, "terminates": len(doc) - 2, "rejected": 2, "after_end": len(doc)}[case]
    run = {"plain": doc[2:5], "terminates": doc[-2:], "rejected": [doc[2], bad, doc[3]],
           "after_end": [doc[0]]}[case]
    ours, theirs = G.sglang_grammar("regex", VOCAB, doc[:at]), G.sglang_grammar("regex", VOCAB, doc[:at])
    assert is_xgrammar(ours)
    if case == "rejected":
        with pytest.raises(ValueError, match=f"Tokens not accepted: {bad}"):
            _sglang_loop(theirs, run)
    else:
        _sglang_loop(theirs, run)
    req = _req(ours, doc[:at])
    calls = []
    orig = type(ours).accept_token
    monkeypatch.setattr(type(ours), "accept_token", lambda self, t: (calls.append(t), orig(self, t))[1])
    out = feed_request(make_step(), req, at, run)
    assert calls == []  # the wrapper was not called: the matcher was fed directly
    assert _state(ours) == _state(theirs)
    assert (out.error is not None) == (case == "rejected")
    assert out.terminated == (case in ("terminates", "after_end"))


def test_feed_run_keeps_the_rejected_requests_prefix_and_aborts_it():
    doc = _doc()
    bad = next(t for t in range(VOCAB) if t not in doc)
    req = _req(G.sglang_grammar("regex", VOCAB, doc[:2]), doc[:2])
    kept = feed_run(make_step(), req, 2, [doc[2], bad])
    assert kept == [doc[2]] and req.grammar.accepted_tokens == doc[:3] and req.grammar.current_token == bad
    assert req.to_finish is not None and "Grammar accept_token failed" in req.to_finish.message
