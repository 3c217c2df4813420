"""Contract of the SGLang 0.5.23 adapter against the real installed SGLang (CPU only).

One target per hook module: the target exists with the pinned signature, the callers that did ``from X import name``
reach the patched object after ``plugin.load()``, load is idempotent, and a missing target is refused loudly with every
hook left passive. The plugin is loaded in a fresh interpreter (``sglang_eo_dev.probes.contract_v0_5_23``) so this test process's SGLang
stays unpatched.
"""

from __future__ import annotations


import pytest

from sglang_eo_dev.helpers.patched_sglang import run_probe

pytestmark = pytest.mark.sglang_0_5_23



def _run_probe(mode: str) -> dict:
    return run_probe(["-m", "sglang_eo_dev.probes.contract_v0_5_23", mode], SGLANG_EAGLE_OVERLAP=None)


@pytest.fixture(scope="module")
def loaded() -> dict:
    return _run_probe("load")


@pytest.fixture(scope="module")
def refused() -> dict:
    return _run_probe("refuse")


# -- hook_grammar_tree: spec_utils.GrammarTree (class REPLACE) ----------------------------------------------------
def test_grammar_tree_contract(loaded):
    p = loaded["pinned"]
    assert p["GrammarTree.__init__"] == "(self, host, done_event)"
    for ctor in ("from_device", "from_host"):
        assert p[f"GrammarTree.{ctor}"] == "(retrieve_next_token, retrieve_next_sibling, draft_token)"
    assert p["GrammarTree.from_linear_chain"] == "(verify_ids_2d)"
    assert p["GrammarTree.resolve"] == "(self)"
    # run_eagle_verify: copy launched before the verify forward from a view of the verify input's draft tokens,
    # which the mask step may neutralise in place.
    assert p["verify_calls_from_device"] and p["verify_draft_view"]
    assert loaded["targets"]["sglang.srt.speculative.spec_utils.GrammarTree"]
    assert loaded["callers"]["sglang.srt.speculative.eagle_worker_common.GrammarTree"]


# -- hook_build_grammar_vocab_mask: spec_utils.build_grammar_vocab_mask (AROUND) ----------------------------------
def test_build_grammar_vocab_mask_contract(loaded):
    p = loaded["pinned"]
    assert p["build_grammar_vocab_mask"] == "(*reqs, *tree, *sampling_info, *device, *barrier)"
    assert p["verify_calls_mask_with_barrier"]
    assert loaded["targets"]["sglang.srt.speculative.spec_utils.build_grammar_vocab_mask"]
    assert loaded["callers"]["sglang.srt.speculative.eagle_worker_common.build_grammar_vocab_mask"]


# -- hook_advance_grammar_fsm: SchedulerBatchResultProcessor.advance_grammar_fsm (AROUND) -------------------------
def test_advance_grammar_fsm_contract(loaded):
    p = loaded["pinned"]
    assert p["advance_grammar_fsm"] == "(self, result, batch)"
    assert p["barrier_calls_advance"] and p["result_has_grammar_fields"]
    target = ("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
              "advance_grammar_fsm")
    assert loaded["targets"][target]


# -- hook run_eagle_verify: eagle_worker_common.run_eagle_verify (AROUND) ------------------------------------------
def test_run_eagle_verify_contract(loaded):
    p = loaded["pinned"]
    sig = p["run_eagle_verify"]
    assert sig.startswith("(batch, ") and "*grammar_barrier" in sig, sig  # the hook reads both
    assert p["verify_tree_before_forward"] and p["verify_stretch_grammar_free"]
    assert loaded["targets"]["sglang.srt.speculative.eagle_worker_common.run_eagle_verify"]
    # uno_worker_v2 does not import on CPU (importable_callers leaves it out); the two EAGLE workers must be hooked.
    for caller in ("eagle_worker_v2", "multi_layer_eagle_worker_v2"):
        assert loaded["callers"][f"sglang.srt.speculative.{caller}.run_eagle_verify"], caller


# -- hook eagle_sample: eagle_utils.eagle_sample (AROUND), grammar-forced drafts ---------------------------------------
def test_eagle_sample_contract(loaded):
    p = loaded["pinned"]
    assert p["eagle_sample"].startswith("(verify_input, batch, logits_output, grammar_mask"), p["eagle_sample"]
    # the hook takes result[2] as the accepted nodes' flat rows (b * n + node, from retrieve_index)
    assert p["verify_unpacks_accept_index"] and p["sample_accept_index_from_retrieve_index"]
    # run_eagle_verify's entry (where the forced drafts go in) precedes the verify input's preparation from them
    assert p["verify_prepares_after_entry"] and p["prepare_reads_draft_token"]
    assert p["verify_input_fields"]
    assert loaded["targets"]["sglang.srt.speculative.eagle_utils.eagle_sample"]
    assert loaded["callers"]["sglang.srt.speculative.eagle_worker_common.eagle_sample"]


# -- hook dispatch_json: XGrammarGrammarBackend.dispatch_json (AROUND), maxLength strings as patterns ------------------
def test_dispatch_json_contract(loaded):
    p = loaded["pinned"]
    assert p["dispatch_json"] == "(self, key_string)"
    # SGLang's cache is keyed above the hook by the request's text; a miss calls dispatch_json with that text, which
    # compiles exactly its argument and returns InvalidGrammarObject for what it cannot compile
    assert p["cache_keyed_by_request_text"] and p["cache_miss_dispatches_json"]
    assert p["dispatch_compiles_its_argument"]
    assert loaded["targets"]["sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json"]


def test_overlap_stays_on_for_eagle3_grammar_batches(loaded):
    # 0.5.23 keeps grammar decode batches overlapped for EAGLE/EAGLE3 on its own; the adapter relies on it.
    assert loaded["pinned"]["eagle3_grammar_overlap"] is True


def test_load_activates_all_hooks_and_is_idempotent(loaded):
    assert loaded["active"] is True
    assert loaded["missing"] == []
    assert loaded["callers_checked"] >= 3 and all(loaded["callers"].values()), loaded["callers"]
    assert loaded["idempotent"] is True


def test_missing_target_is_refused_and_hooks_stay_passive(refused):
    assert refused["raised"] and "build_grammar_vocab_mask" in refused["raised"] and "0.5.23" in refused["raised"]
    assert "SGLANG_EAGLE_OVERLAP=0" in refused["raised"]
    assert refused["active"] is False
    assert refused["tree_patched"] is True  # that hook landed ...
    assert refused["tree_passthrough"] is True  # ... but passes through to SGLang's own class
