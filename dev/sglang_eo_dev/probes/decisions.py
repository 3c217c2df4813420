"""The integration's decided behaviours, observed through ONE path into SGLang: its hooks or a patched copy.

``python -m sglang_eo_dev.probes.decisions hook`` loads the plugin into the installed SGLang;
``python -m sglang_eo_dev.probes.decisions patched <copy root>`` runs with a patched copy first on ``sys.path`` (the
plugin off). Both print one ``PROBE-JSON`` line; ``tests/patches/test_decisions.py`` asserts that each path shows the
decided behaviour and that the two paths agree. The behaviours are the ones three copies of the integration used to
disagree on:

* a grammar that had already terminated keeps the first token of a run (SGLang's own rule), nothing is fed;
* a rejected token aborts that request alone, with the request id in the message, and keeps the valid prefix;
* the same counter names in the stats snapshot;
* on a CPU device the mask handed to sampling aliases the builder's buffer (no clone);
* a batch whose constrained requests all finished gets no mask, and the extend stage's leftover mask is cleared;
* 0.5.23: one builder -- chain trees (no neutralisable drafts) are built without the time limit, EAGLE trees with it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from types import SimpleNamespace
from typing import Any, Callable, Dict, List

import torch

VOCAB = 32000


def _req(rid: str, grammar: Any, output_ids: List[int], finished: bool = False) -> Any:
    return SimpleNamespace(rid=rid, grammar=grammar, output_ids=list(output_ids), finished=lambda: finished,
                           is_retracted=False, inflight_middle_chunks=0, to_finish=None)


def _runtime(mode: str) -> Any:
    if mode == "hook":
        from sglang_eagle_overlap import plugin
        from sglang_eagle_overlap.integration import runtime

        plugin.load()
        return runtime.active()
    from sglang.srt.speculative import grammar_overlap

    return grammar_overlap.runtime()


def _accept_016(req: Any, run: List[int]) -> List[int]:
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    cls = brp.SchedulerBatchResultProcessor
    fields = {f.name: None for f in dataclasses.fields(cls)}
    fields["server_args"] = SimpleNamespace(speculative_algorithm="EAGLE3")
    return cls(**fields)._accept_grammar_tokens(req, run)


def _accept_023(req: Any, run: List[int]) -> List[int]:
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    stride = 8
    res = GenerationBatchResult(next_token_ids=torch.tensor(run + [0] * (stride - len(run))),
                                accept_lens=torch.tensor([len(run)]), speculative_num_draft_tokens=stride)
    batch = SimpleNamespace(reqs=[req], has_grammar=True, forward_mode=ForwardMode.DECODE)
    brp.SchedulerBatchResultProcessor.advance_grammar_fsm(SimpleNamespace(), res, batch)
    return list(res.grammar_retained_tokens[0])


def _tree(seed: int):
    from sglang_eo_dev.helpers.grammars import doc_tokens, sglang_grammar
    from sglang_eo_dev.helpers.trees import eagle_tree

    doc = list(doc_tokens("nested", random.Random(seed), VOCAB))
    k = len(doc) // 2
    g = sglang_grammar("nested", VOCAB, doc[:k])
    return _req(f"m{seed}", g, doc[:k]), eagle_tree(random.Random(seed), 4, 3, 8, doc[k:], VOCAB, matcher=g.matcher)


def _mask_016(rt: Any, reqs: List[Any], nxt: torch.Tensor, sib: torch.Tensor, tok: torch.Tensor) -> Dict[str, Any]:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_eagle_overlap.adapters.v0_5_16 import band

    batch = SimpleNamespace(reqs=reqs, spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                            forward_mode=ForwardMode.TARGET_VERIFY,
                            sampling_info=SimpleNamespace(vocab_size=VOCAB, vocab_mask="extend-stage leftover"))
    vi = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib, draft_token=tok.flatten().clone(),
                         grammar=None)
    mask = band.build_vocab_mask(rt, band.begin_verify(rt, batch, vi), vi, batch)
    return {"mask": mask, "leftover_cleared": batch.sampling_info.vocab_mask is None,
            "grammar_set": vi.grammar is reqs[0].grammar}


def _mask_023(rt: Any, reqs: List[Any], nxt: torch.Tensor, sib: torch.Tensor, tok: torch.Tensor,
              chain: bool = False) -> Dict[str, Any]:
    from sglang.srt.speculative import spec_utils

    tree = (spec_utils.GrammarTree.from_linear_chain(tok) if chain
            else spec_utils.GrammarTree.from_device(nxt, sib, tok.clone()))
    info = SimpleNamespace(vocab_size=VOCAB, grammar_mask="extend-stage leftover")
    got = spec_utils.build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info, device=torch.device("cpu"),
                                              barrier=None)
    return {"mask": None if got is None else got.vocab_mask, "leftover_cleared": info.grammar_mask is None,
            "grammar_set": got is None or got.grammar is reqs[0].grammar}


def main(mode: str, version: str) -> Dict[str, Any]:
    from sglang_eo_dev.helpers.grammars import doc_tokens, ensure_sglang_importable, sglang_grammar
    from sglang_eo_dev.helpers.trees import stack_trees

    ensure_sglang_importable()
    import sglang

    from sglang_eagle_overlap.core import COUNTERS

    rt = _runtime(mode)
    facts: Dict[str, Any] = {"sglang_file": sglang.__file__, "runtime": rt is not None}
    if rt is None:
        return facts
    accept: Callable[[Any, List[int]], List[int]] = _accept_016 if version == "0.5.16" else _accept_023

    # A grammar that terminated already keeps the first token; nothing is fed.
    doc = list(doc_tokens("nested", random.Random(5), VOCAB))
    done = _req("d-term", sglang_grammar("nested", VOCAB, doc), doc)
    fed_before = list(done.grammar.accepted_tokens)
    facts["terminated_retained"] = accept(done, [doc[0], doc[1]])
    facts["terminated_expected"] = [doc[0]]
    facts["terminated_fed_nothing"] = done.grammar.accepted_tokens == fed_before

    # A rejected token: the valid prefix is kept and that request alone is aborted, naming it.
    k = len(doc) - 3
    bad = _req("d-rej", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k])
    facts["rejected_retained"] = accept(bad, [doc[k], doc[0]])
    facts["rejected_expected"] = [doc[k]]
    msg = getattr(bad.to_finish, "message", "") or ""
    facts["rejected_message"] = "Grammar accept_token failed: request d-rej" in msg

    # Counter names.
    snap = rt.step.snapshot()
    facts["counters"] = sorted(k for k in snap if k in COUNTERS)
    facts["counters_expected"] = sorted(COUNTERS)

    # CPU mask aliases the builder's buffer; finished-only batches get no mask but lose the leftover mask.
    req, t = _tree(11)
    nxt, sib, tok = stack_trees([t])
    build = (lambda *a, **k: _mask_016(rt, *a)) if version == "0.5.16" else (lambda *a, **k: _mask_023(rt, *a, **k))
    out = build([req], nxt, sib, tok)
    buf = rt.step.builder._buf
    facts["cpu_mask_aliases_builder"] = out["mask"] is not None and out["mask"].data_ptr() == buf.data_ptr()
    finished = _req("d-fin", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k], finished=True)
    out = build([finished], nxt, sib, tok)
    facts["finished_only_no_mask"] = out["mask"] is None
    facts["finished_only_leftover_cleared"] = out["leftover_cleared"]
    facts["grammar_handle_set"] = out["grammar_set"]

    if version == "0.5.23":
        # One builder: with a time limit no build can meet, EAGLE trees time out, chains are built exactly.
        rt.step.builder.time_limit_s = 1e-12
        try:
            before = rt.step.stats.mask_timeouts
            build([req], nxt, sib, tok)
            facts["eagle_tree_limited"] = rt.step.stats.mask_timeouts > before
            before = rt.step.stats.mask_timeouts
            chain = build([req], nxt, sib, tok[:, :4], chain=True)
            facts["chain_exact"] = rt.step.stats.mask_timeouts == before and chain["mask"] is not None
        finally:
            rt.step.builder.time_limit_s = 0.05
    return facts


if __name__ == "__main__":
    from importlib.metadata import version as _v

    print("PROBE-JSON " + json.dumps(main(sys.argv[1], _v("sglang"))))
