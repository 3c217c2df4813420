"""0.5.23: the ledger's prune keeps every running request when a small (prefill) result arrives, and a failure of the
verify hook's first step leaves no verify context behind.

More than 64 constrained requests decode (the prune starts past 64 entries); then a prefill result for one new request
arrives, whose batch holds that request alone. The decoding requests' ledger entries must survive it, so a later run
that skips tokens is still caught as a gap (re-anchored and counted as a ledger reset)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from sglang_eo_dev.helpers.devices import verify_result
from sglang_eo_dev.helpers.grammars import sglang_grammar
from tests.adapters.test_v0_5_23_adapter import _batch, _ours_advance
from tests.adapters.v0_5_23_state import active_state, stand_in_req  # noqa: F401 - active_state is a fixture

pytestmark = [pytest.mark.sglang_0_5_23, pytest.mark.usefixtures("active_state")]

VOCAB = 32000
RUNNING = 70  # past the prune's floor of 64 entries


def test_a_prefill_result_does_not_prune_the_running_requests(active_state):
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang_eo_dev.helpers.grammars import doc_tokens

    doc = list(doc_tokens("nested", random.Random(0), VOCAB))
    ledger = active_state.step.ledger
    running = [stand_in_req(f"a{i}", sglang_grammar("nested", VOCAB, doc[:4]), doc[:4]) for i in range(RUNNING)]
    _ours_advance(verify_result([doc[4:6]] * RUNNING, 4), _batch(running, "DECODE"))
    assert len(ledger) == RUNNING and all(ledger.consumed(f"a{i}") == 6 for i in range(RUNNING))
    for req in running:
        req.output_ids += doc[4:6]

    new = stand_in_req("n", sglang_grammar("nested", VOCAB))
    _ours_advance(GenerationBatchResult(next_token_ids=torch.tensor([doc[0]])), _batch([new], "EXTEND"))
    assert "n" in ledger
    assert all(f"a{i}" in ledger and ledger.consumed(f"a{i}") == 6 for i in range(RUNNING))
    assert active_state.step.telemetry.stats.counters["ledger_forgets"] == 0

    # a run of a0 that would skip two tokens is still caught (the entry knows where its matcher is)
    running[0].output_ids += doc[6:8]
    _ours_advance(verify_result([doc[8:9]] + [doc[6:7]] * (RUNNING - 1), 4), _batch(running, "DECODE"))
    assert active_state.step.telemetry.stats.counters["ledger_resets"] == 1


def test_a_request_no_longer_running_is_pruned(active_state):
    """The prune still bounds the ledger: requests in neither the result's batch nor the latest decode batch (they
    left without a finished result the band saw) are forgotten once the ledger outgrows a few times the live ones."""
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang_eo_dev.helpers.grammars import doc_tokens

    doc = list(doc_tokens("nested", random.Random(1), VOCAB))
    ledger = active_state.step.ledger
    running = [stand_in_req(f"a{i}", sglang_grammar("nested", VOCAB, doc[:4]), doc[:4]) for i in range(RUNNING)]
    _ours_advance(verify_result([doc[4:5]] * RUNNING, 4), _batch(running, "DECODE"))
    for req in running:
        req.output_ids += doc[4:5]
    running, gone = running[:10], running[10:]  # the others left the running batch (e.g. aborted while queued)
    _ours_advance(verify_result([doc[5:6]] * len(running), 4), _batch(running, "DECODE"))
    _ours_advance(GenerationBatchResult(next_token_ids=torch.tensor([doc[0]])),
                  _batch([stand_in_req("n", sglang_grammar("nested", VOCAB))], "EXTEND"))
    assert all(r.rid not in ledger for r in gone) and all(r.rid in ledger for r in running) and "n" in ledger
    assert active_state.step.telemetry.stats.counters["ledger_forgets"] == len(gone)


def test_a_failing_before_verify_leaves_no_verify_context(active_state, monkeypatch):
    from sglang_eagle_overlap.adapters.v0_5_23 import band, run_eagle_verify

    def broken(rt, batch, verify_input):
        raise RuntimeError("forced drafts failed")

    monkeypatch.setattr(band, "before_verify", broken)
    batch = SimpleNamespace(has_grammar=True, spec_info=None, reqs=[])
    with pytest.raises(RuntimeError, match="forced drafts failed"):
        run_eagle_verify.run_eagle_verify(lambda *a, **k: None, batch, grammar_barrier=lambda: None)
    # a later tree of another batch cannot pick up this batch's barrier
    assert band.band_of(active_state).in_flight is None
