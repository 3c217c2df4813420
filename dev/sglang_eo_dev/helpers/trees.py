"""EAGLE-like verify trees in SGLang's layout (``retrieve_next_token`` / ``retrieve_next_sibling`` / ``draft_tokens``).

Node 0 is the root (the token the target already committed). The *first child* of every node on the main path
carries the true continuation; other nodes carry, with probability ``p_valid``, a token the grammar allows after
their parent (so that side branches are sometimes deep and valid) and otherwise a uniformly random token (almost
always grammar-invalid). Parents always precede their children. Trees are padded to ``num_nodes`` with unlinked
nodes (``-1`` links) carrying junk tokens, as SGLang pads them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

__all__ = ["Tree", "allowed_tokens", "eagle_tree", "stack_trees", "num_draft_tokens"]


@dataclass
class Tree:
    nxt: List[int]
    sib: List[int]
    tok: List[int]
    parent: List[int]


def num_draft_tokens(topk: int, steps: int) -> int:
    """Node counts SGLang uses for the benchmark shapes: chain = steps + 1; otherwise as configured upstream."""
    if topk == 1:
        return steps + 1
    return {(4, 3): 8, (8, 5): 64}.get((topk, steps), min(1 + topk * steps, 64))


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """Token ids the matcher allows next (empty if terminated)."""
    from sglang_eo_dev.helpers.grammars import next_token_bitmask

    if matcher.is_terminated():
        return np.zeros(0, dtype=np.int64)
    bm = next_token_bitmask(matcher, vocab_size)
    bits = np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.nonzero(bits)[0]


def eagle_tree(
    rng: random.Random,
    topk: int,
    steps: int,
    num_nodes: int,
    truth: Sequence[int],
    vocab_size: int,
    matcher=None,
    p_valid: float = 0.5,
    real_nodes: Optional[int] = None,
    p_oov: float = 0.0,
    extra_tokens: Sequence[int] = (),
) -> Tree:
    """Build a tree of ``real_nodes`` (default ``num_nodes``) linked nodes padded to ``num_nodes``.

    ``matcher`` (an xgrammar matcher at the root state, restored on return) is used to draw grammar-valid side
    tokens; ``extra_tokens`` are sprinkled onto random side nodes (e.g. EOS); ``p_oov`` draws tokens >= vocab.
    """
    real = num_nodes if real_nodes is None else real_nodes
    parent = [-1]
    depth = [0]
    children: List[List[int]] = [[]]
    tok = [0]  # the root's token is never read by the mask builders
    # Main path: first child at each depth is the true continuation.
    for d in range(1, steps + 1):
        if len(parent) >= real:
            break
        p = len(parent) - 1
        parent.append(p)
        depth.append(d)
        children.append([])
        children[p].append(len(parent) - 1)
        tok.append(int(truth[d - 1]) if d - 1 < len(truth) else rng.randrange(vocab_size))
    while len(parent) < real:
        cands = [i for i in range(len(parent)) if depth[i] < steps and len(children[i]) < topk]
        if not cands:
            break
        p = rng.choice(cands)
        idx = len(parent)
        parent.append(p)
        depth.append(depth[p] + 1)
        children.append([])
        children[p].append(idx)
        tok.append(_side_token(rng, p, parent, tok, vocab_size, matcher, p_valid, p_oov, extra_tokens))
    n_real = len(parent)
    nxt = [-1] * num_nodes
    sib = [-1] * num_nodes
    for i in range(n_real):
        ch = children[i]
        if ch:
            nxt[i] = ch[0]
            for a, b in zip(ch, ch[1:]):
                sib[a] = b
    while len(tok) < num_nodes:  # padding: unlinked junk
        tok.append(rng.choice([0, -1, rng.randrange(vocab_size)]))
        parent.append(-1)
    return Tree(nxt=nxt, sib=sib, tok=tok, parent=parent)


def _side_token(rng, p, parent, tok, vocab_size, matcher, p_valid, p_oov, extra_tokens) -> int:
    r = rng.random()
    if extra_tokens and r < 0.15:
        return int(rng.choice(list(extra_tokens)))
    if p_oov and rng.random() < p_oov:
        return vocab_size + rng.randrange(64)
    if matcher is not None and rng.random() < p_valid:
        path = []
        q = p
        while q > 0:
            path.append(tok[q])
            q = parent[q]
        path.reverse()
        accepted = 0
        ok = True
        for t in path:
            if 0 <= t < vocab_size and not matcher.is_terminated() and matcher.accept_token(int(t)):
                accepted += 1
            else:
                ok = False
                break
        try:
            if ok:
                allowed = allowed_tokens(matcher, vocab_size)
                if len(allowed):
                    return int(allowed[rng.randrange(len(allowed))])
        finally:
            if accepted:
                matcher.rollback(accepted)
    return rng.randrange(vocab_size)


def stack_trees(trees: Sequence[Tree]):
    """Batch tensors ``(retrieve_next_token, retrieve_next_sibling, draft_tokens)``, int64, ``[bs, n]``."""
    nxt = torch.tensor([t.nxt for t in trees], dtype=torch.int64)
    sib = torch.tensor([t.sib for t in trees], dtype=torch.int64)
    tok = torch.tensor([t.tok for t in trees], dtype=torch.int64)
    return nxt, sib, tok
