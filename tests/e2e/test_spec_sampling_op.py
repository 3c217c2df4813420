"""The ``sgl_kernel`` stand-in's sampling verify op samples the target's law, whatever the drafts (no engine).

Tree (node: draft token), target distributions over a 5-token vocabulary per node::

    0:root ── 1:a ── 3:c
      └────── 2:b

``M`` rows, each the same tree with its own coins (a seeded generator: the result is fixed). The first token (the
accepted child of the root, or the bonus token drawn from what the rejected children leave) must follow
``P[0]``; the token after an accepted ``a`` must follow ``P[1]``. The biased accept test of
:mod:`sglang_eo_dev.cpu_runtime.spec_sampling` (the mask applied to probabilities without renormalising them) run
through the same walk must fail the same test.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sgl_kernel") is None or importlib.util.find_spec("scipy") is None,
    reason="needs the CPU test runtime's sgl_kernel stand-in and scipy",
)

M = 10000
A, B, C = 1, 2, 3
P = [
    [0.10, 0.35, 0.30, 0.25, 0.00],  # after the root: a and b are drafts, 0 and 3 only reachable as the bonus token
    [0.00, 0.10, 0.20, 0.60, 0.10],  # after a: c is the draft
    [0.20, 0.20, 0.20, 0.20, 0.20],
    [0.50, 0.00, 0.00, 0.00, 0.50],
]
ALPHA = 1e-6


def _walk(accept_scale: float | None = None):
    import torch
    from sgl_kernel import tree_speculative_sampling_target_only
    from sgl_kernel._spec_ops import _tree_sampling

    gen = torch.Generator().manual_seed(1234)
    D, S = 4, 3
    probs = torch.tensor(P).expand(M, D, 5).contiguous()
    candidates = torch.tensor([[0, A, B, C]]).expand(M, D).contiguous()
    r_index = torch.arange(M * D).reshape(M, D)
    r_next = torch.tensor([[1, 3, -1, -1]]).expand(M, D).contiguous()
    r_sib = torch.tensor([[-1, 2, -1, -1]]).expand(M, D).contiguous()
    coins = torch.rand((M, D), generator=gen)
    final = torch.rand((M,), generator=gen)
    predicts = torch.zeros(M * D, dtype=torch.int32)
    accept_index = torch.full((M, S), -1, dtype=torch.int32)
    num = torch.zeros(M, dtype=torch.int32)
    draft_probs = torch.zeros_like(probs)
    kw = dict(predicts=predicts, accept_index=accept_index, accept_token_num=num, candidates=candidates,
              retrive_index=r_index, retrive_next_token=r_next, retrive_next_sibling=r_sib, uniform_samples=coins,
              uniform_samples_for_final_sampling=final, target_probs=probs, draft_probs=draft_probs)
    if accept_scale is None:
        tree_speculative_sampling_target_only(**kw)
    else:
        _tree_sampling(**kw, threshold_single=1.0, threshold_acc=1.0, accept_probs=probs * accept_scale,
                       resample_empty_residual=True)
    first = predicts.view(M, D)[:, 0]
    after_a = predicts.view(M, D)[:, 1][accept_index[:, 1] % D == 1]
    return first, after_a, num


def _p_value(tokens, law) -> float:
    import torch
    from scipy.stats import chisquare

    counts = torch.bincount(tokens.to(torch.int64), minlength=5).tolist()
    keep = [i for i, p in enumerate(law) if p > 0]
    assert all(counts[i] == 0 for i, p in enumerate(law) if p == 0), (counts, law)  # never a zero-probability token
    n = sum(counts)
    return float(chisquare([counts[i] for i in keep], [n * law[i] for i in keep]).pvalue)


def test_sampling_op_follows_the_target_law():
    first, after_a, num = _walk()
    assert _p_value(first, P[0]) >= ALPHA
    assert after_a.numel() > 1000 and _p_value(after_a, P[1]) >= ALPHA
    assert int(num.max()) == 2  # the walk reached depth 2 (a then c accepted) in some rows


def test_biased_accept_test_fails_the_same_check():
    first, _, _ = _walk(accept_scale=0.3)
    assert _p_value(first, P[0]) < ALPHA


def test_top_k_and_top_p_renorm_keep_the_right_tokens():
    """The renorm ops 0.5.16's sampling verify applies to a request's ``top_k`` / ``top_p`` (hand-worked rows)."""
    import torch
    from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob

    probs = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1], [0.5, 0.25, 0.125, 0.125, 0.0]])
    # top_k 2: row 0 keeps 0.4 and both 0.2 (a tie at the k-th value is kept); row 1 (k 0 = off) is unchanged
    got = top_k_renorm_prob(probs, torch.tensor([2, 0]))
    assert torch.allclose(got, torch.tensor([[0.0, 0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.125, 0.125, 0.0]]))
    # top_p 0.6: row 0 needs 0.4 + 0.2 (the first 0.2 in sorted order); row 1 reaches 0.6 with 0.5 + 0.25
    got = top_p_renorm_prob(probs, torch.tensor([0.6, 0.6]))
    assert sorted(torch.nonzero(got[0]).flatten().tolist()) in ([1, 2], [1, 3]) and abs(float(got[0].sum()) - 1) < 1e-6
    assert torch.allclose(got[0][1], torch.tensor(0.4 / 0.6))
    assert torch.allclose(got[1], torch.tensor([2 / 3, 1 / 3, 0.0, 0.0, 0.0]))
    assert torch.equal(top_p_renorm_prob(probs, 1.0), probs / probs.sum(dim=-1, keepdim=True))  # p 1: unchanged
