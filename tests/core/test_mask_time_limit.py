"""TreeMaskBuilder's time limit covers the walk and its fills only, never one-time set-up.

Seen on an H200 (``../shared/notes/gpu-runtime.md``): every request hit the 50 ms mask time limit exactly once, at
bs 1 too, so its drafts were dropped for that step. The build allocated its (pinned, on a GPU host) bitmask buffer
and created its fill thread pool inside the timed region, and reallocated the buffer for every larger batch. Here a
slow allocation stands in for ``cudaHostAlloc``: it must not make any request time out, and a batch that grows step
by step must reallocate O(log rows) times, not once per new size.
"""

from __future__ import annotations

import random
import time

import torch

from sglang_eagle_overlap.core import MaskRequest, TreeMaskBuilder
from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.trees import eagle_tree, num_draft_tokens, stack_trees

VOCAB = 32000


def _batch(bs: int, seed: int = 0):
    rng = random.Random(seed)
    n = num_draft_tokens(1, 3)
    reqs, trees = [], []
    for i in range(bs):
        doc = list(G.doc_tokens("nested", random.Random(seed * 1000 + i), VOCAB))
        k = rng.randrange(1, len(doc) - 1)
        m = G.matcher("nested", VOCAB, doc[:k])
        reqs.append(MaskRequest(matcher=m, request_id=f"r{i}"))
        trees.append(eagle_tree(rng, 1, 3, n, doc[k:], VOCAB, matcher=m))
    return reqs, stack_trees(trees)


def test_slow_buffer_allocation_does_not_count_against_the_time_limit(monkeypatch):
    real_empty = torch.empty
    slow_s = 0.08

    def slow_empty(*args, **kwargs):  # a pinned allocation on a busy driver
        time.sleep(slow_s)
        return real_empty(*args, **kwargs)

    builder = TreeMaskBuilder(time_limit_s=0.05)
    reqs, (nxt, sib, tok) = _batch(4)
    monkeypatch.setattr(torch, "empty", slow_empty)
    t0 = time.perf_counter()
    result = builder.build(reqs, nxt, sib, tok, VOCAB)
    took = time.perf_counter() - t0
    monkeypatch.setattr(torch, "empty", real_empty)
    assert took >= slow_s  # the slow allocation really happened inside this build
    assert builder.allocations == 1
    assert result.timed_out == [] and builder.timeouts == 0


def test_growing_batch_reallocates_logarithmically():
    builder = TreeMaskBuilder()
    for bs in range(1, 65):
        reqs, (nxt, sib, tok) = _batch(bs, seed=bs)
        result = builder.build(reqs, nxt, sib, tok, VOCAB)
        assert result.bitmask.shape[0] == bs * nxt.shape[1]
    # rows grow 4 -> 256: the buffer doubles (4, 8, 16, ..., 256 rows), never reallocated per new batch size
    assert builder.allocations == 7, builder.allocations
