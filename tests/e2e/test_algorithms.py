"""Every speculative algorithm SGLang runs with the overlap scheduler: what the plugin does with its grammar batches,
checked against the support table in ``sglang_eagle_overlap/support.py`` on the real engine.

Per algorithm (EAGLE with an EAGLE-2 draft, NEXTN with a MiMo MTP layer, STANDALONE with a small Llama draft, NGRAM),
with the plugin on and off (``SGLANG_EAGLE_OVERLAP=0``): greedy output token-identical to non-speculative greedy
decoding of the same target for every case of ``algo_runs.CASES`` (JSON schema, regex, EBNF, structural tag,
reasoning-then-JSON, logprobs; single and mixed batches), and the scheduler's overlap decisions for grammar decode
batches (the CPU runtime's counters) as the table says:

* ``keep``: with the plugin no grammar decode batch leaves the overlap, and the plugin's mask step ran (its stats);
  without it 0.5.16 forces every one out and 0.5.23 keeps them in (its own grammar overlap);
* ``mask-only`` (0.5.23 NGRAM): SGLang syncs every NGRAM grammar decode batch in both states; the plugin's mask ran;
* ``stand-aside`` (0.5.16 NGRAM): SGLang syncs every one in both states; the plugin built no mask and said once that
  it stands aside.

EAGLE3 has the same checks in ``test_plugin_equivalence.py``. Engine starts: 2 baselines + 4 algorithms x on/off.
"""

from __future__ import annotations

import os

import pytest

from sglang_eagle_overlap import support
from sglang_eagle_overlap.settings import FORCED_DRAFTS_AUTO_ALGORITHMS

from .algo_runs import ALGORITHMS, CASES, baseline_config, band, config, run

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_matches_support_table(engine_pool, sglang_version, algorithm):
    entry = support.cell(band(sglang_version), algorithm)
    assert entry is not None, f"support table has no {algorithm} row for SGLang {band(sglang_version)}"
    assert entry.tested_by == "tests/e2e/test_algorithms.py"
    base = run(engine_pool, baseline_config(algorithm))
    on = run(engine_pool, config(algorithm, plugin=True))
    off = run(engine_pool, config(algorithm, plugin=False))

    # Token identity with non-speculative greedy decoding, plugin on and off, every case.
    for name in CASES:
        for i, (want, got_on, got_off) in enumerate(zip(base.outputs[name], on.outputs[name], off.outputs[name])):
            assert got_on.ids == want.ids, f"{algorithm} {name}[{i}] plugin on: {got_on.text!r} != {want.text!r}"
            assert got_off.ids == want.ids, f"{algorithm} {name}[{i}] plugin off: {got_off.text!r} != {want.text!r}"
            assert got_on.finish_reason == want.finish_reason, (algorithm, name, i)
    # Speculation really ran: verify steps were counted, and the model-drafting algorithms accepted several drafts per
    # step (NGRAM drafts from its n-gram trie, whose hits depend on what it has seen: only require it ran).
    free = on.outputs["mixed_kinds"][-1]
    assert free.verify_ct > 0, f"{algorithm}: no verify step recorded ({free})"
    if algorithm != "NGRAM":
        assert free.completion_tokens / free.verify_ct >= 2.0, f"{algorithm}: accept length below 2 ({free})"

    for r in (on, off):
        assert r.runtime.get("runtime_errors") == [], r.runtime
        assert r.runtime.get("overlap_enabled") is True, r.runtime
        assert r.runtime.get("grammar_decode_batches", 0) > 0, r.runtime
    total_on = on.runtime["grammar_decode_batches"]
    total_off = off.runtime["grammar_decode_batches"]
    synced_on = on.runtime["overlap_disabled_grammar_decode_batches"]
    synced_off = off.runtime["overlap_disabled_grammar_decode_batches"]
    assert off.plugin_stats is None, f"plugin off (SGLANG_EAGLE_OVERLAP=0) but it wrote stats: {off.plugin_stats}"
    stats = on.plugin_stats
    assert stats is not None and stats["active"] is True and stats["pid"] != os.getpid(), stats
    assert stats["aborts"] == 0 and stats["ledger_resets"] == 0 and stats["mask_failures"] == 0, stats

    if entry.decision == "keep":
        assert synced_on == 0, f"{algorithm}: {synced_on}/{total_on} grammar decode batches left the overlap"
        assert stats["steps"] > 0 and stats["tokens_advanced"] > 0, stats
        # forced drafts unset ("auto"): decided at the first verify by the algorithm's resolved name (settings.py)
        assert stats["forced_drafts"] is (support.resolve(algorithm) in FORCED_DRAFTS_AUTO_ALGORITHMS), stats
        if band(sglang_version) == "0.5.16":
            assert synced_off == total_off, f"stock 0.5.16 {algorithm}: {synced_off}/{total_off} synced"
            assert stats["overlap_kept"] > 0, stats
        else:
            assert synced_off == 0, f"stock 0.5.23 {algorithm}: {synced_off}/{total_off} synced"
    elif entry.decision == "mask-only":
        assert synced_on == total_on and synced_off == total_off, (on.runtime, off.runtime)
        assert stats["steps"] > 0 and stats["tokens_advanced"] > 0, stats
    else:
        assert entry.decision == "stand-aside", entry
        assert synced_on == total_on and synced_off == total_off, (on.runtime, off.runtime)
        assert stats.get("steps", 0) == 0 and stats.get("tokens_advanced", 0) == 0, stats
        assert stats.get("stand_aside_algorithms") == 1, stats  # logged once, counted once

