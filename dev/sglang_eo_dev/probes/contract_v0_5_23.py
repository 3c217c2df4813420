"""Run in a fresh interpreter by test_v0_5_23_contract.py: loads the plugin into the real SGLang 0.5.23 and reports.

``python sglang_eo_dev/probes/contract_v0_5_23.py load``    -> JSON facts after plugin.load() (twice)
``python sglang_eo_dev/probes/contract_v0_5_23.py refuse``  -> JSON facts after plugin.load() with one hook target removed
"""

from __future__ import annotations

import inspect
import json
import sys


def _sig(obj) -> str:
    """Parameter names and kinds only (annotations are strings under ``from __future__ import annotations``)."""
    out = []
    for prm in inspect.signature(obj).parameters.values():
        prefix = {inspect.Parameter.KEYWORD_ONLY: "*", inspect.Parameter.VAR_POSITIONAL: "*args:",
                  inspect.Parameter.VAR_KEYWORD: "**"}.get(prm.kind, "")
        default = "" if prm.default is inspect.Parameter.empty else "=" + repr(prm.default)
        out.append(prefix + prm.name + default)
    return "(" + ", ".join(out) + ")"


def _compat() -> None:
    try:  # CPU test venv: let the CUDA-built torchvision import against CPU torch (test-only helper)
        from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

        install_import_hook()
    except Exception:
        pass


def pinned_facts() -> dict:
    from sglang.srt.constrained import base_grammar_backend as bgb
    from sglang.srt.constrained import xgrammar_backend as xgb
    from sglang.srt.managers import scheduler as sched
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.speculative import eagle_worker_common as ewc
    from sglang.srt.speculative import eagle_utils, spec_utils
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    gt = spec_utils.GrammarTree
    verify_src = inspect.getsource(ewc.run_eagle_verify)
    dispatch_src = inspect.getsource(xgb.XGrammarGrammarBackend.dispatch_json)
    return {
        # the JSON-schema compile hook: below SGLang's cache (keyed by the request's text), the text it gets is the
        # one xgrammar compiles and the grammar object is named by
        "dispatch_json": _sig(xgb.XGrammarGrammarBackend.dispatch_json),
        "cache_keyed_by_request_text": "self.cache.get(key)" in inspect.getsource(
            bgb.BaseGrammarBackend.get_cached_or_future_value),
        "cache_miss_dispatches_json": "self.dispatch_json(key_string)" in inspect.getsource(
            bgb.BaseGrammarBackend._init_value_dispatch),
        "dispatch_compiles_its_argument": "schema=key_string" in dispatch_src
        and "_from_context(ctx, key_string" in dispatch_src and "InvalidGrammarObject(" in dispatch_src,
        "GrammarTree.__init__": _sig(gt.__init__),
        "GrammarTree.from_device": _sig(gt.from_device),
        "GrammarTree.from_host": _sig(gt.from_host),
        "GrammarTree.from_linear_chain": _sig(gt.from_linear_chain),
        "GrammarTree.resolve": _sig(gt.resolve),
        "build_grammar_vocab_mask": _sig(spec_utils.build_grammar_vocab_mask),
        "advance_grammar_fsm": _sig(brp.SchedulerBatchResultProcessor.advance_grammar_fsm),
        "verify_calls_from_device": "GrammarTree.from_device(" in verify_src,
        "verify_calls_mask_with_barrier": "build_grammar_vocab_mask(" in verify_src
        and "barrier=grammar_barrier" in verify_src,
        "verify_draft_view": "verify_input.draft_token.view(" in verify_src,
        "run_eagle_verify": _sig(ewc.run_eagle_verify),
        # The grammar thread starts at the tree constructor and runs while this stretch of the verify body does: it
        # must launch the target forward and touch no grammar object.
        "verify_tree_before_forward": 0 <= verify_src.find("GrammarTree.from_device(")
        < verify_src.find("target_worker.forward_batch_generation(") < verify_src.find("build_grammar_vocab_mask("),
        "verify_stretch_grammar_free": not any(
            w in verify_src[verify_src.find("GrammarTree.from_device("):verify_src.find("build_grammar_vocab_mask(")]
            for w in ("accept_token", "rollback", "grammar_barrier(", ".grammar.", "fill_vocab_mask")
        ),
        "barrier_calls_advance": "advance_grammar_fsm(" in inspect.getsource(sched.Scheduler._advance_pending_grammar),
        "eagle3_grammar_overlap": bool(SpeculativeAlgorithm.EAGLE3.supports_grammar_overlap()),
        # grammar-forced drafts: eagle_sample's third result is the accepted nodes' flat rows; the hook's entry
        # precedes eagle_prepare_for_verify, which makes the draft tokens the target's input.
        "eagle_sample": _sig(eagle_utils.eagle_sample),
        "verify_unpacks_accept_index": "accept_index,\n    ) = eagle_sample(" in verify_src,
        "sample_accept_index_from_retrieve_index": "retrieve_index=verify_input.retrieve_index"
        in inspect.getsource(eagle_utils.eagle_sample),
        "verify_prepares_after_entry": 0 < verify_src.find("eagle_prepare_for_verify(")
        < verify_src.find("GrammarTree.from_device("),
        "prepare_reads_draft_token": "verify_input.draft_token" in inspect.getsource(eagle_utils.eagle_prepare_for_verify),
        "verify_input_fields": all(f in EagleVerifyInput.__dataclass_fields__ for f in ("topk", "draft_probs",
                                                                                       "draft_token")),
        "result_has_grammar_fields": all(
            f in inspect.getsource(brp.SchedulerBatchResultProcessor.advance_grammar_fsm)
            for f in ("grammar_advanced", "grammar_retained_tokens", "inflight_middle_chunks", "is_retracted")
        ),
    }


def load_facts() -> dict:
    import importlib

    from sglang_eagle_overlap import plugin
    from sglang_eagle_overlap.integration import runtime
    from sglang_eagle_overlap.integration.hooks import contains_hook as _contains_hook
    from sglang_eagle_overlap.integration.hooks import importable_callers
    from sglang_eagle_overlap.adapters.v0_5_23 import ADAPTER, HOOKS

    facts = {"pinned": pinned_facts()}
    plugin.load()
    facts["active"] = plugin.is_active() and runtime.active() is not None
    facts["missing"] = ADAPTER.verify()
    callers = {}
    checked = importable_callers(HOOKS)
    for h in checked:
        for mod, attr in h.callers:
            callers[f"{mod}.{attr}"] = _contains_hook(getattr(importlib.import_module(mod), attr), h.fn)
    facts["callers"] = callers
    facts["callers_checked"] = sum(len(h.callers) for h in checked)
    from sglang.srt.managers.scheduler_components import batch_result_processor as brp
    from sglang.srt.speculative import spec_utils

    before = (spec_utils.GrammarTree, spec_utils.build_grammar_vocab_mask,
              brp.SchedulerBatchResultProcessor.advance_grammar_fsm)
    plugin.load()  # idempotent: no second wrapper
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    after = (spec_utils.GrammarTree, spec_utils.build_grammar_vocab_mask,
             brp.SchedulerBatchResultProcessor.advance_grammar_fsm)
    facts["idempotent"] = all(a is b for a, b in zip(before, after))
    facts["targets"] = {h.target: _contains_hook(_resolve(h.target), h.fn) for h in HOOKS}
    return facts


def _resolve(path):
    from sglang_eagle_overlap.integration.hooks import resolve_attr

    return resolve_attr(path)


def refuse_facts() -> dict:
    import torch

    from sglang.srt.speculative import spec_utils

    orig_tree = spec_utils.GrammarTree
    del spec_utils.build_grammar_vocab_mask  # simulate a renamed target
    from sglang_eagle_overlap import plugin
    from sglang_eagle_overlap.integration import runtime

    facts = {}
    try:
        plugin.load()
        facts["raised"] = None
    except plugin.PluginLoadError as exc:
        facts["raised"] = str(exc)
    facts["active"] = plugin.is_active() or runtime.active() is not None
    # The hooks that did land must pass through: SGLang's own tree class comes back.
    t = torch.zeros((1, 2), dtype=torch.int64)
    tree = spec_utils.GrammarTree.from_device(t, t, t)
    facts["tree_patched"] = spec_utils.GrammarTree is not orig_tree
    facts["tree_passthrough"] = type(tree) is orig_tree
    return facts


if __name__ == "__main__":
    _compat()
    mode = sys.argv[1]
    out = load_facts() if mode == "load" else refuse_facts()
    print("PROBE-JSON " + json.dumps(out))
