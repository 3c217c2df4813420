"""The forced drafts' batch encoder (``integration.drafts.batch_encoder``): the requests' Hugging Face fast tokenizer
tokenizes many strings per call through its Rust backend, with exactly ``encode``'s tokens, or it is not used."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, List

import pytest

from sglang_eagle_overlap.integration.drafts import batch_encoder
from sglang_eo_dev.helpers import grammars as G


def _texts() -> List[str]:
    """Forced-text-like strings: every prefix and suffix of valid JSON / EBNF documents, plus spaces and non-ASCII."""
    rng = random.Random(0)
    out = [" ", "  ", "\n", "é", "–", '"', '":"', '","', "\t{"]
    for make in (G.nested_doc_text, G.pattern_doc_text, G.ebnf_doc_text):
        doc = make(rng)
        out += [doc[:i] for i in range(1, min(len(doc), 60))] + [doc[i:] for i in range(0, len(doc), 7)]
    return out


def _tokenizer(which: str) -> Any:
    from sglang_eo_dev.helpers.tokenizers import hf_tokenizer

    if which == "smollm2":
        from transformers import AutoTokenizer

        from sglang_eo_dev.real_model.target import build_target

        return AutoTokenizer.from_pretrained(str(build_target()))
    return hf_tokenizer(int(which.split("-")[1][:-1]) * 1000)


@pytest.mark.parametrize("which", ["bpe-32k", "bpe-128k", "smollm2"])
def test_batch_encoder_matches_encode_string_by_string(which):
    tok = _tokenizer(which)
    batch = batch_encoder(tok)
    assert batch is not None  # every tokenizer the project serves with is a fast one
    texts = _texts()
    assert batch(texts) == [list(tok.encode(t, add_special_tokens=False)) for t in texts]


def test_no_batch_encoder_without_a_backend_or_when_it_disagrees():
    plain = SimpleNamespace(encode=lambda s, add_special_tokens=False: [len(s)])
    assert batch_encoder(plain) is None

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    agreeing = SimpleNamespace(encode=lambda s, add_special_tokens=False: [len(s)],
                               backend_tokenizer=SimpleNamespace(
                                   encode_batch=lambda ts, add_special_tokens=False: [Enc([len(t)]) for t in ts]))
    assert batch_encoder(agreeing)(["ab", "c"]) == [[2], [1]]
    wrong = SimpleNamespace(encode=agreeing.encode,
                            backend_tokenizer=SimpleNamespace(
                                encode_batch=lambda ts, add_special_tokens=False: [Enc([len(t) + 1]) for t in ts]))
    assert batch_encoder(wrong) is None

    def boom(ts, add_special_tokens=False):
        raise TypeError("other signature")

    raising = SimpleNamespace(encode=agreeing.encode, backend_tokenizer=SimpleNamespace(encode_batch=boom))
    assert batch_encoder(raising) is None
