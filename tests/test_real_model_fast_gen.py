"""The lean decoder that makes the chat-trained draft's data writes what transformers' loop writes.

Why it matters: the draft is trained to predict the target's own greedy answers from the target's own features; a
decoder that drifted (a RoPE offset under left padding, a pad slot leaking into attention, a feature taken from the
wrong layer) would train the draft on answers the engine never writes, and its accept length would fall without any
error. Three prompts of different lengths (so left padding is exercised), a short answer each.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def target_dir():
    from sglang_eo_dev.real_model.target import build_target

    return build_target()


def test_lean_decoder_matches_transformers_tokens_and_features(target_dir):
    import torch
    from transformers import AutoTokenizer

    from sglang_eo_dev.real_model import data, fast_gen
    from sglang_eo_dev.real_model.prompts import Request

    reqs = [Request("Write a Python function that adds two numbers."),
            Request("Why is the sky blue? Explain it to a child in a few short sentences, please."),
            Request("Hi!")]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    rendered = [data._render(tok, r) for r in reqs]
    assert len({len(p) for p in rendered}) == 3  # left padding differs per row
    want = data.generate(target_dir, reqs, 24, batch_size=3)
    got = fast_gen.generate_free(target_dir, rendered, 24)
    for w, g in zip(want, got):
        assert g.ids == w.ids
        assert g.prompt_len == w.prompt_len
        assert g.feats.shape == w.feats.shape == (len(w.ids) - 1, 3 * 576)
        assert torch.allclose(g.feats, w.feats, atol=1e-3, rtol=1e-3)
