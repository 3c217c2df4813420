"""``torch.ops.sgl_kernel.decode_attention_cpu`` / ``extend_attention_cpu`` in plain torch.

SGLang's ``intel_amx`` attention backend calls these two ops positionally. Their argument lists differ between
releases (0.5.23 passes K/V scales to both and ``is_causal`` to extend; 0.5.16 passes neither), so the schema is
chosen from the installed backend's source at registration time.

Semantics (per request ``b``, KV rows addressed through ``req_to_token[req_pool_indices[b]]``):

* decode: optionally write the new ``key[b]/value[b]`` at ``loc[b]``, then attend ``query[b]`` over the first
  ``seq_lens[b]`` rows.
* extend: ``seq_lens[b]`` counts prefix + extend tokens; query ``i`` of the extend part sees the whole prefix and the
  extend tokens allowed by ``custom_mask`` (QLEN_ONLY layout: an ``E x E`` block per request, row = query) or, without
  a mask, causally. The caller has already written the extend K/V to the cache.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

__all__ = ["register_attention_ops", "decode_attention", "extend_attention"]


def _softmax_attend(
    q: torch.Tensor,  # [Q, H, D]
    k: torch.Tensor,  # [K, Hkv, D]
    v: torch.Tensor,  # [K, Hkv, Dv]
    visible: Optional[torch.Tensor],  # [Q, K] bool, None = all visible
    sm_scale: float,
    logit_cap: float,
    sinks: Optional[torch.Tensor],  # [H]
) -> torch.Tensor:
    H, Hkv = q.shape[1], k.shape[1]
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(H, 1, 1).expand(H, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("hqk,khd->qhd", probs, vf)


def _window_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> Optional[torch.Tensor]:
    if window is None or window <= 0:
        return None
    return k_pos.view(1, -1) > (q_pos.view(-1, 1) - window)


def decode_attention(
    query, k_cache, v_cache, output, key, value, loc, attn_logits, req_to_token, req_pool_indices, seq_lens,
    sm_scale, logit_cap, is_cross_attn, sliding_window_size, encoder_lens, sinks, key_scale=1.0, value_scale=1.0,
) -> None:
    if is_cross_attn:
        raise NotImplementedError("cross-attention is not implemented by the CPU test runtime's decode_attention_cpu")
    if key is not None and value is not None and loc is not None:
        locs = loc.reshape(-1).to(torch.int64)
        k_cache[locs] = key.reshape(locs.numel(), *k_cache.shape[1:]).to(k_cache.dtype)
        v_cache[locs] = value.reshape(locs.numel(), *v_cache.shape[1:]).to(v_cache.dtype)
    reqs = req_pool_indices.reshape(-1).tolist()
    lens = seq_lens.reshape(-1).tolist()
    for b, (req, n) in enumerate(zip(reqs, lens)):
        n = int(n)
        idx = req_to_token[int(req), :n].to(torch.int64)
        k = k_cache[idx].float() * key_scale
        v = v_cache[idx].float() * value_scale
        visible = _window_visible(torch.tensor([n - 1]), torch.arange(n), int(sliding_window_size))
        out = _softmax_attend(query[b : b + 1], k, v, visible, sm_scale, logit_cap, sinks)
        output[b : b + 1] = out.to(output.dtype).view_as(output[b : b + 1])


def extend_attention(
    q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
    extend_seq_lens, extend_start_loc, max_len_extend, sm_scale, logit_cap, is_cross_attn, sliding_window_size,
    encoder_lens, sinks, custom_mask, key_scale=1.0, value_scale=1.0, is_causal=True,
) -> None:
    if is_cross_attn:
        raise NotImplementedError("cross-attention is not implemented by the CPU test runtime's extend_attention_cpu")
    reqs = req_pool_indices.reshape(-1).tolist()
    lens = seq_lens.reshape(-1).tolist()
    ext = extend_seq_lens.reshape(-1).tolist()
    starts = extend_start_loc.reshape(-1).tolist()
    mask_flat = custom_mask.reshape(-1) if custom_mask is not None and custom_mask.numel() > 0 else None
    mask_offset = 0
    for b, req in enumerate(reqs):
        n, e, s = int(lens[b]), int(ext[b]), int(starts[b])
        if e <= 0:
            continue
        p = n - e
        if p < 0:
            raise ValueError(
                f"extend_attention_cpu: request {b} has seq_len {n} < extend_len {e} (prefix {p}); the caller passed "
                "sequence lengths without the extend part"
            )
        idx = req_to_token[int(req), :n].to(torch.int64)
        k = k_buffer[idx].float() * key_scale
        v = v_buffer[idx].float() * value_scale
        if k_extend is not None and v_extend is not None:
            k[p:] = k_extend[s : s + e].float()
            v[p:] = v_extend[s : s + e].float()
        visible = torch.ones((e, n), dtype=torch.bool)
        if mask_flat is not None:
            block = mask_flat[mask_offset : mask_offset + e * e].view(e, e)
            visible[:, p:] = block.to(torch.bool)
            mask_offset += e * e
        elif is_causal:
            visible[:, p:] = torch.ones((e, e), dtype=torch.bool).tril()
        window = _window_visible(torch.arange(p, n), torch.arange(n), int(sliding_window_size))
        if window is not None:
            visible &= window
        out = _softmax_attend(q_extend[s : s + e], k, v, visible, sm_scale, logit_cap, sinks)
        o_extend[s : s + e] = out.to(o_extend.dtype).view_as(o_extend[s : s + e])


# --- registration --------------------------------------------------------------------------------------------------

_DECODE_NEW = (
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float key_scale, float value_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_DECODE_OLD = (
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) output, Tensor? key, "
    "Tensor? value, Tensor? loc, Tensor attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, "
    "Tensor? sinks) -> ()"
)
_EXTEND_NEW = (
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
    "Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, "
    "float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, "
    "Tensor? custom_mask, bool is_causal) -> ()"
)
_EXTEND_OLD = (
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
    "Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
    "Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? custom_mask) -> ()"
)


def _backend_passes_kv_scales() -> bool:
    """True when the installed ``intel_amx_backend.py`` passes K/V scales (0.5.23 style); read as text so that
    registering the ops never imports SGLang."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return True
    path = os.path.join(list(spec.submodule_search_locations)[0], "srt", "layers", "attention", "intel_amx_backend.py")
    try:
        with open(path, encoding="utf-8") as f:
            return "key_scale" in f.read()
    except OSError:
        return True


_LIB: Optional[torch.library.Library] = None


def register_attention_ops() -> None:
    """Define the two ops under the ``sgl_kernel`` namespace (once per process)."""
    global _LIB
    if _LIB is not None or hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        return
    new_style = _backend_passes_kv_scales()
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define(_DECODE_NEW if new_style else _DECODE_OLD)
    lib.define(_EXTEND_NEW if new_style else _EXTEND_OLD)

    if new_style:

        def _decode(q, kc, vc, ks, vs, o, k, v, loc, logits, r2t, rpi, sl, sm, cap, cross, win, enc, sinks):
            decode_attention(q, kc, vc, o, k, v, loc, logits, r2t, rpi, sl, sm, cap, cross, win, enc, sinks, ks, vs)

        def _extend(q, k, v, o, kb, vb, ks, vs, r2t, rpi, sl, esl, esl0, mx, sm, cap, cross, win, enc, sinks, mask, causal):
            extend_attention(
                q, k, v, o, kb, vb, r2t, rpi, sl, esl, esl0, mx, sm, cap, cross, win, enc, sinks, mask, ks, vs, causal
            )

    else:

        def _decode(q, kc, vc, o, k, v, loc, logits, r2t, rpi, sl, sm, cap, cross, win, enc, sinks):
            decode_attention(q, kc, vc, o, k, v, loc, logits, r2t, rpi, sl, sm, cap, cross, win, enc, sinks)

        def _extend(q, k, v, o, kb, vb, r2t, rpi, sl, esl, esl0, mx, sm, cap, cross, win, enc, sinks, mask):
            extend_attention(q, k, v, o, kb, vb, r2t, rpi, sl, esl, esl0, mx, sm, cap, cross, win, enc, sinks, mask)

    lib.impl("decode_attention_cpu", _decode, "CPU")
    lib.impl("extend_attention_cpu", _extend, "CPU")
    _LIB = lib
