"""One behaviour whichever way SGLang reaches the integration: through the plugin's hooks or through a patched copy.

``sglang_eo_dev.probes.decisions`` observes the decided behaviours (its docstring lists them) through one path, in a
fresh interpreter; this test runs it through both paths of the installed SGLang band and asserts each shows the
decision and that the two paths agree fact for fact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eo_dev.helpers.patched_sglang import patched_sglang_copy, run_probe
from tests.conftest import SGLANG_VERSION

_PATH_INDEPENDENT = {"sglang_file"}


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    root: Path = patched_sglang_copy(tmp_path_factory.mktemp("decisions-patched"), SGLANG_VERSION)
    hook = run_probe(["-m", "sglang_eo_dev.probes.decisions", "hook"], SGLANG_EAGLE_OVERLAP=None)
    patched = run_probe(["-m", "sglang_eo_dev.probes.decisions", "patched"], [root], SGLANG_EAGLE_OVERLAP=None)
    switched_off = run_probe(["-m", "sglang_eo_dev.probes.decisions", "patched"], [root], SGLANG_EAGLE_OVERLAP="0")
    assert patched["sglang_file"].startswith(str(root)) and not hook["sglang_file"].startswith(str(root))
    return {"hook": hook, "patched": patched, "switched_off": switched_off}


@pytest.mark.parametrize("path", ["hook", "patched"])
def test_each_path_shows_the_decisions(facts, path):
    f = facts[path]
    assert f["runtime"], f
    assert f["terminated_retained"] == f["terminated_expected"] and f["terminated_fed_nothing"], f
    assert f["rejected_retained"] == f["rejected_expected"] and f["rejected_message"], f
    assert f["counters"] == f["counters_expected"], f
    assert f["cpu_mask_aliases_builder"], f
    assert f["finished_only_no_mask"] and f["finished_only_leftover_cleared"] and f["grammar_handle_set"], f
    if SGLANG_VERSION == "0.5.23":
        assert f["eagle_tree_limited"] and f["chain_exact"], f


def test_hook_and_patched_paths_agree(facts):
    hook = {k: v for k, v in facts["hook"].items() if k not in _PATH_INDEPENDENT}
    patched = {k: v for k, v in facts["patched"].items() if k not in _PATH_INDEPENDENT}
    assert hook == patched


def test_the_switch_turns_the_patched_path_off_too(facts):
    # SGLANG_EAGLE_OVERLAP=0 on a patched SGLang: every call site falls through to SGLang's own code.
    assert facts["patched"]["runtime"] is True and facts["switched_off"]["runtime"] is False
