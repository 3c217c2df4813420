"""Randomized equivalence (property-based): the overlapped grammar state always equals a synchronous one.

A scheduler is simulated around the plugin's core with *real* xgrammar matchers:

* **overlapped** (the plugin): batch N's accepted tokens stay pending; the verify of batch N+1 first advances them
  through the :class:`AcceptLedger` (the barrier), then builds N+1's tree mask with :class:`TreeMaskBuilder`; the
  post-processing of batch N runs *after* that (as in SGLang's overlap loop) and asks the ledger again (a replay that
  must not feed anything);
* **synchronous reference**: its own matchers, fed each step's tokens in post-processing, masks built with a plain
  reference walk (SGLang's ``traverse_tree`` semantics written out independently below).

Hypothesis draws a schedule's *parameters* (tree shape, number of steps, how often each event happens, including
never) and a seed that drives the individual events. Event kinds, all of which the test asserts were generated:

* ``arrive`` / ``extend``: a request arrives, its prefill (extend) emits one token, later steps decode;
* finishes: ``finish_grammar`` (a constrained document ends: EOS terminates the grammar), ``finish_eos`` (an
  unconstrained request emits EOS), ``finish_length`` (max_new_tokens), ``finish_stop`` (a stop string completes
  inside an accepted run: the rest of the run is not emitted); ``overrun``: the accepted run continues past the
  terminating EOS (nothing after termination may be fed);
* ``abort`` / ``abort_inflight`` (aborted with an unprocessed run), ``retract`` / ``retract_inflight`` (the retracted
  request's in-flight run is discarded) and ``readmit`` (back through an extend at its committed position);
* ``filtered``: a running request left out of one batch; ``empty_batch``: a step without a verify batch (no barrier,
  post-processing feeds directly); ``mixed_batch``: constrained and unconstrained rows in one verify batch;
* ``ledger_forget`` / ``ledger_retain``: the ledger is pruned as the adapters do.

After every step: each row's mask (bit-exact, unconstrained rows all-allowed), every live request's matcher state
(next-token bitmask and termination), and the exact token list each matcher consumed (every accepted token exactly
once, in order, none after termination; the emitted output is a prefix of it).

Profiles (hypothesis ``derandomize=True`` and no example database, so a run is reproducible):

* CI (default): 1,500 lockstep schedules + 200 each for the native and python strategies (~1 min on 2 cores);
* long: ``SGLANG_EO_LONG=1`` runs >= 10,000 lockstep schedules (plus 1,000 each for native / python) and prints the
  counts: ``SGLANG_EO_LONG=1 .venvs/sglang-0.5.23/bin/python -m pytest tests/core/test_overlap_schedule.py -q -s``.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_eagle_overlap.core import RowRun, Run
from sglang_eagle_overlap.core import GrammarStep, MaskRequest

from sglang_eagle_overlap.core.ledger import AcceptLedger

from sglang_eagle_overlap.core.mask import TreeMaskBuilder
from sglang_eagle_overlap.core.ledger import ResultRuns
from sglang_eo_dev.helpers.strategies import StrategyMaskBuilder
from sglang_eo_dev.helpers.grammars import next_token_bitmask
from sglang_eo_dev.helpers.native import native
from sglang_eo_dev.helpers.trees import Tree, eagle_tree, stack_trees
from sglang_eo_dev.helpers.steps import feed_one, make_step

LONG = os.environ.get("SGLANG_EO_LONG") == "1"
SCHEDULES = {"lockstep": 10_000, "native": 1_000, "python": 1_000, "step": 2_000} if LONG else {
    "lockstep": 1_500, "native": 200, "python": 200, "step": 300}

EVENT_KINDS = (
    "arrive", "extend", "decode_row", "finish_grammar", "finish_eos", "finish_length", "finish_stop", "overrun",
    "abort", "abort_inflight", "retract", "retract_inflight", "readmit", "filtered", "empty_batch", "mixed_batch",
    "ledger_forget", "ledger_retain",
)

# ---------------------------------------------------------------------------------------------------------------
# A tiny deterministic vocabulary: printable ASCII characters, a few multi-character JSON pieces, and EOS.
_PIECES = ['{"', '":', '",', '"}', "true", "false", "null", '":"', "],", "[", "]", "ab", "id", "ok", "12", "3.5"]
VOCAB = [chr(c) for c in range(32, 127)] + _PIECES + ["<eos>"]
EOS = len(VOCAB) - 1
V = len(VOCAB)
W = (V + 31) // 32
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))


_INDEX = {s: k for k, s in enumerate(VOCAB[:-1])}


def _document(rng: random.Random) -> List[int]:
    """A schema-valid document, tokenized greedily with the multi-character pieces, then EOS."""
    doc = {
        "id": rng.randint(0, 999),
        "name": "".join(rng.choice("abcxyz") for _ in range(rng.randint(0, 6))),
        "tags": ["".join(rng.choice("ab") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(0, 3))],
        "ok": rng.random() < 0.5,
    }
    text = json.dumps(doc, separators=(",", ":"))
    ids: List[int] = []
    i = 0
    while i < len(text):
        for L in (5, 4, 3, 2, 1):
            piece = text[i : i + L]
            if len(piece) == L and piece in _INDEX and (L == 1 or rng.random() < 0.7):
                ids.append(_INDEX[piece])
                i += L
                break
    return ids + [EOS]


def _free_text(rng: random.Random) -> List[int]:
    """An unconstrained output: arbitrary (mostly grammar-invalid) tokens, then EOS."""
    return [rng.randrange(V - 1) for _ in range(rng.randint(2, 24))] + [EOS]


class CountingMatcher:
    """A real matcher that records every token it consumed (accepted and not rolled back by a tree walk)."""

    def __init__(self, compiled) -> None:
        self.m = xgr.GrammarMatcher(compiled)
        self.consumed: List[int] = []

    def accept_token(self, token: int) -> bool:
        ok = self.m.accept_token(token)
        if ok:
            self.consumed.append(token)
        return ok

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


def _reference_mask(matcher, nxt, sib, tok, out: torch.Tensor) -> None:
    """SGLang ``traverse_tree`` semantics, written plainly: recursive DFS, accept / fill / rollback per node."""

    def allowed(row: int, t: int) -> bool:
        return 0 <= t < V and bool((int(out[row, t // 32]) >> (t % 32)) & 1)

    def dfs(node: int, parent: int) -> None:
        ok = node == 0 or (allowed(parent, tok[node]) and matcher.accept_token(tok[node]))
        if ok:
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(out, node)
                if nxt[node] >= 0:
                    dfs(nxt[node], node)
            if node != 0:
                matcher.rollback(1)
        if sib[node] >= 0:
            dfs(sib[node], parent)

    if not matcher.is_terminated():
        dfs(0, -1)


@dataclass
class Req:
    rid: str
    doc: List[int]  # what the model would emit: the document (+ EOS), for constrained requests schema-valid
    constrained: bool
    max_len: Optional[int] = None  # max_new_tokens
    stop_at: Optional[int] = None  # output index at which a stop string completes
    out: List[int] = field(default_factory=list)  # emitted output tokens (the host's output_ids)
    epoch: int = 0  # bumped on retraction: in-flight results of an older epoch are discarded
    state: str = "waiting"  # waiting (extend next) | running (incl. extend in flight) | retracted | finished | aborted
    plugin: Optional[CountingMatcher] = None
    ref: Optional[CountingMatcher] = None

    @property
    def pos(self) -> int:
        return len(self.out)


@dataclass(frozen=True)
class Params:
    seed: int
    shape: Tuple[int, int, int]  # (topk, steps, num_draft_tokens)
    steps: int
    arrivals: Tuple[int, ...]  # per-step arrival counts to draw from
    p_unconstrained: float
    p_length: float
    p_stop: float
    p_abort: float
    p_retract: float
    p_readmit: float
    p_filter: float
    p_empty: float
    p_overrun: float
    p_forget: float


_P = st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.2, 0.4])
PARAMS = st.builds(
    Params,
    seed=st.integers(0, 2**32 - 1),
    shape=st.sampled_from([(1, 3, 4), (2, 3, 6), (4, 3, 8), (3, 4, 12)]),
    steps=st.integers(1, 30),
    arrivals=st.sampled_from([(0, 0, 1, 2), (0, 1), (1, 2, 3), (0, 0, 0, 1)]),
    p_unconstrained=_P,
    p_length=_P,
    p_stop=_P,
    p_abort=_P,
    p_retract=_P,
    p_readmit=st.sampled_from([0.1, 0.3, 0.7, 1.0]),
    p_filter=_P,
    p_empty=_P,
    p_overrun=st.sampled_from([0.0, 0.5, 1.0]),
    p_forget=st.sampled_from([0.0, 0.5, 1.0]),
)


def _record_fed(grammar: "CountingMatcher", outcome) -> None:
    """``on_feed`` of the step driver: what the native feed gave the raw matcher, recorded as CountingMatcher would."""
    grammar.consumed.extend(outcome.retained)


def run_schedule(compiled, p: Params, builder: Optional[TreeMaskBuilder], ev: Counter,
                 gstep: Optional[GrammarStep] = None) -> None:
    """One schedule. With ``builder``: the ledger and the builder driven directly. With ``gstep``: the plugin's
    ``GrammarStep`` with the native module, as the bands drive it -- the barrier queues the previous result's runs by
    row (``feed_later`` over a ``ResultRuns`` of a ``[rows * n]`` token tensor) inside ``start_build`` (grammar
    thread: before the "launch"; inline: in ``finish_build``), their feed is the build's native call, and
    post-processing asks ``feed`` again; every fresh feed is recorded through ``on_feed``."""
    rng = random.Random(p.seed)
    topk, depth_max, n = p.shape
    ledger = AcceptLedger() if gstep is None else gstep.ledger
    reqs: Dict[str, Req] = {}
    pending: Optional[List[Tuple[Req, int, List[int]]]] = None  # rows of the step not yet post-processed

    def admit(i: int) -> Req:
        constrained = rng.random() >= p.p_unconstrained
        doc = _document(rng) if constrained else _free_text(rng)
        r = Req(rid=f"r{p.seed}-{i}", doc=doc, constrained=constrained)
        if rng.random() < p.p_length:
            r.max_len = rng.randint(1, len(doc))
        if rng.random() < p.p_stop and len(doc) > 2:
            r.stop_at = rng.randint(0, len(doc) - 2)
        if constrained:
            r.plugin, r.ref = CountingMatcher(compiled), CountingMatcher(compiled)
        return r

    def live(r: Req, epoch: int) -> bool:
        return r.epoch == epoch and r.state in ("running", "waiting")

    barriered = set()  # (rid, position) runs the barrier fed: post-processing must replay them, feeding nothing

    def barrier(rows) -> None:
        """Verify of the next batch: feed the previous step's runs to the plugin's matchers via the ledger."""
        if gstep is not None:
            # As a result reaches the band: every row's run in one token tensor, [row * stride, row * stride + len)
            # (the stride is the tree's node count in SGLang; overrun runs here can be longer).
            stride = max([n] + [len(toks) for _, _, toks in rows])
            ids = torch.zeros(max(1, len(rows)) * stride, dtype=torch.int64)
            lens = torch.zeros(max(1, len(rows)), dtype=torch.int32)
            queued = []
            for i, (r, epoch, toks) in enumerate(rows):
                ids[i * stride : i * stride + len(toks)] = torch.tensor(toks, dtype=torch.int64)
                lens[i] = len(toks)
                if r.constrained and live(r, epoch) and toks:
                    queued.append(RowRun(r.rid, r.plugin, r.plugin.m, r.pos, i))
                    barriered.add((r.rid, r.pos))
            gstep.feed_later(queued, ResultRuns(ids, lens, stride), lambda outcomes: None, _record_fed)
            return
        for r, epoch, toks in rows:
            if r.constrained and live(r, epoch) and toks:
                feed_one(ledger, r.rid, r.plugin, r.pos, toks)
                barriered.add((r.rid, r.pos))

    def finish(r: Req, kind: str) -> None:
        r.state = "finished"
        ev[kind] += 1
        if rng.random() < p.p_forget:
            ledger.forget(r.rid)
            ev["ledger_forget"] += 1

    def postprocess(rows) -> None:
        """Post-processing of a step: the plugin asks the ledger (replay if the barrier fed it); the synchronous
        reference feeds its own matcher now; then the host emits tokens and checks finish conditions."""
        for r, epoch, toks in rows:
            if not live(r, epoch) or not toks:
                continue  # aborted / retracted / finished meanwhile: the run is discarded by both
            if r.constrained:
                fed = ledger.tokens_fed
                if gstep is None:
                    outcome = feed_one(ledger, r.rid, r.plugin, r.pos, toks)
                else:
                    (outcome,) = gstep.feed([Run(r.rid, r.plugin, r.plugin.m, r.pos, toks)], _record_fed,
                                            count_replays=True)
                ref_kept: List[int] = []
                for t in toks:
                    if r.ref.is_terminated():
                        break
                    assert r.ref.accept_token(t), (p, r.rid, t)
                    ref_kept.append(t)
                assert list(outcome.retained) == ref_kept, (p, r.rid, outcome, ref_kept)
                assert outcome.error is None, (p, r.rid, outcome)
                kept = list(outcome.retained)
                if (r.rid, r.pos) in barriered:
                    assert ledger.tokens_fed == fed, (p, r.rid, "replay fed the matcher again")
                if len(kept) < len(toks):
                    ev["overrun"] += 1
            else:
                kept = toks[: toks.index(EOS) + 1] if EOS in toks else list(toks)
            start = r.pos
            r.out.extend(kept)
            if r.stop_at is not None and start <= r.stop_at < r.pos:
                del r.out[r.stop_at + 1 :]
                finish(r, "finish_stop")
            elif r.max_len is not None and r.pos >= r.max_len:
                del r.out[r.max_len :]
                finish(r, "finish_length")
            elif r.constrained and outcome.terminated:
                finish(r, "finish_grammar")
            elif not r.constrained and r.out and r.out[-1] == EOS:
                finish(r, "finish_eos")

    next_id = 0
    for step in range(p.steps):
        # --- events between batches (the scheduler's receive / retract / admit phase) -------------------------
        for _ in range(rng.choice(p.arrivals)):
            r = admit(next_id)
            next_id += 1
            reqs[r.rid] = r
            ev["arrive"] += 1
        inflight = {r.rid for r, _, _ in (pending or [])}
        for r in list(reqs.values()):
            if r.state in ("running", "waiting", "retracted") and rng.random() < p.p_abort:
                ev["abort_inflight" if r.rid in inflight and r.state != "retracted" else "abort"] += 1
                r.state = "aborted"
                ledger.forget(r.rid)
            elif r.state == "running" and rng.random() < p.p_retract:
                ev["retract_inflight" if r.rid in inflight else "retract"] += 1
                r.state = "retracted"
                r.epoch += 1
            elif r.state == "retracted" and rng.random() < p.p_readmit:
                r.state = "waiting"  # re-prefilled from its committed output: one extend token at r.pos
                ev["readmit"] += 1
        # --- batch N+1: running requests (some filtered out this step), or an empty step ----------------------
        if rng.random() < p.p_empty:
            batch: List[Req] = []
            ev["empty_batch"] += 1
        else:
            batch = []
            for r in reqs.values():
                if r.state != "running":
                    continue
                if rng.random() < p.p_filter:
                    ev["filtered"] += 1
                    continue
                batch.append(r)
        prefills = [r for r in reqs.values() if r.state == "waiting"]
        # --- verify of batch N+1: barrier, then the tree mask (before N is post-processed) --------------------
        got = trees = None
        if batch:
            if pending is not None and gstep is None:
                barrier(pending)
            if any(r.constrained for r in batch) and not all(r.constrained for r in batch):
                ev["mixed_batch"] += 1
            trees = []
            for r in batch:
                # The draft tree continues from everything emitted through N (the device already has N's tokens).
                ahead = [t for rr, e, toks in (pending or []) if rr is r and live(r, e) for t in toks]
                truth = (r.doc[r.pos :] if not ahead else r.doc[r.pos + len(ahead) :]) or [EOS]
                trees.append(eagle_tree(rng, topk, depth_max, n, truth, V, p_oov=0.25, extra_tokens=(-1, EOS)))
            nxt, sib, tok = stack_trees(trees)
            mreqs = [MaskRequest(matcher=r.plugin.m if r.constrained else None, request_id=r.rid) for r in batch]
            if gstep is None:
                got = builder.build(mreqs, nxt, sib, tok, V)
            else:
                prev = pending
                job = gstep.start_build(mreqs, gstep.copy_host_tree(nxt, sib, tok), vocab_size=V,
                                       barrier=None if prev is None else (lambda: barrier(prev)))
                got = gstep.finish_build(job, device="cpu").tree
                ev["thread_jobs"] += job.future is not None
        # --- post-processing of batch N (after N+1 launched) --------------------------------------------------
        if pending is not None:
            if gstep is not None and not batch:
                barrier(pending)  # no verify to host the barrier: post-processing feeds directly
            postprocess(pending)
            pending = None
            if rng.random() < 0.2:
                keep = {r.rid for r in reqs.values() if r.state in ("running", "waiting", "retracted")}
                ev["ledger_retain"] += ledger.retain(keep) > 0
        # --- compare N+1's masks with the synchronous reference (now at the same state) -----------------------
        if batch:
            assert (got.bitmask is None) == (not any(r.constrained for r in batch)), (p, step)
            for i, r in enumerate(batch):
                want = torch.full((n, W), -1, dtype=torch.int32)
                if r.constrained:
                    _reference_mask(r.ref.m, trees[i].nxt, trees[i].sib, trees[i].tok, want)
                rows = got.bitmask[i * n : (i + 1) * n] if got.bitmask is not None else want
                assert torch.equal(rows, want), f"{p} step {step} {r.rid}: mask rows differ"
                ev["mask_checks"] += 1
        # --- the step's results: accepted runs of N+1's rows, one extend token per prefill ---------------------
        rows_out: List[Tuple[Req, int, List[int]]] = []
        for r in batch:
            if r.state != "running":
                continue  # finished by N's post-processing: SGLang filters it before it produces anything
            run = r.doc[r.pos : r.pos + rng.randint(1, depth_max + 1)]
            if run and run[-1] == EOS and rng.random() < p.p_overrun:
                run = run + [rng.randrange(V) for _ in range(rng.randint(1, depth_max))]
            rows_out.append((r, r.epoch, run))
            ev["decode_row"] += 1
        for r in prefills:
            if r.state == "waiting":
                # Its extend token is in flight; it decodes in the next batch already (overlap), as in SGLang.
                rows_out.append((r, r.epoch, r.doc[r.pos : r.pos + 1]))
                r.state = "running"
                ev["extend"] += 1
        pending = rows_out
        # --- invariants after every step: both sides have processed everything through N -------------------------
        for r in reqs.values():
            if not r.constrained:
                continue
            assert r.plugin.consumed == r.ref.consumed, (p, step, r.rid)
            assert r.plugin.is_terminated() == r.ref.is_terminated(), (p, step, r.rid)
            assert r.out == r.plugin.consumed[: r.pos], (p, step, r.rid)  # emitted = consumed prefix, once each
            assert EOS not in r.plugin.consumed[:-1], (p, step, r.rid)  # nothing after termination
            if r.state in ("running", "waiting", "retracted"):
                assert r.out == r.plugin.consumed, (p, step, r.rid)
                assert torch.equal(next_token_bitmask(r.plugin.m, V), next_token_bitmask(r.ref.m, V)), (p, step, r.rid)
                ev["state_checks"] += 1
    if pending is not None:
        postprocess(pending)
    for r in reqs.values():
        if r.constrained:
            assert r.plugin.consumed == r.ref.consumed, (p, r.rid)
            assert r.plugin.is_terminated() == r.ref.is_terminated(), (p, r.rid)
    ev["schedules"] += 1


def _check_schedules(compiled, label: str, target: int, run) -> Counter:
    """``target`` hypothesis schedules through ``run(params, ev)``; every event kind generated, masks compared."""
    ev: Counter = Counter()

    @settings(max_examples=target, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(params=PARAMS)
    def check(params: Params) -> None:
        run(params, ev)

    check()
    print(f"\n[{label}] {ev['schedules']} random schedules, {ev['mask_checks']} mask comparisons, "
          f"{ev['state_checks']} matcher-state comparisons, 0 divergences; events: "
          + ", ".join(f"{k}={ev[k]}" for k in EVENT_KINDS))
    # hypothesis runs max_examples distinct examples unless the space is exhausted (it is not: 2**32 seeds)
    assert ev["schedules"] >= target, ev["schedules"]
    missing = [k for k in EVENT_KINDS if ev[k] == 0]
    assert not missing, f"event kinds never generated: {missing}"
    assert ev["mask_checks"] > ev["schedules"]  # the schedules really compared masks
    return ev


@pytest.mark.parametrize("thread", [True, False], ids=["grammar-thread", "inline"])
def test_the_plugins_step_equals_synchronous(compiled, thread):
    """The same schedules through ``GrammarStep`` as the bands drive it: the barrier's runs queued by row and fed by
    the build's one native call (on the grammar thread, or inline), post-processing answered from the ledger. Every
    accepted token reaches its matcher exactly once through finishes, aborts, retractions and filtering."""
    step = make_step(mask_threads=2, mask_time_limit_s=None, grammar_thread=thread, native=native)
    step.builder.parallel_min_requests = 2  # spread even these small batches over the module's helper threads
    try:
        ev = _check_schedules(compiled, f"step thread={thread}", SCHEDULES["step"],
                              lambda params, ev: run_schedule(compiled, params, None, ev, gstep=step))
    finally:
        step.close()
    assert (ev["thread_jobs"] > 0) is thread  # the grammar thread took the native calls (or, inline, none)
    assert step.builder.native_walks > 0 and step.telemetry.stats.counters["replays"] > 0


@pytest.mark.parametrize("strategy", ["lockstep", "native", "python"])
def test_overlapped_equals_synchronous(compiled, strategy):
    builder = StrategyMaskBuilder(strategy=strategy, threads=2)
    _check_schedules(compiled, strategy, SCHEDULES[strategy],
                     lambda params, ev: run_schedule(compiled, params, builder, ev))
