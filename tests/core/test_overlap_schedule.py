"""Randomized equivalence: the overlapped grammar state always equals a synchronous one.

A scheduler is simulated around the plugin's core with *real* xgrammar matchers:

* **overlapped** (the plugin): batch N's accepted tokens stay pending; the verify of batch N+1 first advances them
  through the :class:`AcceptLedger` (the barrier), then builds N+1's tree mask with :class:`TreeMaskBuilder`; the
  post-processing of batch N runs *after* that and asks the ledger again (replay, must not re-feed);
* **synchronous reference**: its own matchers, fed each step's tokens immediately in post-processing, masks built
  with a plain reference walk (SGLang's ``traverse_tree`` semantics written out independently below).

Between steps, requests arrive (extend: one prefill token), finish (their document ends -> grammar terminates, or
a length limit), abort, get retracted and re-admitted later, are filtered out of a batch, and batches can be empty.
After every step we compare: each request's mask rows, the tokens each matcher consumed (every accepted token exactly
once, none after termination), and matcher termination.

Profiles: the CI profile runs a few hundred schedules; ``SGLANG_EO_LONG=1`` runs >= 10,000 and prints the count
(``SGLANG_EO_LONG=1 .venvs/sglang-0.5.23/bin/python -m pytest tests/core/test_overlap_schedule.py -q -s``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from sglang_eagle_overlap.core import AcceptLedger, MaskRequest, TreeMaskBuilder  # noqa: E402
from tests.helpers.trees import Tree, eagle_tree, stack_trees  # noqa: E402

LONG = os.environ.get("SGLANG_EO_LONG") == "1"
SCHEDULES = 10_000 if LONG else 300

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


def _document(rng: random.Random) -> List[int]:
    doc = {
        "id": rng.randint(0, 999),
        "name": "".join(rng.choice("abcxyz") for _ in range(rng.randint(0, 6))),
        "tags": ["".join(rng.choice("ab") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(0, 3))],
        "ok": rng.random() < 0.5,
    }
    text = json.dumps(doc, separators=(",", ":"))
    # Greedy longest-match tokenization with the multi-character pieces, so runs are not all single characters.
    ids: List[int] = []
    i = 0
    index = {s: k for k, s in enumerate(VOCAB[:-1])}
    while i < len(text):
        for L in (5, 4, 3, 2, 1):
            piece = text[i : i + L]
            if len(piece) == L and piece in index and (L == 1 or rng.random() < 0.7):
                ids.append(index[piece])
                i += L
                break
    return ids + [EOS]


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
    doc: List[int]
    pos: int = 0  # output tokens committed (host view, updated in post-processing)
    finished: bool = False
    retracted: bool = False
    plugin: Optional[CountingMatcher] = None
    ref: Optional[CountingMatcher] = None
    max_len: int = 10_000


def _tree(rng: random.Random, req: Req, topk: int, steps: int, n: int) -> Tree:
    """EAGLE-like tree rooted at the last committed token; the first child continues the document. Side nodes are
    random tokens, out-of-vocabulary ids or -1 (almost always grammar-invalid)."""
    return eagle_tree(rng, topk, steps, n, req.doc[req.pos :], V, p_oov=0.25, extra_tokens=(-1,))


def _run_schedule(compiled, seed: int, builder: TreeMaskBuilder) -> int:
    rng = random.Random(seed)
    topk, steps, n = rng.choice([(1, 3, 4), (2, 3, 6), (4, 3, 8), (3, 4, 12)])
    ledger = AcceptLedger()
    reqs: Dict[str, Req] = {}
    waiting: List[Req] = []
    pending = None  # (batch rows, per-row accepted tokens) of the previous step, not yet post-processed
    next_id = 0
    checks = 0

    def admit() -> Req:
        nonlocal next_id
        r = Req(rid=f"r{seed}-{next_id}", doc=_document(rng), max_len=rng.choice([10_000, rng.randint(3, 25)]))
        next_id += 1
        r.plugin, r.ref = CountingMatcher(compiled), CountingMatcher(compiled)
        return r

    def postprocess(rows: List[Req], accepted: List[List[int]]) -> None:
        for r, toks in zip(rows, accepted):
            if r.finished or r.retracted or r.rid not in reqs or not toks:
                continue
            out = ledger.advance(r.rid, r.plugin, r.pos, toks)  # replay if the barrier already fed it
            ref_kept = []
            for t in toks:
                if r.ref.is_terminated():
                    break
                assert r.ref.accept_token(t)
                ref_kept.append(t)
                if r.ref.is_terminated():
                    break
            assert list(out.retained) == ref_kept, (r.rid, out, ref_kept)
            r.pos += len(out.retained)
            if out.terminated or r.pos >= r.max_len:
                r.finished = True

    for step in range(rng.randint(4, 30)):
        # --- events between batches -------------------------------------------------------------------------
        for _ in range(rng.choice([0, 0, 1, 2])):
            r = admit()
            # extend: the prefill emits the first document token; accepted in the next barrier / post-processing
            reqs[r.rid] = r
            waiting.append(r)
        live = [r for r in reqs.values() if not r.finished and not r.retracted]
        for r in list(live):
            x = rng.random()
            if x < 0.05:
                del reqs[r.rid]  # abort: gone for good
                ledger.forget(r.rid)
            elif x < 0.10:
                r.retracted = True  # retract; re-admitted later with its state intact
        for r in reqs.values():
            if r.retracted and rng.random() < 0.3:
                r.retracted = False
        # --- batch N+1 composition: decode rows (some filtered out) + new prefills ---------------------------
        batch = [r for r in reqs.values() if not r.finished and not r.retracted and r not in waiting]
        batch = [r for r in batch if rng.random() > 0.1]  # filtered out this step
        # --- verify of batch N+1: barrier first (advance batch N's pending tokens), then masks ----------------
        if pending is not None:
            rows, accepted = pending
            for r, toks in zip(rows, accepted):
                if r.finished or r.retracted or r.rid not in reqs or not toks:
                    continue
                ledger.advance(r.rid, r.plugin, r.pos, toks)
        constrained_rows = [r for r in batch if rng.random() > 0.15]  # others run without grammar this step
        if batch:
            # the plugin's matchers must be exactly where post-processing of N will leave the reference:
            # bring the reference forward now (sync semantics), then compare masks
            if pending is not None:
                postprocess(*pending)
                pending = None
            batch = [r for r in batch if not r.finished]
            trees = [_tree(rng, r, topk, steps, n) for r in batch]
            nxt, sib, tok = stack_trees(trees)
            mreqs = [
                MaskRequest(matcher=r.plugin.m if (r in constrained_rows and not r.finished) else None, request_id=r.rid)
                for r in batch
            ]
            got = builder.build(mreqs, nxt, sib, tok, V)
            for i, r in enumerate(batch):
                want = torch.full((n, W), -1, dtype=torch.int32)
                if r in constrained_rows and not r.finished:
                    _reference_mask(r.ref.m, trees[i].nxt, trees[i].sib, trees[i].tok, want)
                rows_got = got.bitmask[i * n : (i + 1) * n] if got.bitmask is not None else want.fill_(-1)
                assert torch.equal(rows_got, want), f"seed {seed} step {step} {r.rid}: mask rows differ"
                checks += 1
        elif pending is not None:
            postprocess(*pending)
            pending = None
        # --- the step's result: accepted run per row (verify: longest doc-consistent chain, random length) -----
        accepted = []
        for r in batch:
            depth = rng.randint(1, steps + 1)
            accepted.append(r.doc[r.pos : r.pos + depth])
        assert all(r.rid in reqs for r in batch)
        # prefills of newly admitted requests produce one token each
        for r in waiting:
            batch.append(r)
            accepted.append(r.doc[:1])
        waiting = []
        pending = (batch, accepted)
        # --- invariants after every step ---------------------------------------------------------------------
        for r in reqs.values():
            # the barrier and post-processing of the previous step both ran: plugin and reference agree now
            assert r.plugin.is_terminated() == r.ref.is_terminated(), (seed, step, r.rid)
    if pending is not None:
        postprocess(*pending)
    for r in reqs.values():
        # every committed token consumed exactly once by both matchers, nothing after termination
        assert r.plugin.consumed == r.ref.consumed, r.rid
        assert r.plugin.is_terminated() == r.ref.is_terminated()
    return checks


@pytest.mark.parametrize("strategy", ["lockstep", "native", "python"])
def test_overlapped_equals_synchronous(compiled, strategy):
    builder = TreeMaskBuilder(strategy=strategy, threads=2)
    schedules = SCHEDULES if strategy == "lockstep" else max(SCHEDULES // 10, 30)
    checks = 0
    for seed in range(schedules):
        checks += _run_schedule(compiled, seed, builder)
    print(f"\n[{strategy}] {schedules} random schedules, {checks} mask comparisons, 0 divergences")
    assert checks > schedules  # the schedules really compared masks
