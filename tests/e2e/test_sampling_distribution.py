"""Speculative sampling under a grammar keeps the target's output law: EAGLE3 with the plugin (grammar-forced drafts
off and on) samples the same distribution as non-speculative decoding, and a deliberately biased verifier does not.

Setup (the real engine on CPU, one band per run):

* the soft follower pair (:mod:`sglang_eo_dev.cpu_runtime.soft_pair`): a context-free target whose successor logit is
  :data:`LOGIT`, and an EAGLE3 draft that proposes that successor -- drafts the grammar allows and the target likes,
  so drafts are accepted, several per verify, at real choice points;
* the prompt is the follower document up to ``Green``; the grammar, :data:`REGEX`, allows 8 strings, one of them the
  document's own continuation (`` river under bright``, the draft's chain), each reachable by several tokenizations;
* temperature 1; SGLang's sampling verify, which SGLang runs on GPUs only (on CPU it verifies greedily whatever the
  temperature), taken on CPU with the ``sgl_kernel`` stand-in's port of the sampling kernel
  (:mod:`sglang_eo_dev.cpu_runtime.spec_sampling`, ``SGLANG_EO_SPEC_SAMPLING=1``);
* :data:`N` samples from each of: non-speculative decoding (the reference), EAGLE3 topk 1 + plugin with forced drafts
  off, the same with forced drafts on, and the biased verifier (requests marked ``eo-biased-verify`` in the forced-off
  engine: the grammar mask multiplies the target's probabilities without renormalising them in the accept test, so
  allowed drafts are accepted with the unconstrained probability).

The statistic: Pearson's chi-square test of homogeneity between the reference counts and a variant's counts over the
output strings (strings whose pooled expected count is under :data:`MIN_EXPECTED` are pooled into one cell). Each
comparison rejects at :data:`ALPHA` = 2e-5, so a correct plugin fails either of its two comparisons by chance with
probability < 4e-5 (the chi-square approximation with every expected count >= 10). The biased verifier's shift
(total variation 0.53-0.54 measured on both bands, chi-square 170-245 on 4 degrees of freedom) puts the noncentrality
above 100 at N = 300, where a 2e-5 test misses it with probability < 1e-6. Sampling on the CPU engine is not seeded
per request (SGLang seeds requests only under deterministic inference, which refuses the CPU attention backend), so
runs differ; the bounds above are per run.
"""

from __future__ import annotations

import collections
import re
import time
from typing import Any

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair
from sglang_eo_dev.cpu_runtime.soft_pair import SOFT_LOGIT as LOGIT  # the target's successor logit
from sglang_eo_dev.cpu_runtime.spec_sampling import BIAS_MARKER, ENV_FLAG

pytestmark = pytest.mark.engine

REGEX = r"( river| lake)( under| over)( bright| dark)"
N = 300  # samples per variant
ALPHA = 2e-5  # per comparison
MIN_EXPECTED = 10.0
PARAMS = {"temperature": 1.0, "max_new_tokens": 24, "regex": REGEX}


def _cfg(spec: bool, forced: bool | None = None) -> EngineConfig:
    return EngineConfig(pair="soft-follower", spec="topk1" if spec else None, product_plugin=spec,
                        forced_drafts=forced, max_running_requests=32)


# engine -> (its configuration, {variant it samples: rid prefix}); the biased verifier runs in the forced-off engine
ENGINES: dict[str, tuple[EngineConfig, dict[str, str]]] = {
    "nonspec": (_cfg(False), {"nonspec": "ref"}),
    "forced-off": (_cfg(True, False), {"forced-off": "plugin", "biased": BIAS_MARKER}),
    "forced-on": (_cfg(True, True), {"forced-on": "plugin"}),
}


def _chi_square(ref: collections.Counter, got: collections.Counter) -> tuple[float, int, float]:
    """Pearson's homogeneity test of two count tables, rare strings pooled: (statistic, degrees of freedom, p-value)."""
    from scipy.stats import chi2_contingency

    n_ref, n_got = sum(ref.values()), sum(got.values())
    total = n_ref + n_got
    cells: dict[str, tuple[int, int]] = {}
    rare = [0, 0]
    for key in set(ref) | set(got):
        pooled = ref[key] + got[key]
        if min(pooled * n_ref, pooled * n_got) / total < MIN_EXPECTED:
            rare[0] += ref[key]
            rare[1] += got[key]
        else:
            cells[key] = (ref[key], got[key])
    if sum(rare):
        cells["<rare>"] = (rare[0], rare[1])
    if len(cells) < 2:
        return 0.0, 0, 1.0  # one cell: nothing to compare
    test = chi2_contingency(list(zip(*cells.values())), correction=False)  # a 2 x cells table, no Yates correction
    return float(test.statistic), int(test.dof), float(test.pvalue)


def _tv(ref: collections.Counter, got: collections.Counter) -> float:
    n_ref, n_got = sum(ref.values()), sum(got.values())
    return 0.5 * sum(abs(ref[k] / n_ref - got[k] / n_got) for k in set(ref) | set(got))


@pytest.fixture(scope="module")
def samples(engine_pool) -> dict[str, Any]:
    """Counts of output strings per variant, plus what each engine's runtime counted."""
    prompt = list(model_pair(ENGINES["nonspec"][0]).chain[:5])  # {"title": "Green  (the document up to the choice)
    out: dict[str, Any] = {"counts": {}, "outputs": {}, "stats": {}, "plugin_stats": {}, "seconds": {}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_FLAG, "1")  # read by each engine's scheduler when it starts
        for name, (cfg, variants) in ENGINES.items():
            t0 = time.monotonic()
            engine, read_plugin_stats = engine_pool.get_with_plugin_stats(cfg, "sampling")
            for variant, rid in variants.items():
                outs = engine.generate(input_ids=[prompt] * N, sampling_params=PARAMS,
                                       rid=[f"{rid}-{variant}-{i}" for i in range(N)])
                out["outputs"][variant] = outs
                out["counts"][variant] = collections.Counter(o["text"] for o in outs)
            out["stats"][name] = engine_pool.stats()
            out["plugin_stats"][name] = read_plugin_stats()
            out["seconds"][name] = time.monotonic() - t0
        engine_pool.close()  # its scheduler took the sampling verify: no later module may share it
    for variant, counts in out["counts"].items():
        stat, df, p = _chi_square(out["counts"]["nonspec"], counts)
        print(f"\n[sampling] {variant}: TV {_tv(out['counts']['nonspec'], counts):.3f} chi2 {stat:.1f} df {df} "
              f"p {p:.2e} counts {dict(counts.most_common())}")
    print(f"[sampling] seconds per engine (start + sampling): {out['seconds']}")
    return out


def test_every_output_is_valid_and_drafts_were_accepted(samples):
    for variant, outs in samples["outputs"].items():
        assert len(outs) == N, variant
        for o in outs:
            assert o["meta_info"]["finish_reason"]["type"] == "stop", (variant, o["meta_info"])
            assert re.fullmatch(REGEX, o["text"]), (variant, o["text"])
    for variant in ("forced-off", "forced-on"):
        outs = samples["outputs"][variant]
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        verifies = sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outs)
        # more tokens than verify steps: drafts were accepted, so the verifier's accept test decided outputs
        assert verifies and tokens > 1.2 * verifies, (variant, tokens, verifies)


def test_speculative_engines_took_the_sampling_verify(samples):
    for name in ("forced-off", "forced-on"):
        stats = samples["stats"][name]
        assert stats.get("runtime_errors") == [], stats
        assert stats.get("sampling_verify_calls", 0) > 0, stats
    assert samples["stats"]["forced-off"].get("biased_verify_rows", 0) > 0
    assert samples["stats"]["forced-on"].get("biased_verify_rows", 0) == 0  # only marked requests are biased


def test_forced_drafts_replaced_drafts_only_when_on(samples):
    on, off = samples["plugin_stats"]["forced-on"], samples["plugin_stats"]["forced-off"]
    assert on and off, samples["plugin_stats"]
    assert on["forced_changed"] > 0 and on["forced_accepted"] > 0, on
    assert off["forced_proposed"] == 0, off


@pytest.mark.parametrize("variant", ["forced-off", "forced-on"])
def test_plugin_samples_the_nonspeculative_distribution(samples, variant):
    ref, got = samples["counts"]["nonspec"], samples["counts"][variant]
    stat, df, p = _chi_square(ref, got)
    assert p >= ALPHA, (f"{variant}: output law differs from non-speculative sampling (chi2 {stat:.1f}, df {df}, "
                        f"p {p:.2e}, TV {_tv(ref, got):.3f})", dict(ref), dict(got))


def test_biased_verifier_fails_the_same_test(samples):
    ref, got = samples["counts"]["nonspec"], samples["counts"]["biased"]
    stat, df, p = _chi_square(ref, got)
    assert p < ALPHA, (f"the biased verifier passed (chi2 {stat:.1f}, df {df}, p {p:.2e}, TV {_tv(ref, got):.3f}): "
                       "the test cannot tell a biased verifier from a correct one", dict(ref), dict(got))
