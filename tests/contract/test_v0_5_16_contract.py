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

    ADAPTER.deactivate()
    plugin.load()
    assert plugin.is_active(), "plugin did not activate on the installed SGLang 0.5.16"
    yield ADAPTER
    ADAPTER.deactivate()  # later tests in this process see SGLang's own behaviour again


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


# -- behaviour of each hook on real SGLang code with stub objects ---------------------------------------------------
class _Recorder:
    """A grammar that records what it is fed; ``terminate_on`` terminates, ``reject`` raises like XGrammarGrammar."""

    def __init__(self, terminate_on=None, reject=()):
        self.fed = []
        self.terminate_on = terminate_on
        self.reject = set(reject)
        self.finished = False

    def accept_token(self, tok):
        if tok in self.reject:
            raise ValueError(f"token {tok} not allowed")
        self.fed.append(tok)

    def is_terminated(self):
        return self.terminate_on is not None and self.terminate_on in self.fed


def _req(rid, grammar, output_ids=()):
    return types.SimpleNamespace(rid=rid, grammar=grammar, output_ids=list(output_ids), to_finish=None,
                                 finished=lambda: False, is_retracted=False)


def _step():
    """The plugin runtime's core step (ledger, stats) of this process."""
    from sglang_eagle_overlap.integration import runtime

    return runtime.current().step


def _processor(algo="EAGLE3"):
    return types.SimpleNamespace(server_args=types.SimpleNamespace(speculative_algorithm=algo))


def _decode_batch(algo_name, has_grammar=True):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return types.SimpleNamespace(spec_algorithm=getattr(SpeculativeAlgorithm, algo_name), has_grammar=has_grammar,
                                 forward_mode=ForwardMode.DECODE, reqs=[])


def test_is_disable_overlap_drops_only_grammar_sync(adapter):
    from sglang.srt.managers.scheduler import Scheduler

    class _Sched:  # weak-referenceable stand-in for the Scheduler's own attributes that the method reads
        require_mlp_sync = False
        result_queue = [object()]

    sched = _Sched()
    batch = _decode_batch("EAGLE3")
    assert Scheduler.is_disable_overlap_for_batch(sched, batch, batch) is False
    assert batch.has_grammar is True  # restored
    # Not an EAGLE-family algorithm: upstream's decision stands.
    assert Scheduler.is_disable_overlap_for_batch(sched, _decode_batch("NGRAM"), None) is True
    adapter.deactivate()
    try:
        assert Scheduler.is_disable_overlap_for_batch(sched, _decode_batch("EAGLE3"), None) is True  # passive
    finally:
        adapter.activate()


def test_accept_grammar_tokens_advances_exactly_once(adapter):
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    step = _step()

    g = _Recorder(terminate_on=12)
    req = _req("c-once", g, output_ids=[1, 2])
    # The barrier (next verify) advanced first ...
    step.ledger.advance("c-once", g, 2, [11, 12, 13])
    # ... post-processing replays: nothing fed twice, tokens after termination cut.
    out = SchedulerBatchResultProcessor._accept_grammar_tokens(_processor(), req, [11, 12, 13])
    assert out == [11, 12] and g.fed == [11, 12]
    # Without a prior barrier it advances itself.
    g2 = _Recorder()
    out2 = SchedulerBatchResultProcessor._accept_grammar_tokens(_processor(), _req("c-own", g2), [5, 6])
    assert out2 == [5, 6] and g2.fed == [5, 6]


def test_accept_grammar_tokens_rejection_aborts_with_message(adapter):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    req = _req("c-rej", _Recorder(reject={7}))
    out = SchedulerBatchResultProcessor._accept_grammar_tokens(_processor(), req, [6, 7, 8])
    assert out == [6]
    assert isinstance(req.to_finish, FINISH_ABORT) and "c-rej" in req.to_finish.message and "7" in req.to_finish.message


def test_accept_grammar_tokens_passes_through_when_not_eagle(adapter):
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    step = _step()

    g = _Recorder()
    out = SchedulerBatchResultProcessor._accept_grammar_tokens(_processor(algo=None), _req("c-plain", g), [3])
    assert out == [3] and g.fed == [3] and "c-plain" not in step.ledger


def test_apply_prefill_grammar_replays_barrier(adapter):
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    step = _step()

    g = _Recorder()
    step.ledger.advance("c-pre", g, 0, [42])  # barrier at the extend -> decode boundary
    req = _req("c-pre", g, output_ids=[42])  # post-processing appends before accepting
    SchedulerBatchResultProcessor._apply_prefill_grammar(_processor(), req=req, next_token_id=42)
    assert g.fed == [42] and g.finished is False and req.to_finish is None


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
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    step = _step()
    from sglang_eagle_overlap.adapters.v0_5_16 import band
    from sglang_eagle_overlap.integration import runtime

    ga, gb, gc, gd, ge = (_Recorder() for _ in range(5))
    a = _req("b-A", ga, output_ids=[1])
    b = _req("b-B", gb, output_ids=[1])
    b.finished = lambda: True
    c = _req("b-C", gc, output_ids=[1])
    c.is_retracted = True
    d = _req("b-D", gd)
    d.inflight_middle_chunks = 0
    e = _req("b-E", ge)
    e.inflight_middle_chunks = 1
    stride = 4
    #  rows:            A: 10 11 _ _     B: 20 _ _ _      C: 30 31 32 _
    ids = torch.tensor([10, 11, 0, 0, 20, 0, 0, 0, 30, 31, 32, 0])
    decode = (types.SimpleNamespace(reqs=[a, b, c], forward_mode=ForwardMode.DECODE),
              types.SimpleNamespace(next_token_ids=ids, accept_lens=torch.tensor([2, 1, 3]),
                                    speculative_num_draft_tokens=stride, copy_done=None))
    prefill = (types.SimpleNamespace(reqs=[d, e], forward_mode=ForwardMode.EXTEND),
               types.SimpleNamespace(next_token_ids=torch.tensor([40, 50]), copy_done=None))

    class _Sched:
        result_queue = [decode, prefill]

    sched = _Sched()
    rt = runtime.active()
    fed = band.advance_queued_results(rt, sched.result_queue)
    assert fed == 3 and ga.fed == [10, 11] and gb.fed == [] and gc.fed == [] and gd.fed == [40] and ge.fed == []
    # Post-processing of the same results replays, feeding nothing.
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    assert SchedulerBatchResultProcessor._accept_grammar_tokens(_processor(), a, [10, 11]) == [10, 11]
    d.output_ids.append(40)
    SchedulerBatchResultProcessor._apply_prefill_grammar(_processor(), req=d, next_token_id=40)
    assert ga.fed == [10, 11] and gd.fed == [40]
    # A second barrier over the same queue (e.g. two verifies before processing) feeds nothing either.
    a.output_ids = [1]
    d.output_ids = []
    assert band.advance_queued_results(rt, sched.result_queue) == 0 and ga.fed == [10, 11] and gd.fed == [40]
    for key in ("b-A", "b-D"):
        step.ledger.forget(key)
