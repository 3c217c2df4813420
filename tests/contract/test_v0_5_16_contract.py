"""Contract tests of the SGLang 0.5.16 adapter against the real installed SGLang (CPU only, no engine).

One test per hooked target: the target exists with the signature the hook was written for, the callers that did
``from X import name`` reach the patched object after ``load()``, loading twice wraps once, the hooks pass through
while the plugin is inactive, and a missing target makes ``load()`` raise ``PluginLoadError`` with every hook passive.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap
import types

import pytest
from sglang_eo_dev.helpers.steps import feed_one

pytestmark = pytest.mark.sglang_0_5_16

# Upstream signatures the hooks were written against (parameter names, in order).
PINNED = {
    "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch": ["self", "batch", "last_batch"],
    "sglang.srt.speculative.eagle_worker_common.run_eagle_verify": [
        "batch", "target_worker", "req_to_token_pool", "token_to_kv_pool_allocator", "plan_stream",
        "plan_stream_ctx", "topk", "num_steps", "num_draft_tokens", "device", "metadata_ready_pre_pad",
        "finalize_tree_path",
    ],
    "sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify": [
        "verify_input", "req_to_token_pool", "batch", "target_worker",
    ],
    "sglang.srt.speculative.eagle_utils.eagle_sample": ["verify_input", "batch", "logits_output", "vocab_mask"],
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "_accept_grammar_tokens": ["self", "req", "tokens"],
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
    "_apply_prefill_grammar": ["self", "req", "next_token_id"],
}

# The subprocess needs the CUDA-built torchvision wheel to import against CPU torch, as conftest arranges here.
TORCHVISION_SHIM = (
    "from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook\n"
    "install_import_hook()\n"
)



def _import_sglang() -> None:
    for mod in (
        "sglang.srt.managers.scheduler",
        "sglang.srt.speculative.eagle_worker_v2",
        "sglang.srt.managers.scheduler_components.batch_result_processor",
    ):
        importlib.import_module(mod)


@pytest.fixture(scope="module")
def adapter():
    _import_sglang()
    import sglang_eagle_overlap.plugin as plugin

    plugin = importlib.reload(plugin)
    from sglang_eagle_overlap.adapters.v0_5_16 import ADAPTER
    from sglang_eo_dev.helpers.plugin_state import deactivate

    deactivate()
    plugin.load()
    assert plugin.is_active(), "plugin did not activate on the installed SGLang 0.5.16"
    yield ADAPTER
    deactivate()  # later tests in this process see SGLang's own behaviour again


def _hook_for(target):
    from sglang_eagle_overlap.adapters.v0_5_16 import HOOKS

    return next(h for h in HOOKS if h.target == target)


def test_every_hook_is_pinned():
    from sglang_eagle_overlap.adapters.v0_5_16 import HOOKS

    assert sorted(h.target for h in HOOKS) == sorted(PINNED)


@pytest.mark.parametrize("target", sorted(PINNED))
def test_target_signature_pinned(adapter, target):
    from sglang_eagle_overlap.integration.hooks import resolve_attr

    fn = resolve_attr(target)  # patched; functools.wraps keeps the upstream signature reachable
    params = list(inspect.signature(fn).parameters)
    assert params == PINNED[target], f"{target}: SGLang's signature changed to {params}; re-check the hook"


@pytest.mark.parametrize("target", sorted(PINNED))
def test_callers_reach_patched_attribute(adapter, target):
    from sglang_eagle_overlap.integration.hooks import contains_hook as _contains_hook
    from sglang_eagle_overlap.integration.hooks import importable_callers, resolve_attr, verify_hooks

    hook = _hook_for(target)
    assert _contains_hook(resolve_attr(target), hook.fn)
    (checked,) = importable_callers((hook,))
    assert verify_hooks((checked,)) == []
    for mod_name, attr in checked.callers:
        assert _contains_hook(getattr(importlib.import_module(mod_name), attr), hook.fn), f"{mod_name}.{attr}"


def test_callers_listed_are_real_from_imports():
    # Every listed caller module really does `from <target module> import <name>` in the pristine source.
    from sglang_eagle_overlap.adapters.v0_5_16 import HOOKS

    for h in HOOKS:
        for mod_name, attr in h.callers:
            spec = importlib.util.find_spec(mod_name)
            src = open(spec.origin).read()
            assert f"{attr}," in src or f"import {attr}" in src, f"{mod_name} no longer imports {attr}"


def _wrap_depth(obj, fn) -> int:
    count = 0
    seen = 0
    while obj is not None and seen < 32:
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                if cell.cell_contents is fn:
                    count += 1
            except ValueError:
                pass
        obj = getattr(obj, "__wrapped__", None)
        seen += 1
    return count


def test_load_is_idempotent(adapter):
    import sglang_eagle_overlap.plugin as plugin
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_eagle_overlap.integration.hooks import resolve_attr
    from sglang_eagle_overlap.adapters.v0_5_16 import HOOKS

    plugin.load()
    HookRegistry.apply_hooks()
    for h in HOOKS:
        assert _wrap_depth(resolve_attr(h.target), h.fn) == 1, h.target
    assert adapter.verify() == []


# -- behaviour of each hook on real SGLang code: real Req, XGrammarGrammar and SchedulerBatchResultProcessor ---------
# (the scheduler and the batch of the overlap decision stay plain namespaces: the method reads four attributes)
VOCAB = 32000


def _doc(seed=0):
    """Token ids of a valid document of the ``nested`` schema, ending with the EOS that terminates it."""
    import random

    from sglang_eo_dev.helpers.grammars import doc_tokens

    return list(doc_tokens("nested", random.Random(seed), VOCAB))


def _req(rid, prefix=(), grammar=True):
    """A real SGLang ``Req`` that produced ``prefix`` so far, with a real ``XGrammarGrammar`` advanced over it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_eo_dev.helpers.grammars import sglang_grammar

    req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=4096))
    req.output_ids.extend(prefix)
    req.grammar = sglang_grammar("nested", VOCAB, list(prefix)) if grammar else None
    return req


def _step():
    """The plugin runtime's core step (ledger, stats) of this process."""
    from sglang_eagle_overlap.integration import runtime

    return runtime.current().step


def _processor(algo="EAGLE3", **given):
    """A real ``SchedulerBatchResultProcessor`` (a frozen dataclass with slots); its grammar paths read only
    ``server_args``, ``_resolve_spec_v2_tokens`` also ``model_worker`` (``given``)."""
    import dataclasses

    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    fields = {f.name: None for f in dataclasses.fields(SchedulerBatchResultProcessor)}
    fields["server_args"] = types.SimpleNamespace(speculative_algorithm=algo)
    fields.update(given)
    return SchedulerBatchResultProcessor(**fields)


def _decode_batch(algo_name, has_grammar=True, reqs=()):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(spec_algorithm=getattr(SpeculativeAlgorithm, algo_name), has_grammar=has_grammar,
                                 forward_mode=ForwardMode.DECODE, reqs=list(reqs))


def test_is_disable_overlap_drops_only_grammar_sync(adapter):
    from sglang.srt.managers.scheduler import Scheduler

    class _Sched:  # weak-referenceable stand-in for the Scheduler's own attributes that the method reads
        require_mlp_sync = False
        result_queue = [object()]

    sched = _Sched()
    batch = _decode_batch("EAGLE3", reqs=[_req("c-ov", _doc()[:3])])
    assert Scheduler.is_disable_overlap_for_batch(sched, batch, batch) is False
    assert batch.has_grammar is True  # restored
    # Not an EAGLE-family algorithm: upstream's decision stands.
    assert Scheduler.is_disable_overlap_for_batch(sched, _decode_batch("NGRAM"), None) is True
    from sglang_eo_dev.helpers.plugin_state import deactivate

    deactivate()
    try:
        assert Scheduler.is_disable_overlap_for_batch(sched, _decode_batch("EAGLE3"), None) is True  # passive
    finally:
        adapter.activate()


def test_accept_grammar_tokens_advances_exactly_once(adapter):
    step = _step()
    doc = _doc(1)
    k = len(doc) // 2
    req = _req("c-once", doc[:k])
    # The barrier (next verify) advanced first ...
    feed_one(step.ledger, "c-once", req.grammar, k, doc[k:k + 2])
    assert req.grammar.accepted_tokens == doc[:k + 2]
    # ... post-processing replays: nothing fed twice (a second feed would be rejected by the real matcher or
    # lengthen accepted_tokens), the request goes on.
    out = _processor()._accept_grammar_tokens(req, doc[k:k + 2])
    assert out == doc[k:k + 2] and req.grammar.accepted_tokens == doc[:k + 2] and req.to_finish is None
    # Without a prior barrier it advances itself; tokens drafted past the grammar's end (EOS) are cut.
    j = len(doc) - 3
    req2 = _req("c-own", doc[:j])
    out2 = _processor()._accept_grammar_tokens(req2, doc[j:] + [doc[0], doc[1]])
    assert out2 == doc[j:] and req2.grammar.accepted_tokens == doc and req2.grammar.is_terminated()
    assert req2.to_finish is None


def test_accept_grammar_tokens_rejection_aborts_with_message(adapter):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    doc = _doc(2)
    k = len(doc) - 3
    req = _req("c-rej", doc[:k])
    out = _processor()._accept_grammar_tokens(req, [doc[k], doc[0], doc[k + 1]])  # '{' cannot follow
    assert out == [doc[k]] and req.grammar.accepted_tokens == doc[:k + 1]
    assert isinstance(req.to_finish, FINISH_ABORT) and "c-rej" in req.to_finish.message
    assert str(doc[0]) in req.to_finish.message


def test_accept_grammar_tokens_passes_through_when_not_eagle(adapter):
    step = _step()
    doc = _doc(3)
    req = _req("c-plain", doc[:2])
    out = _processor(algo=None)._accept_grammar_tokens(req, [doc[2]])
    assert out == [doc[2]] and req.grammar.accepted_tokens == doc[:3] and "c-plain" not in step.ledger


def test_apply_prefill_grammar_replays_barrier(adapter):
    step = _step()
    doc = _doc(4)
    req = _req("c-pre")
    feed_one(step.ledger, "c-pre", req.grammar, 0, [doc[0]])  # barrier at the extend -> decode boundary
    req.output_ids.append(doc[0])  # post-processing appends before accepting
    _processor()._apply_prefill_grammar(req=req, next_token_id=doc[0])
    assert req.grammar.accepted_tokens == [doc[0]] and req.grammar.finished is False and req.to_finish is None


def test_run_eagle_verify_and_sample_pass_through_without_grammar(adapter):
    from sglang.srt.speculative import eagle_worker_common
    from sglang_eagle_overlap.adapters.v0_5_16 import band
    from sglang_eagle_overlap.integration import runtime

    batch = types.SimpleNamespace(has_grammar=False)
    assert band.begin_verify(runtime.active(), batch, None) is None
    # eagle_sample's hook with no step context calls straight through (idle batch path of the real function).
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    idle = types.SimpleNamespace(forward_mode=ForwardMode.IDLE, device="cpu")
    predict, lens, idx = eagle_worker_common.eagle_sample(None, idle, None, None)
    assert predict.numel() == 0 and lens.numel() == 0 and idx.numel() == 0


def test_missing_target_refuses_and_stays_passive(tmp_path):
    code = TORCHVISION_SHIM + textwrap.dedent(
        """
        import importlib
        import sglang.srt.managers.scheduler
        from sglang_eagle_overlap.adapters import v0_5_16
        from sglang_eagle_overlap.integration.hooks import Hook
        from sglang_eagle_overlap.integration import runtime
        bogus = Hook(target="sglang.srt.managers.scheduler.Scheduler.no_such_method_eo", hook_type="AROUND",
                     fn=lambda original, *a, **k: original(*a, **k))
        v0_5_16.ADAPTER.hooks = v0_5_16.HOOKS + (bogus,)
        from sglang_eagle_overlap import plugin
        try:
            plugin.load()
        except plugin.PluginLoadError as exc:
            print("REFUSED", "no_such_method_eo" in str(exc), "0.5.16" in str(exc))
        print("ACTIVE", plugin.is_active(), runtime.active() is not None)
        from sglang.srt.managers.scheduler import Scheduler
        import types
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        b = types.SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.EAGLE3, has_grammar=True,
                                  forward_mode=ForwardMode.DECODE, reqs=[])
        s = types.SimpleNamespace(require_mlp_sync=False, result_queue=[1])
        print("UPSTREAM", Scheduler.is_disable_overlap_for_batch(s, b, None))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED True True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "ACTIVE False False" in out.stdout
    assert "UPSTREAM True" in out.stdout  # hooks landed but stay passive: SGLang's own decision


def test_barrier_advances_queued_decode_and_prefill_results_once(adapter):
    """result_queue holds a decode result (A, B finished, C retracted) and a prefill result (D, E still chunked)."""
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_eo_dev.helpers.devices import verify_result

    from sglang_eagle_overlap.adapters.v0_5_16 import band
    from sglang_eagle_overlap.integration import runtime
    from sglang_eo_dev.helpers.plugin_state import feed_results

    step = _step()
    doc = _doc(5)
    a, b, c = (_req(f"b-{x}", doc[:1]) for x in "ABC")
    b.finished_reason = FINISH_LENGTH(length=1)
    c.is_retracted = True
    d, e = _req("b-D"), _req("b-E")
    e.inflight_middle_chunks = 1
    decode = (types.SimpleNamespace(reqs=[a, b, c], forward_mode=ForwardMode.DECODE),
              verify_result([doc[1:3], doc[1:2], doc[1:4]], 4))  # A, B, C's runs at stride 4
    prefill = (types.SimpleNamespace(reqs=[d, e], forward_mode=ForwardMode.EXTEND),
               GenerationBatchResult(next_token_ids=torch.tensor([doc[0], doc[0]])))

    class _Sched:
        result_queue = [decode, prefill]

    sched = _Sched()
    rt = runtime.active()

    def fed():
        return [g.accepted_tokens for g in (a.grammar, b.grammar, c.grammar, d.grammar, e.grammar)]

    assert feed_results(band.band_of(rt), sched.result_queue) == 3
    want = [doc[:3], doc[:1], doc[:1], doc[:1], []]
    assert fed() == want
    # Post-processing of the same results replays, feeding nothing.
    assert _processor()._accept_grammar_tokens(a, doc[1:3]) == doc[1:3]
    d.output_ids.append(doc[0])
    _processor()._apply_prefill_grammar(req=d, next_token_id=doc[0])
    assert fed() == want and a.to_finish is None and d.to_finish is None
    # A second barrier over the same queue (e.g. two verifies before processing) feeds nothing either.
    del d.output_ids[:]
    assert feed_results(band.band_of(rt), sched.result_queue) == 0 and fed() == want
    for key in ("b-A", "b-D"):
        step.ledger.forget(key)


def test_barrier_then_sglangs_own_result_loop_commits_each_run_once(adapter, monkeypatch):
    """One verify result through the barrier (the next verify's ``Band.feed_results``), then through SGLang's own
    ``_resolve_spec_v2_tokens``, the loop that calls the hooked ``_accept_grammar_tokens`` once per request: A's run
    was fed whole (replayed), B's drafted past the grammar's end (cut after the terminating token), C's was rejected
    after its first token (aborted, its valid prefix kept), D is retracted and E unconstrained (neither asked). Every
    run is committed as SGLang commits it and each grammar is fed exactly once."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_eo_dev.helpers.devices import verify_result

    from sglang_eagle_overlap.adapters.v0_5_16 import band
    from sglang_eagle_overlap.integration import runtime
    from sglang_eo_dev.helpers.plugin_state import feed_results

    step = _step()
    doc = _doc(6)
    k, j, m = 2, len(doc) - 2, len(doc) - 3
    a, d = (_req(f"r-{x}", doc[:k]) for x in "AD")
    b, c = _req("r-B", doc[:j]), _req("r-C", doc[:m])
    e = _req("r-E", doc[:k], grammar=False)
    d.is_retracted = True
    runs = [doc[k:k + 3], doc[j:] + [doc[0]], [doc[m], doc[0], doc[m + 1]], doc[k:k + 1], [7, 8]]  # C: '{' rejected
    # has_grammar False: the overlap loop hands post-processing a copy of the batch without that flag
    batch = types.SimpleNamespace(reqs=[a, b, c, d, e], forward_mode=ForwardMode.DECODE, has_grammar=False)
    result = verify_result(runs, 4)
    assert feed_results(band.band_of(runtime.active()), [(batch, result)]) == 3 + 2 + 1
    replays = step.telemetry.stats.counters["replays"]
    asked = []
    ask = SchedulerBatchResultProcessor._accept_grammar_tokens  # the hooked method, wrapped to see the loop's asks
    monkeypatch.setattr(SchedulerBatchResultProcessor, "_accept_grammar_tokens",
                        lambda self, req, toks: asked.append(req.rid) or ask(self, req, toks))
    worker = types.SimpleNamespace(on_verify_complete_cpu=lambda *args, **kwargs: None)
    out = _processor(model_worker=worker)._resolve_spec_v2_tokens(result, batch)
    assert out == [runs[0], doc[j:], [doc[m]], runs[3], runs[4]] and asked == ["r-A", "r-B", "r-C"]
    assert a.grammar.accepted_tokens == doc[:k + 3] and b.grammar.accepted_tokens == doc
    assert c.grammar.accepted_tokens == doc[:m + 1] and d.grammar.accepted_tokens == doc[:k]
    assert [r.kv_committed_len for r in (a, b, c, e)] == [3, 2, 1, 2] and d.kv_committed_len == 0
    assert isinstance(c.to_finish, FINISH_ABORT) and all(r.to_finish is None for r in (a, b, d, e))
    assert step.telemetry.stats.counters["replays"] == replays + 3  # nothing fed again: A, B, C answered from the ledger
    for key in ("r-A", "r-B", "r-C"):
        step.ledger.forget(key)


def test_forced_drafts_contract():
    """Grammar-forced drafts rely on: run_eagle_verify's entry (the hook's before_verify) preceding
    eagle_prepare_for_verify, which makes the draft tokens the target's input; eagle_sample's third result being
    the accepted nodes' flat rows (from retrieve_index); the verify input carrying topk and draft_token."""
    from sglang.srt.speculative import eagle_utils, eagle_worker_common
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    verify_src = inspect.getsource(eagle_worker_common.run_eagle_verify)
    assert "accept_index,\n    ) = eagle_sample(" in verify_src
    assert 0 < verify_src.find("eagle_prepare_for_verify(") < verify_src.find("eagle_sample(")
    assert "verify_input.draft_token" in inspect.getsource(eagle_utils.eagle_prepare_for_verify)
    assert "retrive_index=verify_input.retrieve_index" in inspect.getsource(eagle_utils.eagle_sample)
    assert {"topk", "draft_token", "retrieve_next_token"} <= set(EagleVerifyInput.__dataclass_fields__)
