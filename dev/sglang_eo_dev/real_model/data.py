"""The draft's training data: the target's own greedy answers with its EAGLE3 auxiliary hidden states (CPU, cached).

Call order: :func:`samples` (returns one :class:`~.eagle3.Sample` per request, generating only the requests not yet
in the cache). Each request's result is cached as its own file under ``cache_root()/eagle3-data/``, keyed by the
request, the target folder and :data:`GEN_VERSION` (bump it when the generation changes), so editing the training
code never regenerates, and a smaller prompt set reuses the larger one's results.

Requests with a schema are decoded under it with xgrammar (``any_whitespace=False``, as the engine compiles it) by
transformers (:func:`generate`); the rest freely by the lean decoder of :mod:`.fast_gen` (the same tokens, several
times faster); both greedy until eos or ``max_new_tokens``. Requests are batched by schema family (similar lengths),
free ones by length.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sglang_eo_dev.real_model.eagle3 import AUX_LAYER_IDS, Sample, log
from sglang_eo_dev.real_model.target import cache_root

__all__ = ["GEN_VERSION", "samples", "generate"]

GEN_VERSION = 1


def _file(target_dir: Path, req, max_new_tokens: int) -> Path:
    key = json.dumps([GEN_VERSION, target_dir.name, req.user, req.schema, max_new_tokens, AUX_LAYER_IDS])
    return cache_root() / "eagle3-data" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".pt")


def samples(target_dir: Path, requests: list, max_new_tokens: int, batch_size: int = 16) -> list[Sample]:
    """The samples of ``requests`` in order, generating the missing ones."""
    import os

    import torch

    missing = [r for r in requests if not _file(target_dir, r, max_new_tokens).exists()]
    # schema requests by family (similar lengths), then free ones by length (less padding)
    missing.sort(key=lambda r: (r.schema or "~", len(r.user) if r.schema is None else 0, r.user))
    tok = None
    if missing:
        from transformers import AutoTokenizer

        log(f"generating {len(missing)} of {len(requests)} training answers with the target")
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    for start in range(0, len(missing), batch_size):
        batch = missing[start:start + batch_size]
        if any(r.schema for r in batch):
            made = generate(target_dir, batch, max_new_tokens)
        else:  # free answers: the lean decoder (same tokens, several times faster)
            from sglang_eo_dev.real_model.fast_gen import generate_free

            made = generate_free(target_dir, [_render(tok, r) for r in batch], max_new_tokens)
        for r, s in zip(batch, made):
            f = _file(target_dir, r, max_new_tokens)
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp = f.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"ids": s.ids, "prompt_len": s.prompt_len, "feats": s.feats.to(torch.float16)}, tmp)
            os.replace(tmp, f)
        log(f"generated {min(start + batch_size, len(missing))}/{len(missing)}")
    out = []
    for r in requests:
        d = torch.load(_file(target_dir, r, max_new_tokens))
        out.append(Sample(d["ids"], d["prompt_len"], d["feats"].float()))
    return out


def _render(tok, req) -> list[int]:
    from sglang_eo_dev.real_model.prompts import messages

    ids = tok.apply_chat_template(messages(req), tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def generate(target_dir: Path, requests: list, max_new_tokens: int, batch_size: int = 16) -> list[Sample]:
    """Greedy answers of the target (constrained by each request's schema, xgrammar ``any_whitespace=False`` as the
    engine runs it), with features ``hidden_states[id + 1]`` for ``id`` in :data:`AUX_LAYER_IDS`."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    eos = int(model.config.eos_token_id)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    layers = [i + 1 for i in AUX_LAYER_IDS]
    samples: list[Sample] = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        prompts = [_render(tok, r) for r in batch]
        matchers = [xgr.GrammarMatcher(compiler.compile_json_schema(r.schema_json(), any_whitespace=False))
                    if r.schema else None for r in batch]
        B, P = len(batch), max(map(len, prompts))
        ids = torch.full((B, P), eos, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, P - len(p):] = torch.tensor(p)
            mask[b, P - len(p):] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        feats: list[list] = [[] for _ in range(B)]
        gen: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        bitmask = xgr.allocate_token_bitmask(B, vocab)
        cache, step_ids, step_pos = None, ids, pos
        with torch.no_grad():
            for step in range(max_new_tokens):
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                            use_cache=True, output_hidden_states=True, logits_to_keep=1)
                cache = out.past_key_values
                f = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
                logits = out.logits[:, -1, :].float()
                for b in range(B):
                    if done[b]:
                        continue
                    rows = f[b, P - len(prompts[b]):] if step == 0 else f[b, -1:]
                    feats[b].append(rows.clone())
                    if matchers[b] is not None:
                        matchers[b].fill_next_token_bitmask(bitmask, b)
                        xgr.apply_token_bitmask_inplace(logits[b:b + 1], bitmask[b:b + 1].clone())
                    t = int(logits[b].argmax())
                    gen[b].append(t)
                    if matchers[b] is not None:
                        if not matchers[b].accept_token(t):
                            raise RuntimeError(f"grammar refused its own argmax {t}")
                        done[b] = matchers[b].is_terminated() or t == eos
                    else:
                        done[b] = t == eos
                if all(done):
                    break
                nxt = torch.tensor([g[-1] for g in gen], dtype=torch.long).unsqueeze(1)
                step_pos = step_pos[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
                step_ids = nxt
        for b in range(B):
            full = prompts[b] + gen[b]
            fb = torch.cat(feats[b], dim=0)[: len(full) - 1]
            samples.append(Sample(full, len(prompts[b]), fb))
    return samples
