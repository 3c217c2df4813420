"""Run with the patched SGLang 0.5.16 copy first on ``sys.path`` (see test_sglang_0_5_16_patch.py).

Prints one ``PROBE-JSON {...}`` line of facts; the test asserts on them. Everything runs the copy's real functions
(``Scheduler.is_disable_overlap_for_batch``, ``SchedulerBatchResultProcessor``) and the band functions its
``run_eagle_verify`` call sites call (through the copy's ``grammar_overlap`` link module), on real ``XGrammarGrammar``
objects; only the scheduler / batch / request containers are plain namespaces.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections import deque
from types import SimpleNamespace

import torch

VOCAB = 32000


def _req(rid, grammar, output_ids):
    return SimpleNamespace(rid=rid, grammar=grammar, output_ids=list(output_ids), finished=lambda: False,
                           is_retracted=False, inflight_middle_chunks=0, to_finish=None)


def _processor(brp, speculative_algorithm):
    """A real ``SchedulerBatchResultProcessor``; the grammar paths read only ``server_args``."""
    cls = brp.SchedulerBatchResultProcessor
    fields = {f.name: None for f in dataclasses.fields(cls)}
    fields["server_args"] = SimpleNamespace(speculative_algorithm=speculative_algorithm)
    return cls(**fields)


def main(expected_root: str) -> dict:
    from sglang_eo_dev.helpers.grammars import ensure_sglang_importable
    from sglang_eo_dev.helpers.plugin_state import feed_results

    ensure_sglang_importable()
    import sglang
    from sglang.srt.managers import scheduler as sched_mod
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import grammar_overlap, spec_utils
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_eo_dev.helpers.grammars import CorruptMatcher, doc_tokens, sglang_grammar
    from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

    import sglang_eagle_overlap.adapters.v0_5_16.band as package_band

    facts: dict = {
        "sglang_file": sglang.__file__,
        "from_copy": sglang.__file__.startswith(expected_root)
        and grammar_overlap.__file__.startswith(expected_root),
        "calls_the_package": grammar_overlap.band is package_band,
    }
    rt = grammar_overlap.runtime()
    band = grammar_overlap.band
    counters = rt.step.telemetry.stats.counters
    rng = random.Random(0)

    # -- 1. the overlap decision ------------------------------------------------------------------------------
    queue = deque([("previous batch", "previous result")])

    def decide(algo, grammar, result_queue=queue):
        batch = SimpleNamespace(spec_algorithm=algo, has_grammar=True, forward_mode=ForwardMode.DECODE,
                                reqs=[_req("d", grammar, [])])
        s = SimpleNamespace(require_mlp_sync=False, result_queue=result_queue)
        return bool(sched_mod.Scheduler.is_disable_overlap_for_batch(s, batch, last_batch=None))

    xg = sglang_grammar("nested", VOCAB)
    facts["sync_eagle3_xgrammar"] = decide(SpeculativeAlgorithm.EAGLE3, xg)
    facts["sync_eagle_xgrammar"] = decide(SpeculativeAlgorithm.EAGLE, xg)
    facts["sync_ngram_xgrammar"] = decide(SpeculativeAlgorithm.NGRAM, xg)
    facts["sync_eagle3_other_backend"] = decide(SpeculativeAlgorithm.EAGLE3, SimpleNamespace(name="llguidance"))
    decide(SpeculativeAlgorithm.EAGLE3, xg)  # the last decision records the loop's queue for the barrier
    facts["queue_recorded"] = band.band_of(rt).result_queue is queue

    # -- 2. barrier + native mask vs upstream's generate_token_bitmask ----------------------------------------
    n, stride = 8, 8
    reqs, refs, runs, trees = [], [], [], []
    for i, name in enumerate(("nested", "regex", "ebnf")):
        doc = list(doc_tokens(name, random.Random(i), VOCAB))
        k = rng.randrange(1, len(doc) - 4)
        a = rng.randrange(1, 4)
        run = doc[k:k + a]  # what the previous (still queued) verify accepted for this request
        reqs.append(_req(f"r{i}", sglang_grammar(name, VOCAB, doc[:k]), doc[:k]))
        ref = sglang_grammar(name, VOCAB, doc[:k + a])
        refs.append(_req(f"r{i}", ref, doc[:k + a]))
        runs.append(run)
        trees.append(eagle_tree(rng, 4, 3, n, doc[k + a:], VOCAB, matcher=ref.matcher))
    nxt, sib, tok = stack_trees(trees)
    ids = torch.zeros(len(reqs) * stride, dtype=torch.int64)
    for i, run in enumerate(runs):
        ids[i * stride:i * stride + len(run)] = torch.tensor(run)
    prev_batch = SimpleNamespace(reqs=reqs, forward_mode=ForwardMode.DECODE)
    prev_result = SimpleNamespace(next_token_ids=ids, accept_lens=torch.tensor([len(r) for r in runs]),
                                  speculative_num_draft_tokens=stride, copy_done=None)
    queue.clear()
    queue.append((prev_batch, prev_result))
    want = spec_utils.generate_token_bitmask(refs, SimpleNamespace(grammar=None), nxt, sib, tok, VOCAB)

    batch = SimpleNamespace(reqs=reqs, spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                            forward_mode=ForwardMode.TARGET_VERIFY,
                            sampling_info=SimpleNamespace(vocab_size=VOCAB, vocab_mask="extend-stage leftover"))
    verify_input = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib, draft_token=tok.flatten(),
                                   grammar=None)
    fed_before = rt.step.ledger.tokens_fed
    verify = band.begin_verify(rt, batch, verify_input)
    facts["begin_verify_started"] = verify is not None
    got = band.build_vocab_mask(rt, verify, verify_input, batch)
    facts["mask_equal"] = got is not None and bool(torch.equal(got, want))
    facts["barrier_fed_runs"] = all(
        r.grammar.accepted_tokens == ref.grammar.accepted_tokens for r, ref in zip(reqs, refs)
    )
    facts["barrier_tokens"] = rt.step.ledger.tokens_fed - fed_before
    facts["run_tokens"] = sum(len(r) for r in runs)
    facts["vocab_mask_cleared"] = batch.sampling_info.vocab_mask is None
    facts["verify_grammar_set"] = verify_input.grammar is reqs[0].grammar
    facts["ngram_declined"] = band.begin_verify(
        rt, SimpleNamespace(reqs=reqs, spec_algorithm=SpeculativeAlgorithm.NGRAM, has_grammar=True,
                            forward_mode=ForwardMode.TARGET_VERIFY),
        verify_input,
    ) is None

    # A matcher that raises during the build (a real XGrammarGrammar whose matcher is corrupt: it breaks xgrammar's
    # batched walk, then fails the per-request walk): that request alone is aborted and its drafts made unmatchable.
    fresh = [_req(r.rid, sglang_grammar(("nested", "regex", "ebnf")[i], VOCAB, list(r.grammar.accepted_tokens)),
                  r.output_ids) for i, r in enumerate(refs)]
    fresh[1].grammar.matcher = CorruptMatcher()
    fb = SimpleNamespace(reqs=fresh, spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                         forward_mode=ForwardMode.TARGET_VERIFY,
                         sampling_info=SimpleNamespace(vocab_size=VOCAB, vocab_mask=None))
    fv = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib, draft_token=tok.flatten().clone(),
                         grammar=None)
    queue.clear()
    band.build_vocab_mask(rt, band.begin_verify(rt, fb, fv), fv, fb)
    drafts = fv.draft_token.view(len(fresh), n)
    facts["mask_failure_aborts_alone"] = (
        fresh[1].to_finish is not None and "mask build failed" in getattr(fresh[1].to_finish, "message", "")
        and fresh[0].to_finish is None and fresh[2].to_finish is None
    )
    facts["mask_failure_drafts_neutralised"] = (
        bool((drafts[1, 1:] == -1).all()) and torch.equal(drafts[0], tok[0]) and torch.equal(drafts[2], tok[2])
    )
    facts["mask_failures"] = counters["mask_failures"]

    # -- 3. post-processing replays (advance exactly once), upstream's retained prefix --------------------------
    eagle_proc = _processor(brp, "EAGLE3")
    upstream_proc = _processor(brp, None)  # the ledger is off: upstream's own loop
    before = [list(r.grammar.accepted_tokens) for r in reqs]
    retained = [eagle_proc._accept_grammar_tokens(r, run) for r, run in zip(reqs, runs)]
    facts["replay_retained_runs"] = retained == runs
    facts["fed_once"] = [list(r.grammar.accepted_tokens) for r in reqs] == before
    facts["replays"] = counters["replays"]

    # Termination and rejection: the ledger path keeps exactly what upstream's loop keeps.
    doc = list(doc_tokens("nested", random.Random(7), VOCAB))
    k = len(doc) - 3
    cases = {
        "terminating": doc[k:] + [doc[0], doc[1]],  # EOS terminates; the over-drafted suffix must be dropped
        "rejected": doc[k:k + 1] + [doc[0]],  # '{' cannot follow: abort after the valid prefix
    }
    for name, run in cases.items():
        mine = _req(f"t-{name}", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k])
        theirs = _req(f"u-{name}", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k])
        got_r = eagle_proc._accept_grammar_tokens(mine, run)
        want_r = upstream_proc._accept_grammar_tokens(theirs, run)
        facts[f"{name}_retained_equal"] = got_r == want_r
        facts[f"{name}_matcher_equal"] = (mine.grammar.accepted_tokens == theirs.grammar.accepted_tokens
                                          and mine.grammar.is_terminated() == theirs.grammar.is_terminated())
        facts[f"{name}_abort_equal"] = (mine.to_finish is None) == (theirs.to_finish is None)
        facts[f"{name}_retained"] = got_r
    facts["rejected_aborts"] = counters["aborts"] == 1  # the rejected run (a mask failure counts as mask_failures)

    # -- 4. prefill: barrier feeds the extend token, _apply_prefill_grammar replays it ----------------------------
    doc = list(doc_tokens("regex", random.Random(3), VOCAB))
    req = _req("p", sglang_grammar("regex", VOCAB), [])
    req.finished = lambda: False
    ext_batch = SimpleNamespace(reqs=[req], forward_mode=ForwardMode.EXTEND)
    ext_result = SimpleNamespace(next_token_ids=torch.tensor([doc[0]]), accept_lens=None,
                                 speculative_num_draft_tokens=None, copy_done=None)
    queue.clear()
    queue.append((ext_batch, ext_result))
    fed = feed_results(band.band_of(rt), queue, [req])
    req.output_ids.append(doc[0])  # post-processing appends, then applies the grammar
    eagle_proc._apply_prefill_grammar(req=req, next_token_id=doc[0])
    facts["prefill_fed_once"] = fed == 1 and req.grammar.accepted_tokens == [doc[0]] and req.to_finish is None
    queue.clear()
    return facts


if __name__ == "__main__":
    print("PROBE-JSON " + json.dumps(main(sys.argv[1])))
