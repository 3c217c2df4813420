"""Logprobs on constrained speculative requests: ``return_logprob`` with ``top_logprobs_num`` on JSON-schema
and regex requests (and an unconstrained one beside them) are the same with the plugin on and off, for every
speculative algorithm, and the returned tokens are non-speculative greedy decoding's. Engines are shared with
``test_algorithms`` through ``algo_runs``.
"""

from __future__ import annotations

import math

import pytest

from .algo_runs import ALGORITHMS, baseline_config, config, run

pytestmark = pytest.mark.engine

TOL = 1e-5


def _close(a, b) -> bool:
    return (math.isinf(a) and math.isinf(b) and a == b) or abs(a - b) <= TOL


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_logprobs_same_with_and_without_plugin(engine_pool, algorithm):
    base = run(engine_pool, baseline_config(algorithm))
    on = run(engine_pool, config(algorithm, plugin=True))
    off = run(engine_pool, config(algorithm, plugin=False))
    for i, (a, b, w) in enumerate(zip(on.outputs["logprobs"], off.outputs["logprobs"], base.outputs["logprobs"])):
        assert a.ids == b.ids == w.ids, f"{algorithm} logprobs[{i}]: {a.text!r} / {b.text!r} / {w.text!r}"
        assert a.logprobs and b.logprobs and len(a.logprobs) == len(b.logprobs), (a, b)
        # Entries name the output tokens, in order (ending with the last one; SGLang decides where they start).
        assert [t for _, t in a.logprobs] == a.ids[len(a.ids) - len(a.logprobs):], (a.logprobs, a.ids)
        for k, ((la, ta), (lb, tb)) in enumerate(zip(a.logprobs, b.logprobs)):
            assert ta == tb and _close(la, lb), f"{algorithm} logprobs[{i}] token {k}: on {la} vs off {lb}"
            assert la <= 0.0
        assert a.top_logprobs is not None and b.top_logprobs is not None
        assert len(a.top_logprobs) == len(b.top_logprobs) == len(a.logprobs)
        for k, (ta, tb) in enumerate(zip(a.top_logprobs, b.top_logprobs)):
            assert len(ta) == 3 and [t for _, t in ta] == [t for _, t in tb], (algorithm, i, k, ta, tb)
            assert all(_close(x, y) for (x, _), (y, _) in zip(ta, tb)), (algorithm, i, k, ta, tb)
