"""One behaviour whichever way SGLang reaches the integration -- the plugin's hooks or a patched copy -- checked
against stock SGLang's own behaviour where the plugin decides as SGLang does.

``sglang_eo_dev.probes.decisions`` (its docstring lists the facts) runs SGLang's real entry points in a fresh
interpreter, four times: the installed SGLang with the plugin's hooks, a patched copy, the installed SGLang without
the plugin (stock), and the patched copy switched off (``SGLANG_EAGLE_OVERLAP=0``). On 0.5.16 the verify mask comes
from ``run_eagle_verify`` itself (the hooks' hand-off or the patched call sites), not from the band called directly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_eo_dev.helpers.patched_sglang import patched_sglang_copy, run_probe
from tests.conftest import SGLANG_VERSION

_PATH_INDEPENDENT = {"sglang_file"}
PROBE = ["-m", "sglang_eo_dev.probes.decisions"]

# Where the plugin decides as SGLang does: the facts must equal stock SGLang's, on both paths.
SAME_AS_STOCK = ["terminated_retained", "terminated_fed", "terminated_aborted", "rejected_retained", "rejected_fed",
                 "rejected_aborted", "mask_sha256", "mask_rows", "leftover_cleared", "grammar_set"]
if SGLANG_VERSION == "0.5.16":
    SAME_AS_STOCK += ["has_grammar_in_prepare", "has_grammar_at_sample", "has_grammar_after"]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    root: Path = patched_sglang_copy(tmp_path_factory.mktemp("decisions-patched"), SGLANG_VERSION)
    # Four independent interpreters, two at a time: each spends most of its ~15 s importing SGLang on one core.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(run_probe, [*PROBE, "hook"], SGLANG_EAGLE_OVERLAP=None),
                pool.submit(run_probe, [*PROBE, "patched"], [root], SGLANG_EAGLE_OVERLAP=None),
                pool.submit(run_probe, [*PROBE, "stock"], SGLANG_EAGLE_OVERLAP=None),
                pool.submit(run_probe, [*PROBE, "patched"], [root], SGLANG_EAGLE_OVERLAP="0")]
        hook, patched, stock, switched_off = (r.result() for r in runs)
    assert patched["sglang_file"].startswith(str(root)) and switched_off["sglang_file"].startswith(str(root))
    assert not hook["sglang_file"].startswith(str(root)) and not stock["sglang_file"].startswith(str(root))
    return {"hook": hook, "patched": patched, "stock": stock, "switched_off": switched_off}


def test_stock_sglang_shows_the_rules_the_plugin_follows(facts):
    s = facts["stock"]
    assert s["runtime"] is False and s["counters"] is None, s
    # a terminated grammar keeps the first token of a run and is fed nothing; a rejection keeps the valid prefix
    # and aborts the request
    assert len(s["terminated_retained"]) == 1 and s["terminated_fed"] == [] and not s["terminated_aborted"], s
    assert len(s["rejected_retained"]) == 1 and s["rejected_fed"] == s["rejected_retained"], s
    assert s["rejected_aborted"], s
    assert s["mask_sha256"] is not None and s["leftover_cleared"] and s["grammar_set"], s
    if SGLANG_VERSION == "0.5.16":
        # SGLang builds its own mask, and forces a speculative grammar decode batch out of the overlap
        assert s["upstream_mask_calls"] == 1 and s["overlap_disabled"] is True, s


@pytest.mark.parametrize("path", ["hook", "patched"])
@pytest.mark.parametrize("fact", SAME_AS_STOCK)
def test_each_path_decides_as_stock_sglang(facts, path, fact):
    assert facts[path]["runtime"] is True, facts[path]
    assert facts[path][fact] == facts["stock"][fact], (path, fact, facts[path][fact], facts["stock"][fact])


@pytest.mark.parametrize("path", ["hook", "patched"])
def test_each_path_shows_the_plugins_own_decisions(facts, path):
    f = facts[path]
    assert f["rejected_message_names_request"], f  # the abort names the request
    assert f["cpu_mask_aliases_builder"], f  # on a CPU device: no clone of the builder's buffer
    assert f["finished_only_mask"] is False and f["finished_only_leftover_cleared"], f  # SG#28986
    c = f["counters"]
    assert c["aborts"] == 1 and c["mask_failures"] == 0 and c["fallback_steps"] == 0 and c["ledger_resets"] == 0, c
    if SGLANG_VERSION == "0.5.16":
        assert f["upstream_mask_calls"] == 0, f  # the plugin's native mask replaced SGLang's
        assert f["overlap_disabled"] is False and c["overlap_kept"] == 1, f  # the forced sync is dropped
    else:
        assert f["eagle_tree_limited"] and f["chain_exact"] and f["mask_timeouts"] == 1, f


def test_hook_and_patched_paths_agree(facts):
    hook = {k: v for k, v in facts["hook"].items() if k not in _PATH_INDEPENDENT}
    patched = {k: v for k, v in facts["patched"].items() if k not in _PATH_INDEPENDENT}
    assert hook == patched


def test_the_switch_turns_the_patched_path_into_stock_sglang(facts):
    # SGLANG_EAGLE_OVERLAP=0 on a patched SGLang: every call site falls through to SGLang's own code.
    off = {k: v for k, v in facts["switched_off"].items() if k not in _PATH_INDEPENDENT}
    stock = {k: v for k, v in facts["stock"].items() if k not in _PATH_INDEPENDENT}
    assert off["runtime"] is False and off == stock
