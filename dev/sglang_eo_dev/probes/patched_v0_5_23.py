"""Run with the patched SGLang copy first on ``sys.path`` (see test_sglang_0_5_23_patch.py)."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import torch


def main(expected_root: str) -> dict:
    from sglang_eo_dev.helpers.grammars import CorruptMatcher, ensure_sglang_importable, sglang_grammar

    ensure_sglang_importable()
    import sglang
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative import grammar_overlap, spec_utils

    import sglang_eagle_overlap.adapters.v0_5_23.band as package_band
    from sglang_eo_dev.helpers.grammars import doc_tokens
    from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

    facts = {"sglang_file": sglang.__file__, "from_copy": sglang.__file__.startswith(expected_root),
             "calls_the_package": grammar_overlap.band is package_band
             and spec_utils.GrammarTree is package_band.PluginGrammarTree}
    rt = grammar_overlap.runtime()
    vocab = 32000
    rng = random.Random(0)
    reqs, trees = [], []
    for i in range(3):
        doc = list(doc_tokens("nested", random.Random(i), vocab))
        k = rng.randrange(1, len(doc) - 1)
        g = sglang_grammar("nested", vocab, doc[:k])
        reqs.append(SimpleNamespace(rid=f"r{i}", grammar=g, output_ids=doc[:k], finished=lambda: False,
                                    is_retracted=False, inflight_middle_chunks=0, to_finish=None))
        trees.append(eagle_tree(rng, 4, 3, 8, doc[k:], vocab, matcher=g.matcher))
    nxt, sib, tok = stack_trees(trees)
    want, _ = spec_utils.generate_token_bitmask(reqs, nxt, sib, tok, vocab)
    barrier = []
    info = SimpleNamespace(vocab_size=vocab, grammar_mask="leftover")
    tree = spec_utils.GrammarTree.from_device(nxt, sib, tok)
    got = spec_utils.build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info, device=torch.device("cpu"),
                                              barrier=lambda: barrier.append(1))
    facts["mask_equal"] = bool(torch.equal(got.vocab_mask, want))
    facts["barrier_called"] = barrier == [1]
    facts["grammar_mask_reset"] = info.grammar_mask is None
    facts["has_draft_device"] = tree.draft_device is tok

    # advance_grammar_fsm through the ledger: exactly once even if asked twice.
    req = reqs[0]
    run = trees[0].tok[1:4]
    before = list(req.grammar.accepted_tokens)
    ns = SimpleNamespace()
    res = GenerationBatchResult(next_token_ids=torch.tensor(run + [0] * 5), accept_lens=torch.tensor([3]),
                                speculative_num_draft_tokens=8)
    batch = SimpleNamespace(reqs=[req], has_grammar=True, forward_mode=ForwardMode.DECODE)
    brp.SchedulerBatchResultProcessor.advance_grammar_fsm(ns, res, batch)
    res.grammar_advanced = False
    brp.SchedulerBatchResultProcessor.advance_grammar_fsm(ns, res, batch)
    facts["retained"] = res.grammar_retained_tokens
    facts["run"] = run
    facts["fed_once"] = req.grammar.accepted_tokens == before + res.grammar_retained_tokens[0]
    facts["ledger_used"] = rt.step.ledger.tokens_fed == len(res.grammar_retained_tokens[0])

    # A grammar that raises during the build (its matcher is corrupt: it breaks the batched walk, then the
    # per-request walk): that request alone is aborted with a clear error and its drafts are made unmatchable.
    reqs[1].grammar.matcher = CorruptMatcher()
    n = nxt.shape[-1]
    draft = tok.clone()
    tree = spec_utils.GrammarTree.from_device(nxt, sib, draft)
    spec_utils.build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info, device=torch.device("cpu"),
                                        barrier=None)
    drafts = tree.draft_device.view(len(reqs), n)
    facts["mask_failure_aborts_alone"] = (
        reqs[1].to_finish is not None and "mask build failed" in getattr(reqs[1].to_finish, "message", "")
        and reqs[0].to_finish is None and reqs[2].to_finish is None
    )
    facts["mask_failure_drafts_neutralised"] = (
        bool((drafts[1, 1:] == -1).all()) and torch.equal(drafts[0], tok.view(len(reqs), n)[0])
        and torch.equal(drafts[2], tok.view(len(reqs), n)[2])
    )
    return facts


if __name__ == "__main__":
    print("PROBE-JSON " + json.dumps(main(sys.argv[1])))
