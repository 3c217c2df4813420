"""TEST ONLY: ``sgl_kernel.speculative`` of the stand-in, the one op SGLang's NGRAM worker imports from it.

``speculative/ngram_worker.py`` (0.5.16) and ``kernels/ops/speculative/reconstruct_tree.py`` (0.5.23, on CPU) import
``reconstruct_indices_from_tree_mask`` from here at module import. Plain torch, one request at a time (CPU test batches
are a handful of requests).
"""

from __future__ import annotations

import torch

__all__ = ["reconstruct_indices_from_tree_mask"]


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Derive the verify tree's positions and links from an NGRAM ancestor mask (all outputs written in place).

    ``tree_mask`` is ``[bs, n, n]`` flattened, row ``i`` marking the nodes on the path root..i (itself included).
    Per request ``b`` and node ``i`` (``n = draft_token_num``):

    * ``positions[b, i]`` = ``verified_seq_len[b]`` + number of strict ancestors of ``i`` (its depth);
    * ``retrieve_index[b, i]`` = ``b * n + i``;
    * ``retrieve_next_token[b, i]`` = the smallest child of ``i`` (a node ``k > i`` whose parent is ``i``), else -1;
    * ``retrieve_next_sibling[b, i]`` = the smallest ``k > i`` with the same parent, else -1 (-1 for the root).

    The parent of ``i`` is its deepest strict ancestor, i.e. the largest ``j < i`` marked in row ``i`` (nodes are
    numbered in BFS order, so a parent always precedes its children).
    """
    n = int(draft_token_num)
    mask = tree_mask.reshape(int(batch_size), n, n).to(torch.bool).cpu()
    seq = [int(x) for x in verified_seq_len.reshape(-1).tolist()]
    pos = positions.view(int(batch_size), n)
    ridx = retrieve_index.view(int(batch_size), n)
    nxt = retrieve_next_token.view(int(batch_size), n)
    sib = retrieve_next_sibling.view(int(batch_size), n)
    for b in range(int(batch_size)):
        parent = [-1] * n
        depth = [0] * n
        for i in range(n):
            ancestors = [j for j in range(i) if bool(mask[b, i, j])]
            depth[i] = len(ancestors)
            parent[i] = ancestors[-1] if ancestors else -1
        first_child = [-1] * n
        next_sibling = [-1] * n
        for k in range(n):
            p = parent[k]
            if p >= 0 and first_child[p] < 0:
                first_child[p] = k
        for i in range(n):
            if parent[i] < 0:
                continue
            for k in range(i + 1, n):
                if parent[k] == parent[i]:
                    next_sibling[i] = k
                    break
        pos[b] = torch.tensor([seq[b] + d for d in depth], dtype=pos.dtype)
        ridx[b] = torch.arange(b * n, (b + 1) * n, dtype=ridx.dtype)
        nxt[b] = torch.tensor(first_child, dtype=nxt.dtype)
        sib[b] = torch.tensor(next_sibling, dtype=sib.dtype)
