"""0.5.16: a batch's ``can_mask`` verdict is looked at once per step (``Band016.mask_verdict``): made by the scheduler's
overlap decision, taken by the same batch's verify entry, and looked at again for any other batch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, cast

import pytest

from sglang_eagle_overlap.adapters.v0_5_16 import band


class XGrammarGrammar:  # the name SGLang's xgrammar grammar has: maskable
    matcher = None


class OtherBackendGrammar:  # another backend: not maskable by the plugin
    pass


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """Every batch ``can_mask`` was asked about, in order."""
    seen: List[Any] = []
    real = band.can_mask

    def counting(batch: Any) -> bool:
        seen.append(batch)
        return real(batch)

    monkeypatch.setattr(band, "can_mask", counting)
    return seen


def _batch(*grammars: Any) -> Any:
    return SimpleNamespace(reqs=[SimpleNamespace(grammar=g) for g in grammars])


def test_the_verify_entry_takes_the_overlap_decisions_verdict_once(looks: List[Any]) -> None:
    b = band.Band016(cast(Any, None))  # the verdict reads no step
    batch = _batch(XGrammarGrammar(), None)
    assert b.mask_verdict(batch, keep=True) is True
    assert b.mask_verdict(batch) is True  # the verify entry: taken, not looked at again
    assert looks == [batch] and b.verdict is None
    assert b.mask_verdict(batch) is True  # taken once: a second verify looks again
    assert looks == [batch, batch]


def test_a_verdict_is_not_taken_for_another_request_list_or_a_grown_one(looks: List[Any]) -> None:
    b = band.Band016(cast(Any, None))  # the verdict reads no step
    ok = _batch(XGrammarGrammar())
    assert b.mask_verdict(ok, keep=True) is True
    other = _batch(OtherBackendGrammar())  # a filtered batch: a new request list
    assert b.mask_verdict(other) is False
    assert b.mask_verdict(ok, keep=True) is True
    ok.reqs.append(SimpleNamespace(grammar=OtherBackendGrammar()))  # merged in place: the same list, longer
    assert b.mask_verdict(ok) is False
    assert looks == [ok, other, ok, ok]


def test_the_overlap_decision_always_looks(looks: List[Any]) -> None:
    b = band.Band016(cast(Any, None))  # the verdict reads no step
    batch = _batch(XGrammarGrammar())
    b.mask_verdict(batch, keep=True)
    batch.reqs[0].grammar = OtherBackendGrammar()
    assert b.mask_verdict(batch, keep=True) is False  # the next step's decision: looked at, not reused
    assert b.mask_verdict(batch) is False
    assert len(looks) == 2


class ReasonerGrammarObject:  # the name of SGLang's reasoning wrapper: the plugin looks inside it
    def __init__(self, grammar: Any) -> None:
        self.grammar = grammar


def test_llguidance_batches_are_the_plugins_and_another_backend_keeps_sglangs_path() -> None:
    """llguidance's mask is xgrammar's bitmask layout, so its batches stay in the overlap (a real ``GuidanceGrammar``
    of the installed SGLang, bare or behind the reasoning wrapper); one grammar of another backend (outlines' boolean
    mask) leaves the whole batch to SGLang."""
    from sglang_eo_dev.helpers import grammars as G

    guidance = G.guidance_grammar("regex", 32000)
    assert band.can_mask(_batch(guidance, None, XGrammarGrammar()))
    assert band.can_mask(_batch(ReasonerGrammarObject(guidance)))
    assert not band.can_mask(_batch(guidance, OtherBackendGrammar()))
    assert not band.can_mask(_batch(ReasonerGrammarObject(OtherBackendGrammar())))
