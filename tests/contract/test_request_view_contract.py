"""Contract (both bands, the installed SGLang's real ``Req`` and ``XGrammarGrammar``): the tree-mask row of a request
(``integration.requests.mask_request_for``) is made once and shared by every step while nothing it was made from
changed (``RequestView``, kept on the ``Req``), and is made again at the first step after the host swapped the
request's grammar object or that grammar's matcher, or finished or started aborting the request. A stale row would
walk a matcher the request no longer uses: these fail if the view outlives what it was made from."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sglang_eagle_overlap.core.mask import MaskRequest
from sglang_eagle_overlap.integration.requests import VIEW_ATTR, mask_request_for, mask_requests
from sglang_eo_dev.helpers import grammars as G

VOCAB = 32000


def _req(rid="r"):
    """A real SGLang ``Req`` of the installed band with an ``XGrammarGrammar`` over the regex grammar."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=64))
    doc = list(G.doc_tokens("regex", random.Random(5), VOCAB))
    req.grammar = G.sglang_grammar("regex", VOCAB, doc[:2])
    return req


def test_a_requests_row_is_made_once_and_shared_while_nothing_changed():
    req = _req()
    first = mask_request_for(req)
    assert first == MaskRequest(req.grammar.matcher, None, "r")  # the bare matcher: the native walk
    assert mask_request_for(req) is first  # the next step: the same row, nothing derived again
    assert getattr(req, VIEW_ATTR).row is first
    batch = mask_requests([req, req])
    assert batch[0] is first and batch.native == [0, 1] and batch.matchers == [req.grammar.matcher] * 2


def test_a_swapped_grammar_or_matcher_gets_a_new_row_at_the_next_step():
    req = _req()
    old = mask_request_for(req)
    req.grammar = G.sglang_grammar("regex", VOCAB)  # the host rebuilt the request's grammar object
    rebuilt = mask_request_for(req)
    assert rebuilt is not old and rebuilt.matcher is req.grammar.matcher
    req.grammar.matcher = G.CorruptMatcher()  # the same grammar object, another matcher inside it
    swapped = mask_request_for(req)
    assert swapped.matcher is req.grammar.matcher and swapped.grammar is None
    assert mask_request_for(req) is swapped


def test_a_finished_or_aborting_request_is_unconstrained_from_that_step_on():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req = _req()
    constrained = mask_request_for(req)
    req.to_finish = FINISH_ABORT("x")
    assert mask_request_for(req) == MaskRequest(None, None, "r")
    req.to_finish = None
    assert mask_request_for(req) is constrained
    req.finished_reason = FINISH_ABORT("x")
    assert req.finished() and mask_request_for(req) == MaskRequest(None, None, "r")
    req.grammar = None
    assert mask_request_for(req) == MaskRequest(None, None, "r")


def test_a_wrapped_grammar_is_walked_through_its_object():
    req = _req()

    class Wrapper:  # not SGLang's XGrammarGrammar: the generic walk through the grammar object API
        def __init__(self, inner):
            self.inner = inner

    req.grammar = Wrapper(req.grammar)
    row = mask_request_for(req)
    assert row.matcher is None and row.grammar is req.grammar
    assert mask_request_for(req) is row


def test_the_shared_row_cannot_be_changed_by_a_caller():
    row = mask_request_for(_req())
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.matcher = None  # type: ignore[misc]


def test_a_request_object_that_takes_no_new_attribute_still_gets_its_row():
    class SlotReq:
        __slots__ = ("grammar", "rid", "to_finish")

        def finished(self):
            return False

    inner = _req()
    req = SlotReq()
    req.grammar, req.rid, req.to_finish = inner.grammar, "s", None
    assert mask_request_for(req) == MaskRequest(inner.grammar.matcher, None, "s")
