"""A lean greedy decoder for the Llama target on CPU: free answers plus the EAGLE3 auxiliary features, fast.

Why not transformers' ``generate`` loop (:func:`~.data.generate`): on the project's 2-core machine its per-step
overhead (a cache that grows by concatenation, every layer's hidden states returned, a padding mask rebuilt each step)
made it ~80 tokens/s at batch 96, where the matrix products alone allow ~250. The chat-trained draft needs ~10x the
JSON draft's data within its build budget, so its data goes through this decoder.

How: the weights are read from the target's safetensors (fused q/k/v and gate/up), the KV cache is preallocated for
``prompt + max_new_tokens`` positions, prompts are left-padded and run as one prefill, then one token per step for
the whole batch. Pad positions attend only to themselves (a row with no allowed key would turn the softmax into NaN
and spread through the cache). Features are the residual stream leaving each layer ``id`` of
:data:`~.eagle3.AUX_LAYER_IDS` (transformers' ``hidden_states[id + 1]``).

Call order: :func:`generate_free` (one call per batch of requests; returns one :class:`~.eagle3.Sample` each, in
order). Invariant: the result equals :func:`~.data.generate`'s for free requests up to float rounding (the unit test
compares the tokens of both on a few prompts).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from sglang_eo_dev.real_model.eagle3 import AUX_LAYER_IDS, Sample, _rope, _rope_tables, target_geometry

__all__ = ["generate_free"]


class _Target:
    """The target's weights, laid out for the decode loop."""

    def __init__(self, target_dir: Path) -> None:
        import torch
        from safetensors.torch import load_file

        g = target_geometry(target_dir)
        cfg = json.loads((target_dir / "config.json").read_text())
        w = load_file(str(target_dir / "model.safetensors"))
        self.nh, self.nkv, self.hd = int(g["heads"]), int(g["kv_heads"]), int(g["head_dim"])
        self.eps, self.theta = float(g["eps"]), float(g["theta"])
        self.eos = int(cfg["eos_token_id"])
        self.embed = w["model.embed_tokens.weight"].float()
        self.head = w.get("lm_head.weight", self.embed).float()
        self.norm = w["model.norm.weight"].float()
        self.layers = []
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"].float(),
                qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).float().contiguous(),
                o=w[p + "self_attn.o_proj.weight"].float(),
                ln2=w[p + "post_attention_layernorm.weight"].float(),
                gu=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).float().contiguous(),
                down=w[p + "mlp.down_proj.weight"].float()))

    def rms(self, x, weight):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def forward(self, tokens, start: int, cos, sin, allowed, kcache, vcache, keep):
        """Run ``tokens`` [B, T] at cache slots ``start..start+T``; returns (last position's logits [B, V], the
        features [B, T, 3H] of :data:`AUX_LAYER_IDS`)."""
        import torch
        import torch.nn.functional as F

        B, T = tokens.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        end = start + T
        h = self.embed[tokens]
        feats = []
        for i, L in enumerate(self.layers):
            qkv = F.linear(self.rms(h, L["ln1"]), L["qkv"])
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = _rope(q.view(B, T, nh, hd), cos, sin).transpose(1, 2)
            kcache[i][:, :, start:end] = _rope(k.view(B, T, nkv, hd), cos, sin).transpose(1, 2)
            vcache[i][:, :, start:end] = v.view(B, T, nkv, hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, kcache[i][:, :, :end], vcache[i][:, :, :end], attn_mask=allowed,
                                               enable_gqa=True)
            h = h + F.linear(a.transpose(1, 2).reshape(B, T, nh * hd), L["o"])
            g, u = F.linear(self.rms(h, L["ln2"]), L["gu"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, L["down"])
            if i in keep:
                feats.append(h)
        logits = F.linear(self.rms(h[:, -1], self.norm), self.head)
        return logits, torch.cat(feats, dim=-1)


@functools.lru_cache(maxsize=1)
def _target(target_dir: Path) -> _Target:
    return _Target(target_dir)


def generate_free(target_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[Sample]:
    """Greedy answers (until eos or ``max_new_tokens``) of the target to the rendered ``prompts``, one batch, with
    their features (float32 rows for positions ``0 .. len(ids) - 2``)."""
    import torch

    m = _target(Path(target_dir))
    B, P = len(prompts), max(map(len, prompts))
    Lmax = P + max_new_tokens
    pad = torch.tensor([P - len(p) for p in prompts])
    tokens = torch.full((B, P), m.eos, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):] = torch.tensor(p)
    slot = torch.arange(Lmax)
    valid = slot.unsqueeze(0) >= pad.unsqueeze(1)  # [B, Lmax]: not a pad slot
    pos = (slot.unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
    cos_all, sin_all = _rope_tables(pos, m.hd, m.theta)  # [B, Lmax, 1, hd]
    kcache = [torch.zeros(B, m.nkv, Lmax, m.hd) for _ in m.layers]
    vcache = [torch.zeros(B, m.nkv, Lmax, m.hd) for _ in m.layers]
    keep = set(AUX_LAYER_IDS)
    feats = torch.zeros(B, Lmax, 3 * m.embed.shape[1])
    gen: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    with torch.no_grad():
        # prefill: causal over valid keys; a pad query sees only itself
        causal = slot[:P].unsqueeze(1) >= slot[:P].unsqueeze(0)
        allowed = (causal.unsqueeze(0) & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool).unsqueeze(0)
        logits, f = m.forward(tokens, 0, cos_all[:, :P], sin_all[:, :P], allowed.unsqueeze(1), kcache, vcache, keep)
        feats[:, :P] = f
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)
            for b, t in enumerate(nxt.tolist()):
                if not done[b]:
                    gen[b].append(t)
                    done[b] = t == m.eos
            if all(done) or step == max_new_tokens - 1:
                break
            s = P + step
            allowed = valid[:, None, None, :s + 1]
            logits, f = m.forward(nxt.unsqueeze(1), s, cos_all[:, s:s + 1], sin_all[:, s:s + 1], allowed, kcache,
                                  vcache, keep)
            feats[:, s:s + 1] = f
    out = []
    for b, p in enumerate(prompts):
        ids = list(p) + gen[b]
        rows = feats[b, P - len(p):P - len(p) + len(ids) - 1].clone()
        out.append(Sample(ids, len(p), rows))
    return out
