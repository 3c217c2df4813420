"""The integration's decided behaviours, observed through ONE path into SGLang, on SGLang's own entry points.

``python -m sglang_eo_dev.probes.decisions <mode>``, in a fresh interpreter, prints one ``PROBE-JSON`` line:

* ``hook``: the installed SGLang with the plugin loaded (its hooks);
* ``patched``: a patched copy first on ``sys.path`` (``PYTHONPATH``), the plugin not loaded;
* ``stock``: the installed SGLang, plugin not loaded: SGLang's own behaviour, the reference;
* ``patched`` with ``SGLANG_EAGLE_OVERLAP=0``: the patched copy switched off (must behave as ``stock``).

Every fact comes from calling SGLang's real functions, whichever code sits behind them in that mode:

* post-processing (0.5.16 ``SchedulerBatchResultProcessor._accept_grammar_tokens``, 0.5.23 ``advance_grammar_fsm``)
  on real ``XGrammarGrammar`` objects: a grammar that had already terminated keeps the first token and is fed
  nothing; a rejected token keeps the valid prefix and aborts that request alone (the plugin names it);
* the verify mask: 0.5.16 runs ``eagle_worker_common.run_eagle_verify`` itself -- the hooks' hand-off between
  ``run_eagle_verify``, ``eagle_prepare_for_verify`` and ``eagle_sample`` (or the patched call sites) -- with the
  target forward, the forward-batch preparation and the sampler replaced by recorders underneath the hooks (installed
  before the plugin loads, so the hooks wrap them as they wrap SGLang's); 0.5.23 calls
  ``spec_utils.build_grammar_vocab_mask``. Recorded: the mask's bytes, whether SGLang's own ``generate_token_bitmask``
  ran, the extend stage's leftover mask cleared, ``verify_input.grammar`` set, ``has_grammar`` as SGLang saw it;
  on a CPU device the plugin's mask aliases its builder's buffer (no clone); a batch whose constrained requests all
  finished gets no plugin mask;
* 0.5.16: ``Scheduler.is_disable_overlap_for_batch`` for an EAGLE3 grammar decode batch (stock: True, forced sync);
* the plugin's counters after all of the above (the same events counted under the same names on both paths);
* 0.5.23: one builder -- chain trees (no neutralisable drafts) are built without the time limit, EAGLE trees with it.

``tests/patches/test_decisions.py`` compares the modes fact by fact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import sys
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch

VOCAB = 32000
N = 8  # draft tokens per request in the verify trees below


def _req(rid: str, grammar: Any, output_ids: List[int], finished: bool = False) -> Any:
    return SimpleNamespace(rid=rid, grammar=grammar, output_ids=list(output_ids), finished=lambda: finished,
                           is_retracted=False, inflight_middle_chunks=0, to_finish=None)


def _digest(mask: Optional[torch.Tensor]) -> Optional[str]:
    return None if mask is None else hashlib.sha256(mask.contiguous().cpu().numpy().tobytes()).hexdigest()


# -- SGLang 0.5.16: run_eagle_verify with recorders under the hooks ---------------------------------------------------
class _Verify016:
    """Recorders for the three heavy collaborators of ``run_eagle_verify``; :meth:`install` must run before the
    plugin loads (its hooks then wrap the recorders, as they wrap SGLang's functions)."""

    def __init__(self) -> None:
        self.seen: Dict[str, Any] = {}
        self.upstream_mask_calls = 0

    def install(self) -> None:
        from sglang.srt.speculative import eagle_utils, eagle_worker_common as ewc

        def prepare(verify_input: Any, req_to_token_pool: Any, batch: Any, target_worker: Any) -> Any:
            self.seen["has_grammar_in_prepare"] = bool(batch.has_grammar)
            return SimpleNamespace(mark_forward_metadata_ready=lambda: None), False

        def sample(verify_input: Any, batch: Any, logits_output: Any, vocab_mask: Any = None) -> Any:
            self.seen.update(mask=vocab_mask, has_grammar_at_sample=bool(batch.has_grammar),
                             leftover_cleared=batch.sampling_info.vocab_mask is None,
                             grammar_set=verify_input.grammar is not None
                             and verify_input.grammar is next(r.grammar for r in batch.reqs))
            bs = len(batch.reqs)
            return (torch.zeros(bs * N, dtype=torch.int64), torch.ones(bs, dtype=torch.int32),
                    (torch.arange(bs) * N).view(bs, 1))

        upstream = ewc.generate_token_bitmask

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.upstream_mask_calls += 1
            return upstream(*args, **kwargs)

        for mod in (eagle_utils, ewc):
            mod.eagle_prepare_for_verify = prepare
            mod.eagle_sample = sample
        ewc.generate_token_bitmask = counted  # SGLang's own mask (not a hooked target)
        ewc.fill_bonus_tokens_func = lambda *a, **k: None  # bookkeeping kernels, not grammar work
        ewc.commit_mamba_states_after_verify = lambda *a, **k: None

    def run(self, reqs: List[Any], nxt: torch.Tensor, sib: torch.Tensor, tok: torch.Tensor) -> Dict[str, Any]:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative import eagle_worker_common as ewc
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        bs = len(reqs)
        vi = SimpleNamespace(retrieve_next_token=nxt, retrieve_next_sibling=sib, draft_token=tok.flatten().clone(),
                             grammar=None, custom_mask=None, positions=None, retrieve_index=None)
        batch = SimpleNamespace(reqs=reqs, spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                                forward_mode=ForwardMode.DECODE, spec_info=vi, seq_lens=torch.full((bs,), 10),
                                req_pool_indices=torch.arange(bs), input_ids=None, out_cache_loc=None,
                                return_logprob=False,
                                sampling_info=SimpleNamespace(vocab_size=VOCAB, vocab_mask="extend-stage leftover"))
        logits = SimpleNamespace(next_token_logits=torch.zeros(bs * N, 4))
        output = SimpleNamespace(logits_output=logits, routed_experts_output=None, indexer_topk_output=None)
        target = SimpleNamespace(forward_batch_generation=lambda **k: output,
                                 model_runner=SimpleNamespace())
        self.seen = {}
        calls = self.upstream_mask_calls
        ewc.run_eagle_verify(batch, target_worker=target, req_to_token_pool=None,
                             token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace()),
                             plan_stream=None, plan_stream_ctx=contextlib.nullcontext(), topk=4, num_steps=3,
                             num_draft_tokens=N, device="cpu", metadata_ready_pre_pad=False, finalize_tree_path=False)
        seen = dict(self.seen)
        seen["upstream_mask_calls"] = self.upstream_mask_calls - calls
        seen["has_grammar_after"] = bool(batch.has_grammar)
        return seen


def _processor() -> Any:
    """A real ``SchedulerBatchResultProcessor`` (0.5.16: a dataclass; 0.5.23: a scheduler mixin); its grammar paths
    read only ``server_args`` (0.5.16)."""
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    cls = brp.SchedulerBatchResultProcessor
    if not hasattr(cls, "__dataclass_fields__") or "server_args" not in cls.__dataclass_fields__:
        return cls.__new__(cls)  # 0.5.23: no per-instance state on the grammar path
    fields = {f.name: None for f in dataclasses.fields(cls)}
    fields["server_args"] = SimpleNamespace(speculative_algorithm="EAGLE3")
    return cls(**fields)


def _accept_016(req: Any, run: List[int]) -> List[int]:
    return list(_processor()._accept_grammar_tokens(req, run))


def _overlap_016(reqs: List[Any]) -> bool:
    from collections import deque

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                            forward_mode=ForwardMode.DECODE, reqs=reqs)
    sched = SimpleNamespace(require_mlp_sync=False, result_queue=deque([("previous batch", None)]))
    return bool(Scheduler.is_disable_overlap_for_batch(sched, batch, None))


# -- SGLang 0.5.23 --------------------------------------------------------------------------------------------------
def _accept_023(req: Any, run: List[int]) -> List[int]:
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    stride = 8
    res = GenerationBatchResult(next_token_ids=torch.tensor(run + [0] * (stride - len(run))),
                                accept_lens=torch.tensor([len(run)]), speculative_num_draft_tokens=stride)
    batch = SimpleNamespace(reqs=[req], has_grammar=True, forward_mode=ForwardMode.DECODE)
    _processor().advance_grammar_fsm(res, batch)
    return list(res.grammar_retained_tokens[0])


def _mask_023(reqs: List[Any], nxt: torch.Tensor, sib: torch.Tensor, tok: torch.Tensor,
              chain: bool = False) -> Dict[str, Any]:
    from sglang.srt.speculative import spec_utils

    tree = (spec_utils.GrammarTree.from_linear_chain(tok) if chain
            else spec_utils.GrammarTree.from_device(nxt, sib, tok.clone()))
    info = SimpleNamespace(vocab_size=VOCAB, grammar_mask="extend-stage leftover")
    got = spec_utils.build_grammar_vocab_mask(reqs=reqs, tree=tree, sampling_info=info, device=torch.device("cpu"),
                                              barrier=None)
    return {"mask": None if got is None else got.vocab_mask, "leftover_cleared": info.grammar_mask is None,
            "grammar_set": got is None or got.grammar is reqs[0].grammar}


def _runtime(mode: str) -> Any:
    if mode == "hook":
        from sglang_eagle_overlap import plugin
        from sglang_eagle_overlap.integration import runtime

        plugin.load()
        return runtime.active()
    if mode == "stock":
        return None
    from sglang.srt.speculative import grammar_overlap

    return grammar_overlap.runtime()


def main(mode: str, version: str) -> Dict[str, Any]:
    from sglang_eo_dev.helpers.grammars import doc_tokens, ensure_sglang_importable, sglang_grammar
    from sglang_eo_dev.helpers.trees import eagle_tree, stack_trees

    ensure_sglang_importable()
    import sglang

    from sglang_eagle_overlap.core.stats import COUNTERS

    v016 = version == "0.5.16"
    verify016 = _Verify016() if v016 else None
    if verify016 is not None:
        verify016.install()  # before the plugin loads: its hooks wrap the recorders
    rt = _runtime(mode)
    facts: Dict[str, Any] = {"sglang_file": sglang.__file__, "runtime": rt is not None}
    accept: Callable[[Any, List[int]], List[int]] = _accept_016 if v016 else _accept_023

    # A grammar that terminated already: what is kept of a run, and what is fed.
    doc = list(doc_tokens("nested", random.Random(5), VOCAB))
    done = _req("d-term", sglang_grammar("nested", VOCAB, doc), doc)
    fed_before = list(done.grammar.accepted_tokens)
    facts["terminated_retained"] = accept(done, [doc[0], doc[1]])
    facts["terminated_fed"] = done.grammar.accepted_tokens[len(fed_before):]
    facts["terminated_aborted"] = done.to_finish is not None

    # A rejected token ('{' cannot follow): what is kept, whether that request alone is aborted.
    k = len(doc) - 3
    bad = _req("d-rej", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k])
    facts["rejected_retained"] = accept(bad, [doc[k], doc[0]])
    facts["rejected_fed"] = bad.grammar.accepted_tokens[k:]
    facts["rejected_aborted"] = bad.to_finish is not None
    msg = getattr(bad.to_finish, "message", "") or ""
    facts["rejected_message_names_request"] = "Grammar accept_token failed: request d-rej" in msg

    # The verify mask.
    rng = random.Random(11)
    mdoc = list(doc_tokens("nested", rng, VOCAB))
    half = len(mdoc) // 2
    g = sglang_grammar("nested", VOCAB, mdoc[:half])
    req = _req("m11", g, mdoc[:half])
    nxt, sib, tok = stack_trees([eagle_tree(rng, 4, 3, N, mdoc[half:], VOCAB, matcher=g.matcher)])
    finished = _req("d-fin", sglang_grammar("nested", VOCAB, doc[:k]), doc[:k], finished=True)
    buf = None
    if verify016 is not None:
        out = verify016.run([req], nxt, sib, tok)
        if rt is not None:
            buf = rt.step.builder._buf
        facts["mask_sha256"] = _digest(out["mask"])  # before the next build reuses the builder's buffer
        fin = verify016.run([finished], nxt, sib, tok)
        for key in ("has_grammar_in_prepare", "has_grammar_at_sample", "has_grammar_after", "upstream_mask_calls"):
            facts[key] = out[key]
        facts["overlap_disabled"] = _overlap_016([req])
    else:
        out = _mask_023([req], nxt, sib, tok)
        if rt is not None:
            buf = rt.step.builder._buf
        facts["mask_sha256"] = _digest(out["mask"])
        fin = _mask_023([finished], nxt, sib, tok)
    facts["mask_rows"] = None if out["mask"] is None else int(out["mask"].shape[0])
    facts["leftover_cleared"] = out["leftover_cleared"]
    facts["grammar_set"] = out["grammar_set"]
    facts["cpu_mask_aliases_builder"] = (buf is not None and out["mask"] is not None
                                         and out["mask"].data_ptr() == buf.data_ptr())
    facts["finished_only_mask"] = fin["mask"] is not None
    facts["finished_only_leftover_cleared"] = fin["leftover_cleared"]

    if not v016 and rt is not None:
        # One builder: with a time limit no build can meet, EAGLE trees time out, chains are built exactly.
        limit = rt.step.builder.time_limit_s
        rt.step.builder.time_limit_s = 1e-12
        try:
            before = rt.step.telemetry.stats.mask_timeouts
            _mask_023([req], nxt, sib, tok)
            facts["eagle_tree_limited"] = rt.step.telemetry.stats.mask_timeouts > before
            before = rt.step.telemetry.stats.mask_timeouts
            chain = _mask_023([req], nxt, sib, tok[:, :4], chain=True)
            facts["chain_exact"] = rt.step.telemetry.stats.mask_timeouts == before and chain["mask"] is not None
        finally:
            rt.step.builder.time_limit_s = limit

    # What the plugin counted for all of the above (None where no plugin runs).
    snap = rt.step.telemetry.snapshot() if rt is not None else None
    facts["counters"] = None if snap is None else {name: snap[name] for name in COUNTERS}
    facts["mask_timeouts"] = None if snap is None else snap["mask_timeouts"]
    return facts


if __name__ == "__main__":
    from importlib.metadata import version as _v

    print("PROBE-JSON " + json.dumps(main(sys.argv[1], _v("sglang"))))
