"""The EAGLE3 trainer's shortcut: test-time-training steps >= 1 run only from the shortest prompt's end on.

Why it must hold: those steps' queries over prompt positions predict nothing that counts, so dropping them saves a
third of the work on chat data, but only if every counted prediction is unchanged. A slip (the step-0 keys cut with the
queries, a label window off by one, the softmax split at the wrong column) would train the draft on the wrong targets
and nothing else would notice. Compared against the untrimmed run on random samples of a tiny draft.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("prompt_lens", [(7, 7), (5, 11, 8), (3, 2)])
def test_trimmed_steps_give_the_untrimmed_loss_and_counts(prompt_lens):
    import torch

    from sglang_eo_dev.real_model import eagle3

    torch.manual_seed(sum(prompt_lens))
    cfg = dict(hidden=32, heads=4, kv_heads=2, head_dim=8, inter=64, eps=1e-5, draft_vocab=40, theta=10000.0)
    draft = eagle3._modules(cfg)
    vocab = 60
    embed = torch.randn(vocab, 32)
    t2d = torch.full((vocab,), -100, dtype=torch.long)
    t2d[:40] = torch.arange(40)
    batch = []
    for i, pl in enumerate(prompt_lens):
        n = pl + 6 + 3 * i
        ids = torch.randint(0, vocab, (n,)).tolist()
        batch.append(eagle3.Sample(ids, pl, torch.randn(n - 1, 3 * 32)))
    full, c_full, n_full = eagle3._batch_loss(draft, batch, embed, t2d, cfg, eagle3.TTT_STEPS, trim=False)
    cut, c_cut, n_cut = eagle3._batch_loss(draft, batch, embed, t2d, cfg, eagle3.TTT_STEPS, trim=True)
    assert n_cut == n_full and c_cut == c_full
    assert all(n > 0 for n in n_full)
    assert torch.allclose(cut, full, rtol=1e-5, atol=1e-6)
    # and the gradients the optimiser sees
    g_full = torch.autograd.grad(full, list(draft.parameters()), allow_unused=True)
    cut2, _, _ = eagle3._batch_loss(draft, batch, embed, t2d, cfg, eagle3.TTT_STEPS, trim=True)
    g_cut = torch.autograd.grad(cut2, list(draft.parameters()), allow_unused=True)
    for a, b in zip(g_full, g_cut):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
