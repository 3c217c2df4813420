"""Plain-torch versions of the ``*_cpu`` bookkeeping ops SGLang's EAGLE v2 path calls on CPU, and of the sampling
verify op (:func:`tree_speculative_sampling_target_only`) SGLang calls on a GPU only.

Each function mirrors the contract of SGLang's own Triton kernel for the same job (read at the caller named in its
docstring); tensors marked "written" are updated in place, exactly as the native ops do. Loops run over the batch in
Python: batches in the CPU tests are a handful of requests, so clarity wins over speed.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable, Optional

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "top_k_renorm_prob",
    "top_p_renorm_prob",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy_cpu",
]

# A probe that times device work (``sglang_eo_dev.cpu_runtime.step_times``) sets this: each op below is ONE kernel on
# a GPU, whatever its Python loop does here, so the probe times every call as one device op. None: plain calls.
KERNEL_HOOK: list[Optional[Callable[[Callable[..., Any], tuple, dict], Any]]] = [None]


def _kernel(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Route calls of a stand-in op through :data:`KERNEL_HOOK` when one is set."""

    @functools.wraps(fn)
    def op(*args: Any, **kwargs: Any) -> Any:
        hook = KERNEL_HOOK[0]
        return fn(*args, **kwargs) if hook is None else hook(fn, args, kwargs)

    return op


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


@_kernel
def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy row ``src_loc[i]`` to row ``tgt_loc[i]`` in every KV buffer (caller: ``kernels/ops/kvcache/cache_move.py``).

    ``data_ptrs[b]`` is the base address of buffer ``b`` and ``strides[b]`` its row size in bytes. All source rows are
    read before any target row is written, so overlapping source/target sets behave like the tiled kernel.
    """
    pairs = list(zip(_ints(tgt_loc), _ints(src_loc)))
    if not pairs:
        return
    for base, stride in zip(_ints(data_ptrs), _ints(strides)):
        rows = [ctypes.string_at(base + src * stride, stride) for _, src in pairs]
        for (tgt, _), row in zip(pairs, rows):
            ctypes.memmove(base + tgt * stride, row, stride)


@_kernel
def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,  # written
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_i, start_i:end_i] = out_cache_loc[packed slice i]`` (caller: ``mem_cache/allocation.py``)."""
    flat = out_cache_loc.reshape(-1)
    offset = 0
    for req, start, end in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = end - start
        if n > 0:
            req_to_token[req, start:end] = flat[offset : offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


@_kernel
def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,  # written
    pool_len: int,
) -> None:
    """Pack ``req_to_token[req_i, start_i:end_i]`` for every request into ``out_cache_loc`` (inverse of the above;
    caller: ``kernels/ops/speculative/cache_locs.py``, 0.5.16 ``speculative/spec_utils.py``)."""
    flat = out_cache_loc.view(-1)
    offset = 0
    for req, start, end in zip(_ints(req_pool_indices), _ints(start_offset), _ints(end_offset)):
        n = end - start
        if n > 0:
            flat[offset : offset + n] = req_to_token[req, start:end].to(flat.dtype)
        offset += max(n, 0)


@_kernel
def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,  # written
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Request i's draft slots are ``req_to_token[req_i, seq_len_i : seq_len_i + topk*num_steps]``, copied to
    ``out_cache_loc[i*topk*num_steps :]`` (branch-major: branch j's steps are contiguous)."""
    width = topk * num_steps
    flat = out_cache_loc.view(-1)
    for i, (req, seq_len) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        flat[i * width : (i + 1) * width] = req_to_token[req, seq_len : seq_len + width].to(flat.dtype)


@_kernel
def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """One KV-index row per (request, branch) for the multi-step draft decode (caller: ``intel_amx_backend.py``).

    Row ``i*topk + j`` holds request i's committed prefix ``req_to_token[req_i, :seq_len_i]`` followed by branch j's
    draft slots ``req_to_token[req_i, seq_len_i + j*num_steps : ... + num_steps]`` — the layout
    ``assign_draft_cache_locs_contiguous`` allocates (page size 1). Rows are addressed by ``arange(bs*topk)``.
    """
    reqs, lens = _ints(req_pool_indices), _ints(seq_lens)
    out = torch.zeros((len(reqs) * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for i, (req, seq_len) in enumerate(zip(reqs, lens)):
        prefix = req_to_token[req, :seq_len]
        for j in range(topk):
            row = out[i * topk + j]
            row[:seq_len] = prefix
            lo = seq_len + j * num_steps
            row[seq_len : seq_len + num_steps] = req_to_token[req, lo : lo + num_steps]
    return out


@_kernel
def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,  # written
    accept_stride: int,
) -> None:
    """``bonus[i] = accept_tokens[i*stride + accept_lens[i] - 1]``: the last accepted slot (the bonus token) per request
    (caller: ``kernels/ops/speculative/eagle.py``)."""
    flat = accept_tokens.reshape(-1)
    lens = accept_lens.reshape(-1).to(torch.int64)
    if lens.numel() == 0:
        return
    idx = torch.arange(lens.numel(), dtype=torch.int64, device=flat.device) * accept_stride + lens - 1
    bonus_tokens.view(-1)[: lens.numel()] = flat[idx].to(bonus_tokens.dtype)


@_kernel
def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,  # written
) -> None:
    """Compact: the k-th non-negative entry ``a`` of ``accept_index`` (row-major) writes ``out_cache_loc[a]`` to
    ``accept_out_cache_loc[k]`` (caller: ``kernels/ops/speculative/eagle.py``)."""
    flat = accept_index.reshape(-1).to(torch.int64)
    valid = flat[flat >= 0]
    n = valid.numel()
    if n:
        accept_out_cache_loc.view(-1)[:n] = out_cache_loc.reshape(-1)[valid].to(accept_out_cache_loc.dtype)


def _find_selected(selected: list[int], token_idx: int) -> int:
    for pos, value in enumerate(selected):
        if value == token_idx:
            return pos
    return -1


@_kernel
def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,  # written
    positions: torch.Tensor,  # written
    retrieve_index: torch.Tensor,  # written
    retrieve_next_token: torch.Tensor,  # written, caller fills -1
    retrieve_next_sibling: torch.Tensor,  # written, caller fills -1
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the verify tree from the draft's top-k bookkeeping (caller: ``spec_tree.py`` / 0.5.16 ``eagle_utils.py``).

    Node 0 of each request is the verified (bonus) token; node ``i >= 1`` is draft ``selected_index[i-1]``, whose
    parent draft is ``parent_list[selected_index[i-1] // topk]`` (0 means the root). Children are linked in ascending
    node order through ``retrieve_next_token`` / ``retrieve_next_sibling``; ``positions`` is ``seq_len + depth``.
    Mask modes: 0 FULL_MASK (rows of ``seq_len + D``, prefix columns pre-filled by the caller), 1 QLEN_ONLY (rows of
    ``D``; ``mask[b, i, j]`` = node j is i itself or an ancestor of i).
    """
    D = draft_token_num
    bs = verified_seq_len.numel()
    seq_lens = _ints(verified_seq_len)
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        raise NotImplementedError(f"tree_mask_mode {mode} is not supported by the CPU test runtime (0 or 1 expected)")
    parents_all = parent_list.reshape(bs, -1).tolist() if parent_list.numel() else [[] for _ in range(bs)]
    selected_all = selected_index.reshape(bs, -1).tolist()
    ri, rn, rs = retrieve_index.view(bs, D), retrieve_next_token.view(bs, D), retrieve_next_sibling.view(bs, D)
    pos_out = positions.view(bs, D)
    flat_mask = tree_mask.view(-1)
    prefix_sum = 0
    for b in range(bs):
        seq_len = seq_lens[b]
        parents = [int(x) for x in parents_all[b]]
        selected = [int(x) for x in selected_all[b]]

        def parent_node(node: int) -> int:
            """Tree node (0 = root) that is the parent of node >= 1; -1 when the parent draft was not selected."""
            tb = selected[node - 1] // topk
            if tb == 0:
                return 0
            pos = _find_selected(selected[: D - 1], parents[tb])
            return pos + 1 if pos >= 0 else -1

        next_tok = [-1] * D
        next_sib = [-1] * D
        for i in range(D - 1, 0, -1):
            p = parent_node(i)
            if p >= 0:
                if next_tok[p] != -1:
                    next_sib[i] = next_tok[p]
                next_tok[p] = i
        ri[b] = torch.arange(b * D, (b + 1) * D, dtype=ri.dtype)
        rn[b] = torch.tensor(next_tok, dtype=rn.dtype)
        rs[b] = torch.tensor(next_sib, dtype=rs.dtype)

        depths = [0] * D
        for x in range(D):
            # Walk up from x marking at most `depth` non-root nodes, as the native kernel does.
            ancestors: list[int] = []
            node = x
            if x > 0:
                for _ in range(depth):
                    ancestors.append(node)
                    p = parent_node(node)
                    if p <= 0:
                        break
                    node = p
            depths[x] = len(ancestors)
            if mode == 0:
                row_start = D * D * b + prefix_sum * D + (seq_len + D) * x + seq_len
            else:
                row_start = D * D * b + D * x
            row = torch.zeros(D, dtype=torch.bool)
            row[0] = True
            for a in ancestors:
                row[a] = True
            flat_mask[row_start : row_start + D] = row.to(flat_mask.dtype)
        pos_out[b] = torch.tensor([seq_len + d for d in depths], dtype=pos_out.dtype)
        prefix_sum += seq_len


class _Tree:
    """A verify tree's per-request lists (``[b][node]``), read from the ops' tensors once per call."""

    def __init__(self, candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                 retrive_next_sibling: torch.Tensor) -> None:
        self.bs, d = candidates.shape[0], candidates.shape[1]
        self.cand, self.rindex, self.rnext, self.rsib = (
            [[int(x) for x in row] for row in t.reshape(self.bs, d).tolist()]
            for t in (candidates, retrive_index, retrive_next_token, retrive_next_sibling)
        )


def _walk(
    tree: _Tree,
    b: int,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    accepts: Callable[[int, int], bool],
) -> list[int]:
    """The tree walk both verify ops share, for request ``b``; returns the accepted path's tree positions, root first.

    From the root (position 0), the current node's children are tried in sibling order; ``accepts(node, child)``
    decides each (called at most once per child, so it may count or record rejections), and the first accepted child
    becomes the current node. The walk stops at a node with no accepted child, or after ``accept_index.shape[1] - 1``
    accepted drafts. Written: ``accept_index[b]`` (the path's retrieve indices), ``predicts`` at every path node but
    the last (the accepted child's draft token) and ``accept_token_num[b]`` (accepted drafts); the bonus token at the
    last node is the caller's.
    """
    cand, rindex, rnext, rsib = tree.cand[b], tree.rindex[b], tree.rnext[b], tree.rsib[b]
    S = accept_index.shape[1]
    acc_row = accept_index.view(-1, S)[b]
    pred_flat = predicts.view(-1)
    path = [0]
    acc_row[0] = rindex[0]
    while len(path) < S:
        child = rnext[path[-1]]
        while child != -1 and not accepts(path[-1], child):
            child = rsib[child]
        if child == -1:
            break
        pred_flat[rindex[path[-1]]] = cand[child]
        acc_row[len(path)] = rindex[child]
        path.append(child)
    accept_token_num.view(-1)[b] = len(path) - 1
    return path


@_kernel
def verify_tree_greedy_cpu(
    predicts: torch.Tensor,  # written
    accept_index: torch.Tensor,  # written
    accept_token_num: torch.Tensor,  # written
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree walk (caller: ``spec_tree.py`` / 0.5.16 ``eagle_utils.py``).

    From the root, repeatedly pick the first child (in sibling order) whose draft token equals the target's argmax at
    the current node; record its retrieve index in ``accept_index[b, 1:]``. ``predicts[node]`` gets the target token
    for every accepted node plus the final (bonus) one; ``accept_token_num[b]`` counts accepted drafts (bonus
    excluded). Keyword names keep SGLang's ``retrive_*`` spelling because the caller passes them by name.
    """
    tree = _Tree(candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    target = target_predict.reshape(-1).tolist()
    for b in range(tree.bs):
        cand, rindex = tree.cand[b], tree.rindex[b]

        def matches_target(node: int, child: int) -> bool:
            return cand[child] == target[rindex[node]]

        path = _walk(tree, b, predicts, accept_index, accept_token_num, matches_target)
        last = rindex[path[-1]]
        predicts.view(-1)[last] = int(target[last])


# --- sampling verify ---------------------------------------------------------------------------------------------
#
# SGLang verifies on CPU greedily whatever the temperature (``eagle_utils``: ``_is_cpu`` routes to
# ``verify_tree_greedy``), and has no CPU ``tree_speculative_sampling_target_only``. The op below is a plain-torch
# port of the CUDA kernel's algorithm (sgl-kernel ``speculative_sampling.cuh``, TreeSpeculativeSamplingTargetOnly),
# written from its description, so the CPU runtime can take SGLang's sampling path
# (:mod:`sglang_eo_dev.cpu_runtime.spec_sampling` switches it on).


@_kernel
def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,  # written
    accept_index: torch.Tensor,  # written
    accept_token_num: torch.Tensor,  # written
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,  # written (rejected drafts' target probability)
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Target-only speculative sampling over the verify tree (callers: ``eagle_utils.eagle_sample`` on both bands).

    Per request ``b`` (``D`` tree nodes, ``S = accept_index.shape[1]`` = tree depth + 1, ``target_probs[b, i]`` the
    target's distribution after node ``i``, temperature and grammar mask already applied):

    1. the walk starts at the root with coin ``u = uniform_samples[b, 0]`` and ``acc = 0``;
    2. the children of the current node are tried in sibling order; child ``c`` with draft token ``x`` adds
       ``t = target_probs[b, cur, x]`` to ``acc`` and is accepted when ``u <= acc / threshold_acc`` or
       ``t >= threshold_single``. Accepting moves to ``c`` (its retrieve index is appended to ``accept_index[b]``,
       ``predicts`` of the previous node gets ``x``), resets ``acc`` and draws the next coin ``uniform_samples[b, c]``.
       A rejected child records ``draft_probs[b, cur, x] = t``, so the final draw cannot pick it again;
    3. the walk stops at the first node whose children are all rejected (or at depth ``S - 1``);
    4. the bonus token at the last accepted node is drawn by inverse CDF with ``uniform_samples_for_final_sampling[b]``
       from ``relu(target_probs[b, cur] - draft_probs[b, cur])`` (``draft_probs`` taken as zero when the walk reached
       depth ``S - 1``); ``predicts[last]`` gets it and ``accept_token_num[b]`` the number of accepted drafts.

    With the default thresholds (1, 1) and distinct siblings, one shared coin per node makes the accepted child, or
    the bonus token drawn from what is left, distributed exactly as ``target_probs[b, cur]``: the output follows the
    target's law whatever the drafts are. Like the kernel, an empty residual (every token of positive probability
    was a rejected draft, possible only through float rounding at a node with one allowed token) yields token
    ``vocab - 1``.
    """
    _tree_sampling(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                   retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                   draft_probs, float(threshold_single), float(threshold_acc))


def _tree_sampling(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
    accept_probs: Optional[torch.Tensor] = None,
    resample_empty_residual: bool = False,
) -> None:
    """The walk of :func:`tree_speculative_sampling_target_only`.

    Two TEST ONLY departures, used by :mod:`sglang_eo_dev.cpu_runtime.spec_sampling`'s deliberately biased verifier
    and never by the op: ``accept_probs`` (same shape as ``target_probs``) replaces ``target_probs`` in the accept
    test of step 2 only; ``resample_empty_residual`` draws the bonus token from ``target_probs[b, cur]`` when the
    residual of step 4 is empty instead of returning ``vocab - 1``.
    """
    tree = _Tree(candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    bs, D = candidates.shape[0], candidates.shape[1]
    S = accept_index.shape[1]
    V = target_probs.shape[-1]
    probs = target_probs.reshape(bs, D, V)
    tests = probs if accept_probs is None else accept_probs.reshape(bs, D, V)
    rejected = draft_probs.view(bs, D, V)
    coins = uniform_samples.reshape(bs, D).tolist()
    final_coins = uniform_samples_for_final_sampling.reshape(-1).tolist()
    pred_flat = predicts.view(-1)
    for b in range(bs):
        cand, node_coins = tree.cand[b], coins[b]
        prob_acc = 0.0  # target mass of the current node's children tried so far (one coin per node)

        def coin_accepts(node: int, child: int) -> bool:
            nonlocal prob_acc
            token = cand[child]
            single = float(tests[b, node, token])
            prob_acc += single
            if float(node_coins[node]) <= prob_acc / threshold_acc or single >= threshold_single:
                prob_acc = 0.0
                return True
            rejected[b, node, token] = probs[b, node, token]
            return False

        path = _walk(tree, b, predicts, accept_index, accept_token_num, coin_accepts)
        node, num, last = path[-1], len(path) - 1, tree.rindex[b][path[-1]]
        q = probs[b, node].to(torch.float32)
        residual = q if num == S - 1 else torch.clamp(q - rejected[b, node].to(torch.float32), min=0.0)
        total = float(residual.sum())
        if total <= 0.0 and resample_empty_residual:
            residual, total = q, float(q.sum())
        u = float(final_coins[b]) * total
        above = torch.nonzero(torch.cumsum(residual, dim=0) > u)
        pred_flat[last] = int(above[0, 0]) if above.numel() else V - 1


@_kernel
def top_k_renorm_prob(probs: torch.Tensor, top_k: Any) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities (ties at the k-th value kept), renormalised (0.5.16 imports it
    with the sampling verify op; used when a request sets ``top_k``)."""
    rows = probs.shape[0]
    ks = top_k.reshape(-1).tolist() if isinstance(top_k, torch.Tensor) else [int(top_k)] * rows
    out = probs.clone()
    for r, k in enumerate(ks):
        k = int(k)
        if 0 < k < probs.shape[-1]:
            kth = torch.topk(probs[r], k).values[-1]
            out[r][probs[r] < kth] = 0.0
    return out / out.sum(dim=-1, keepdim=True)


@_kernel
def top_p_renorm_prob(probs: torch.Tensor, top_p: Any) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches ``top_p``, renormalised."""
    rows = probs.shape[0]
    ps = top_p.reshape(-1).tolist() if isinstance(top_p, torch.Tensor) else [float(top_p)] * rows
    out = probs.clone()
    for r, p in enumerate(ps):
        if float(p) >= 1.0:
            continue
        sorted_p, order = torch.sort(probs[r], descending=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass strictly above each token
        drop = order[before >= float(p)]
        out[r][drop] = 0.0
    return out / out.sum(dim=-1, keepdim=True)
