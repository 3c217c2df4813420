"""AcceptLedger: exactly-once, identity-keyed grammar advance, against a synchronous reference.

The reference feeds each request's accepted tokens to its own matcher once, in order, the moment they are accepted.
The system under test sees the same runs through the ledger the way the overlap scheduler does: runs are advanced
late (at the next verify), again at post-processing (replays), in shuffled batch order, while requests finish,
abort, get retracted and come back, or are filtered out of a batch.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_eagle_overlap.core.ledger import AcceptLedger, LedgerConflictError, LedgerGapError
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.tokenizers import EOS_ID
from sglang_eo_dev.helpers.steps import feed_one

VOCAB = 32000


def _fill(m) -> torch.Tensor:
    return G.next_token_bitmask(m, VOCAB)


class Sim:
    def __init__(self, seed: int, use_sglang: bool):
        self.rng = random.Random(seed)
        self.use_sglang = use_sglang
        self.ledger = AcceptLedger(history=4)
        self.reqs = {}
        self.next_id = 0
        self.pending = []  # runs accepted by the previous step, not yet post-processed: (rid, start, tokens)
        self.fed_to_aborted = 0  # tokens the ledger fed to requests that were aborted later

    def new_request(self):
        g = G.GRAMMARS[self.next_id % len(G.GRAMMARS)]
        doc = G.doc_tokens(g, self.rng, VOCAB)
        rid = f"req-{self.next_id}"
        self.next_id += 1
        grammar = G.sglang_grammar(g, VOCAB) if self.use_sglang else G.matcher(g, VOCAB)
        self.reqs[rid] = dict(doc=doc, pos=0, acc=0, grammar=grammar, ref=G.matcher(g, VOCAB), state="running", g=g)

    def _matcher(self, r):
        return r["grammar"].matcher if self.use_sglang else r["grammar"]

    def advance(self, rid, start, toks):
        r = self.reqs[rid]
        out = feed_one(self.ledger, rid, r["grammar"], start, toks)
        assert out.start == start and out.tokens == tuple(toks)
        return out

    def flush(self, order):
        """Post-process the previous step's runs: some were already advanced at verify time; this is a replay."""
        for rid, start, toks in order:
            if rid not in self.reqs:
                continue
            out = self.advance(rid, start, toks)
            fed = self.ledger.tokens_fed
            again = self.advance(rid, start, toks)
            assert again == out and self.ledger.tokens_fed == fed, "a replay fed the matcher again"
            self._settle(rid, start, toks, out)

    def _settle(self, rid, start, toks, out):
        r = self.reqs[rid]
        if r.get("settled", -1) >= start:
            return
        r["settled"] = start
        # Reference: synchronous, exactly once, stops at termination.
        ref = r["ref"]
        kept = []
        for t in toks:
            assert ref.accept_token(t), f"reference rejected {t}"
            kept.append(t)
            if ref.is_terminated():
                break
        assert out.retained == tuple(kept), (rid, start, out, kept)
        assert out.terminated == ref.is_terminated() and out.error is None
        r["pos"] = start + len(kept)
        if out.terminated:
            r["state"] = "finished"

    def step(self, data):
        running = [rid for rid, r in self.reqs.items() if r["state"] == "running"]
        batch = data.draw(st.permutations(running)) if running else []
        # Filter: some requests sit this step out (e.g. chunked prefill, a filtered batch).
        batch = [rid for rid in batch if data.draw(st.integers(0, 9)) > 0]
        runs = []
        for rid in batch:
            r = self.reqs[rid]
            start = r["acc"]  # the accepted length is known before the previous run was post-processed
            k = data.draw(st.integers(1, 4))
            toks = list(r["doc"][start : start + k])
            if toks:
                runs.append((rid, start, toks))
                r["acc"] = start + len(toks)
        # Overlap: the previous step's runs may be advanced by this verify before they are post-processed.
        early = [x for x in self.pending if data.draw(st.booleans())]
        for rid, start, toks in early:
            if rid in self.reqs:
                self.advance(rid, start, toks)
        self.flush(data.draw(st.permutations(self.pending)) if self.pending else [])
        # The runs of this step are "accepted" now; advanced later (next step, or by the verify-time barrier).
        self.pending = runs
        # The verify-time barrier: advance the runs this step's requests need before their tree mask is built.
        for rid, start, toks in runs:
            if data.draw(st.booleans()):
                self.advance(rid, start, toks)

    def lifecycle(self, data):
        op = data.draw(st.sampled_from(["new", "abort", "retract", "resume", "finish", "none"]))
        live = [rid for rid, r in self.reqs.items() if r["state"] in ("running", "retracted")]
        if op == "new" or not live:
            self.new_request()
            return
        rid = data.draw(st.sampled_from(sorted(live)))
        r = self.reqs[rid]
        if op == "abort":
            # The request leaves; its runs still in flight are dropped by the scheduler, the ledger forgets it.
            self.fed_to_aborted += self.ledger.consumed(rid) or 0
            self.ledger.forget(rid)
            del self.reqs[rid]
            self.pending = [p for p in self.pending if p[0] != rid]
        elif op == "retract" and r["state"] == "running" and not any(p[0] == rid for p in self.pending):
            r["state"] = "retracted"
        elif op == "resume" and r["state"] == "retracted":
            r["state"] = "running"

    def check(self):
        for rid, r in self.reqs.items():
            consumed = self.ledger.consumed(rid)
            if consumed is None:
                assert r["pos"] == 0
                continue
            # Consumed may run ahead of post-processing by at most the in-flight run.
            inflight = [p for p in self.pending if p[0] == rid]
            if not inflight:
                assert consumed == r["pos"], (rid, consumed, r["pos"])
                assert torch.equal(_fill(self._matcher(r)), _fill(r["ref"])), f"{rid}: matcher diverged"

    def drain(self):
        self.flush(list(self.pending))
        self.pending = []
        self.check()
        for rid, r in self.reqs.items():
            assert self._matcher(r).is_terminated() == r["ref"].is_terminated()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), seed=st.integers(0, 2**16), use_sglang=st.booleans())
def test_exactly_once_under_random_schedules(data, seed, use_sglang):
    sim = Sim(seed, use_sglang)
    for _ in range(3):
        sim.new_request()
    for _ in range(data.draw(st.integers(5, 40))):
        if data.draw(st.integers(0, 3)) == 0:
            sim.lifecycle(data)
        sim.step(data)
        sim.check()
    sim.drain()
    # Exactly once: every token the reference consumed was fed by the ledger once, never more (requests aborted on
    # the way were fed what the ledger had consumed for them when they left).
    fed_ref = sum(r["pos"] for r in sim.reqs.values())
    assert sim.ledger.tokens_fed == fed_ref + sim.fed_to_aborted, (sim.ledger.tokens_fed, fed_ref, sim.fed_to_aborted)


def _doc(grammar="nested", seed=0):
    return list(G.doc_tokens(grammar, random.Random(seed), VOCAB))


def test_replay_returns_recorded_outcome_without_feeding():
    doc = _doc()
    ledger = AcceptLedger()
    m = G.matcher("nested", VOCAB)
    first = feed_one(ledger, "a", m, 0, doc[:3])
    fed = ledger.tokens_fed
    snapshot = _fill(m)
    again = feed_one(ledger, "a", m, 0, doc[:3])
    assert again is first and ledger.tokens_fed == fed == 3
    assert torch.equal(_fill(m), snapshot)
    assert ledger.outcome("a", 0) is first and ledger.consumed("a") == 3


def test_identity_keys_not_rows():
    """Two requests with the same start positions and different tokens never mix."""
    d1, d2 = _doc("nested", 1), _doc("pattern", 2)
    ledger = AcceptLedger()
    m1, m2 = G.matcher("nested", VOCAB), G.matcher("pattern", VOCAB)
    feed_one(ledger, "x", m1, 0, d1[:2])
    feed_one(ledger, "y", m2, 0, d2[:2])
    assert feed_one(ledger, "y", m2, 0, d2[:2]).tokens == tuple(d2[:2])
    assert torch.equal(_fill(m1), _fill(G.matcher("nested", VOCAB, d1[:2])))
    assert torch.equal(_fill(m2), _fill(G.matcher("pattern", VOCAB, d2[:2])))


def test_conflict_and_gap_errors():
    doc = _doc()
    ledger = AcceptLedger(history=1)
    m = G.matcher("nested", VOCAB)
    feed_one(ledger, "a", m, 0, doc[:2])
    with pytest.raises(LedgerConflictError, match="position 0"):
        feed_one(ledger, "a", m, 0, doc[:3])
    with pytest.raises(LedgerGapError, match=r"consumed only 2 tokens; tokens 2\.\.4 were never fed$"):
        feed_one(ledger, "a", m, 5, doc[5:7])
    feed_one(ledger, "a", m, 2, doc[2:4])
    with pytest.raises(LedgerConflictError,
                       match=r"is behind the matcher \(consumed 4\) and no outcome is remembered for it$"):
        feed_one(ledger, "a", m, 0, doc[:2])  # history=1 forgot it
    assert torch.equal(_fill(m), _fill(G.matcher("nested", VOCAB, doc[:4])))
    with pytest.raises(ValueError, match="^history must be >= 1, got 0$"):
        AcceptLedger(history=0)


def test_first_sight_anchors_at_start_and_reset():
    doc = _doc()
    ledger = AcceptLedger()
    m = G.matcher("nested", VOCAB, doc[:5])  # the host fed the first 5 tokens before the plugin saw it
    out = feed_one(ledger, "a", m, 5, doc[5:8])
    assert out.retained == tuple(doc[5:8]) and ledger.consumed("a") == 8
    ledger.reset("a", 3)
    assert ledger.consumed("a") == 3 and ledger.outcome("a", 5) is None
    ledger.forget("a")
    ledger.forget("never-seen")
    assert "a" not in ledger and len(ledger) == 0


@pytest.mark.parametrize("use_sglang", [False, True])
def test_termination_mid_run_keeps_prefix(use_sglang):
    doc = _doc("regex", 3)  # ends with EOS
    assert doc[-1] == EOS_ID
    g = G.sglang_grammar("regex", VOCAB, doc[:-3]) if use_sglang else G.matcher("regex", VOCAB, doc[:-3])
    ledger = AcceptLedger()
    start = len(doc) - 3
    run = doc[-3:] + [17, 18]  # tokens past EOS must not be fed or emitted
    out = feed_one(ledger, "r", g, start, run)
    assert out.terminated and out.error is None
    assert out.retained == tuple(doc[-3:])
    assert ledger.consumed("r") == len(doc) and ledger.tokens_fed == 3
    assert feed_one(ledger, "r", g, start, run) is out
    # A terminated grammar retains nothing more.
    after = feed_one(ledger, "r", g, len(doc), [5])
    assert after.retained == () and after.terminated and ledger.tokens_fed == 3


@pytest.mark.parametrize("use_sglang", [False, True])
def test_rejected_token_reported(use_sglang):
    doc = _doc("nested", 4)
    g = G.sglang_grammar("nested", VOCAB) if use_sglang else G.matcher("nested", VOCAB)
    m = g.matcher if use_sglang else g
    ledger = AcceptLedger()
    bad = next(t for t in range(1, VOCAB) if not G.matcher("nested", VOCAB, doc[:2]).accept_token(t))
    out = feed_one(ledger, "r", g, 0, doc[:2] + [bad] + doc[3:5])
    assert out.retained == tuple(doc[:2]) and not out.terminated
    assert out.error is not None and str(bad) in out.error and "position 2" in out.error
    assert ledger.consumed("r") == 2
    # The matcher is consistent: exactly the retained tokens, and the right token is accepted next.
    assert torch.equal(_fill(m), _fill(G.matcher("nested", VOCAB, doc[:2])))
    assert feed_one(ledger, "r", g, 2, doc[2:4]).retained == tuple(doc[2:4])
