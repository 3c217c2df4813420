"""Train an EAGLE3 draft head for the real target on CPU, in SGLang's ``LlamaForCausalLMEagle3`` format.

Call order: :func:`sglang_eo_dev.real_model.data.samples` (the target's greedy answers to the training prompts,
JSON-schema constrained with xgrammar where the prompt has a schema, with its auxiliary hidden states) -> :func:`train`
-> :func:`save_draft`. :func:`sglang_eo_dev.real_model.build.build_eagle3` runs them and caches the result.

Format (read from SGLang's ``models/llama_eagle3.py``, the same on 0.5.16 and 0.5.23): one decoder layer
(``midlayer.*``) whose q/k/v take ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (2H inputs); ``fc`` maps the
3 concatenated auxiliary hidden states (3H) to H; ``norm`` then ``lm_head`` over a reduced draft vocabulary; ``d2t``
(draft id -> target id offset) and ``t2d`` (target-id mask). The token embedding is the target's (SGLang shares it).
``eagle_config.eagle_aux_hidden_state_layer_ids`` = :data:`AUX_LAYER_IDS`: SGLang captures the residual stream
entering layer ``id + 1``, which is transformers' ``hidden_states[id + 1]``.

The draft runs on its own outputs: step 0 reads the target's features, each later step the pre-norm output
(``mlp + residual``) of the previous one. Training unrolls :data:`TTT_STEPS` steps (test-time training): step k at
position i feeds token ``x[i+1+k]`` and attends to step 0's keys at positions <= i plus its own earlier steps' keys
at position i, which is what the draft's KV cache holds during a speculative chain.

Invariants: fixed seeds (torch, data order); CPU only; float32; the loss counts only predictions of generated tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["AUX_LAYER_IDS", "DRAFT_VOCAB", "TTT_STEPS", "Sample", "hot_tokens", "save_draft", "target_geometry",
           "train"]

AUX_LAYER_IDS = [1, 14, 26]  # 30-layer target: features entering layers 2, 15, 27
DRAFT_VOCAB = 8192
TTT_STEPS = 3


def log(msg: str) -> None:
    import sys

    print(f"[real-model] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Sample:
    """One training sequence: token ids (prompt + generated), prompt length, features [len(ids) - 1, 3H]."""

    ids: list[int]
    prompt_len: int
    feats: Any  # torch.Tensor, float32; row t = aux states at position t (t < len(ids) - 1)


# --- the draft -----------------------------------------------------------------------------------------------------


def _modules(cfg: dict):
    import torch
    from torch import nn

    H, nh, nkv, hd, inter = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["inter"]

    class RMSNorm(nn.Module):
        def __init__(self, n: int, eps: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class Draft(nn.Module):
        """One EAGLE3 step: ``forward(embeds, hidden, cos, sin, past, mask)`` -> (pre-norm output, (k, v));
        ``logits(out)`` applies the final norm and the draft head (only where a loss is counted)."""

        def __init__(self) -> None:
            super().__init__()
            eps = cfg["eps"]
            self.fc = nn.Linear(3 * H, H, bias=False)
            self.hidden_norm, self.input_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
            self.post_attention_layernorm, self.norm = RMSNorm(H, eps), RMSNorm(H, eps)
            self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
            self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
            self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, H, bias=False)
            self.gate_proj = nn.Linear(H, inter, bias=False)
            self.up_proj = nn.Linear(H, inter, bias=False)
            self.down_proj = nn.Linear(inter, H, bias=False)
            self.lm_head = nn.Linear(H, cfg["draft_vocab"], bias=False)

        def forward(self, embeds, hidden, cos, sin, past: list, causal_mask):
            B, T, _ = embeds.shape
            residual = hidden
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
            q = _rope(self.q_proj(x).view(B, T, nh, hd), cos, sin).transpose(1, 2)  # B nh T hd
            k = _rope(self.k_proj(x).view(B, T, nkv, hd), cos, sin).transpose(1, 2)
            v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
            rep = nh // nkv
            if not past:  # step 0: causal attention over the sequence
                kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                scores = [(q @ kk.transpose(-1, -2)) / math.sqrt(hd) + causal_mask]
                values = [vv]
            else:  # step k: step 0's keys at positions <= i, then each later step's key at position i
                k0, v0 = past[0]
                kk, vv = k0.repeat_interleave(rep, 1), v0.repeat_interleave(rep, 1)
                scores = [(q @ kk.transpose(-1, -2)) / math.sqrt(hd) + causal_mask]
                values = [vv]
                for kj, vj in past[1:] + [(k, v)]:
                    scores.append(((q * kj.repeat_interleave(rep, 1)).sum(-1, keepdim=True)) / math.sqrt(hd))
                    values.append(vj.repeat_interleave(rep, 1))
            if len(scores) == 1:
                attn = torch.softmax(scores[0], dim=-1) @ values[0]
            else:
                p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
                n0 = values[0].shape[2]  # step 0's keys: every position (the queries may be a suffix of them)
                attn = p[..., :n0] @ values[0]
                for j, vj in enumerate(values[1:]):
                    attn = attn + p[..., n0 + j:n0 + j + 1] * vj
            a = self.o_proj(attn.transpose(1, 2).reshape(B, T, nh * hd))
            residual = a + residual
            h = self.post_attention_layernorm(residual)
            h = self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
            out = h + residual
            return out, (k, v)

        def logits(self, out):
            return self.lm_head(self.norm(out))

    return Draft()


def _rope(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _rope_tables(positions, hd: int, theta: float):
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = positions.float().unsqueeze(-1) * inv  # B T hd/2
    ang = torch.cat([ang, ang], dim=-1).unsqueeze(2)  # B T 1 hd
    return ang.cos(), ang.sin()


def target_geometry(target_dir: Path) -> dict[str, Any]:
    """The target's layer shapes from its ``config.json``: hidden, heads, kv_heads, head_dim, inter, eps, theta
    (the draft's decoder layer has the same; :mod:`.fast_gen` runs the target with them)."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    H = tcfg["hidden_size"]
    return dict(hidden=H, heads=tcfg["num_attention_heads"], kv_heads=tcfg["num_key_value_heads"],
                head_dim=tcfg.get("head_dim") or H // tcfg["num_attention_heads"], inter=tcfg["intermediate_size"],
                eps=tcfg["rms_norm_eps"],
                theta=(tcfg.get("rope_parameters") or {}).get("rope_theta", tcfg.get("rope_theta", 10000.0)))


def hot_tokens(samples: list[Sample], vocab: int, n: int) -> list[int]:
    """The ``n`` draft-vocabulary target ids: every generated token by frequency, then prompt tokens, then the
    lowest ids (a BPE vocabulary lists frequent merges first); sorted ascending."""
    from collections import Counter

    gen, prm = Counter(), Counter()
    for s in samples:
        gen.update(s.ids[s.prompt_len:])
        prm.update(s.ids[:s.prompt_len])
    order = [t for t, _ in gen.most_common()] + [t for t, _ in prm.most_common()] + list(range(vocab))
    hot, seen = [], set()
    for t in order:
        if t not in seen:
            seen.add(t)
            hot.append(t)
            if len(hot) == n:
                break
    return sorted(hot)


def train(samples: list[Sample], target_dir: Path, epochs: int, seed: int = 0, lr: float = 2e-3,
          batch_size: int = 4, steps: int = TTT_STEPS, time_budget_s: Optional[float] = None):
    """Train the draft; returns ``(state_dict, hot token ids, config dict, stats)``."""
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    cfg = dict(target_geometry(target_dir), draft_vocab=DRAFT_VOCAB)
    weights = load_file(str(target_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].float()
    head = weights.get("lm_head.weight", embed).float()
    hot = hot_tokens(samples, embed.shape[0], DRAFT_VOCAB)
    t2d = torch.full((embed.shape[0],), -100, dtype=torch.long)
    t2d[torch.tensor(hot)] = torch.arange(len(hot))
    draft = _modules(cfg)
    with torch.no_grad():  # start from the target's output space: its final norm and its head rows
        draft.lm_head.weight.copy_(head[torch.tensor(hot)])
        draft.norm.weight.copy_(weights["model.norm.weight"])
        draft.o_proj.weight.mul_(0.1)
        draft.down_proj.weight.mul_(0.1)
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    # Sort by length into fixed batches (less padding), shuffled per epoch with the seeded generator.
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].ids))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    total_steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total_steps)))))
    t0 = time.monotonic()
    stats: dict[str, Any] = {"epochs": 0, "acc": []}
    for epoch in range(epochs):
        perm = torch.randperm(len(batches), generator=gen).tolist()
        correct = [0] * steps
        count = [0] * steps
        for bi in perm:
            loss, c, n = _batch_loss(draft, [samples[i] for i in batches[bi]], embed, t2d, cfg, steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            sched.step()
            for k in range(steps):
                correct[k] += c[k]
                count[k] += n[k]
        acc = [round(correct[k] / max(1, count[k]), 3) for k in range(steps)]
        stats["acc"].append(acc)
        stats["epochs"] = epoch + 1
        log(f"epoch {epoch + 1}/{epochs}: top-1 accuracy per step {acc} ({time.monotonic() - t0:.0f} s)")
        if time_budget_s is not None and time.monotonic() - t0 > time_budget_s:
            log("training time budget reached")
            break
    stats["train_s"] = round(time.monotonic() - t0, 1)
    return draft.state_dict(), hot, cfg, stats


def _batch_loss(draft, batch: list[Sample], embed, t2d, cfg: dict, steps: int, trim: bool = True):
    """The batch's test-time-training loss and, per step, (correct, counted) top-1 predictions. ``trim=False`` runs
    steps >= 1 over every position (the reference the trimmed run must equal)."""
    import torch

    B = len(batch)
    T = max(len(s.ids) - 1 for s in batch)  # positions with a feature
    F = batch[0].feats.shape[1]
    feats = torch.zeros(B, T, F)
    tokens = torch.full((B, T + steps + 1), 0, dtype=torch.long)
    valid = torch.zeros(B, T + steps + 1, dtype=torch.bool)  # label positions that count
    for b, s in enumerate(batch):
        n = len(s.ids) - 1
        feats[b, :n] = s.feats[:n]
        tokens[b, :len(s.ids)] = torch.tensor(s.ids)
        valid[b, s.prompt_len + 1:len(s.ids)] = True
    positions = torch.arange(T).unsqueeze(0).expand(B, T)
    causal = torch.full((T, T), float("-inf")).triu(1)
    hidden = draft.fc(feats)
    past: list = []
    total = 0.0
    correct, count = [], []
    # Steps >= 1 only matter where a label counts: from the shortest prompt's end on. Their queries start there (the
    # same rows, ~1/3 less work on chat data); step 0 runs every position, since all of them are its keys.
    first = max(0, min(s.prompt_len for s in batch) - steps) if trim else 0
    for k in range(steps):
        lo = 0 if k == 0 else first
        if k == 1 and first:
            hidden, positions, causal = hidden[:, first:], positions[:, first:], causal[first:]
        inp = tokens[:, lo + 1 + k:1 + k + T]  # token x[i+1+k] at position i
        lab = tokens[:, lo + 2 + k:2 + k + T]  # predicts x[i+2+k]
        ok = valid[:, lo + 2 + k:2 + k + T]
        cos, sin = _rope_tables(positions + k, cfg["head_dim"], cfg["theta"])
        hidden, kv = draft(embed[inp], hidden, cos, sin, past, causal)
        past.append(kv)
        tgt = t2d[lab]
        ok = ok & (tgt >= 0)
        if ok.any():
            lg = draft.logits(hidden[ok])
            total = total + (0.8 ** k) * torch.nn.functional.cross_entropy(lg, tgt[ok])
            correct.append(int((lg.argmax(-1) == tgt[ok]).sum()))
        else:
            correct.append(0)
        count.append(int(ok.sum()))
    return total, correct, count


def save_draft(out: Path, state: dict, hot: list[int], cfg: dict, target_dir: Path) -> None:
    """Write ``out`` as an SGLang EAGLE3 draft folder (config, safetensors, the target's tokenizer files)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    tcfg = json.loads((target_dir / "config.json").read_text())
    V = tcfg["vocab_size"]
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        names[f"{n}.weight"] = f"midlayer.{n}.weight"
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"{n}.weight"] = f"midlayer.self_attn.{n}.weight"
    for n in ("gate_proj", "up_proj", "down_proj"):
        names[f"{n}.weight"] = f"midlayer.mlp.{n}.weight"
    tensors = {names[k]: v.detach().float().contiguous() for k, v in state.items()}
    hot_t = torch.tensor(hot, dtype=torch.int64)
    tensors["d2t"] = hot_t - torch.arange(len(hot), dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot_t] = True
    tensors["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["inter"],
        "num_hidden_layers": 1,
        "num_attention_heads": cfg["heads"],
        "num_key_value_heads": cfg["kv_heads"],
        "head_dim": cfg["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": tcfg.get("max_position_embeddings", 8192),
        "rms_norm_eps": cfg["eps"],
        "rope_theta": cfg["theta"],
        "tie_word_embeddings": False,
        "vocab_size": V,
        "draft_vocab_size": len(hot),
        "target_hidden_size": cfg["hidden"],
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "pad_token_id": tcfg.get("pad_token_id"),
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    for f in target_dir.iterdir():
        if f.is_file() and f.name.startswith("tokenizer") or f.name in ("chat_template.jinja",
                                                                          "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
