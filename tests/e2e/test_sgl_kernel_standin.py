"""Unit tests of the CPU ``sgl_kernel`` stand-in against small hand-worked cases and a dense attention reference.

No engine is started; these run in a second. The e2e tests cover the same ops through SGLang's own callers.
"""

from __future__ import annotations


import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sgl_kernel") is None or importlib.util.find_spec("torch") is None,
    reason="needs the CPU test runtime's sgl_kernel stand-in (dev/, sglang_eo_dev.cpu_runtime) and torch",
)


def test_verify_tree_greedy_walks_first_matching_child():
    """Tree (node: draft token)::

        0:r ── 1:a ── 3:c
          └─── 2:b
    """
    import torch
    from sgl_kernel import verify_tree_greedy_cpu

    candidates = torch.tensor([[10, 11, 12, 13]])
    r_index = torch.tensor([[0, 1, 2, 3]])
    r_next = torch.tensor([[1, 3, -1, -1]])
    r_sib = torch.tensor([[-1, 2, -1, -1]])

    def run(target):
        predicts = torch.zeros(4, dtype=torch.int32)
        accept_index = torch.full((1, 3), -1, dtype=torch.int32)
        num = torch.zeros(1, dtype=torch.int32)
        verify_tree_greedy_cpu(
            predicts=predicts, accept_index=accept_index, accept_token_num=num, candidates=candidates,
            retrive_index=r_index, retrive_next_token=r_next, retrive_next_sibling=r_sib,
            target_predict=torch.tensor([target]),
        )
        return predicts.tolist(), accept_index.tolist(), int(num)

    # target after root is 12 (node 2, the second child); node 2 has no children -> bonus is target[2].
    assert run([12, 0, 99, 0]) == ([12, 0, 99, 0], [[0, 2, -1]], 1)
    # root -> 11 (node 1) -> 13 (node 3); bonus target[3].
    assert run([11, 13, 0, 77]) == ([11, 13, 0, 77], [[0, 1, 3]], 2)
    # nothing matches: only the bonus at the root.
    assert run([5, 0, 0, 0]) == ([5, 0, 0, 0], [[0, -1, -1]], 0)


def test_cache_location_bookkeeping():
    import torch
    from sgl_kernel import (
        assign_draft_cache_locs_contiguous_cpu,
        assign_extend_cache_locs_cpu,
        assign_req_to_token_pool_cpu,
        build_draft_decode_metadata_cpu,
        fill_accept_out_cache_loc_cpu,
        fill_bonus_tokens_cpu,
    )

    r2t = torch.zeros((3, 16), dtype=torch.int32)
    rpi = torch.tensor([2, 0])
    assign_req_to_token_pool_cpu(rpi, r2t, torch.tensor([1, 0]), torch.tensor([4, 2]), torch.tensor([7, 8, 9, 5, 6]), 16)
    assert r2t[2, :5].tolist() == [0, 7, 8, 9, 0] and r2t[0, :3].tolist() == [5, 6, 0]

    out = torch.empty(5, dtype=torch.int64)
    assign_extend_cache_locs_cpu(rpi, r2t, torch.tensor([1, 0]), torch.tensor([4, 2]), out, 16)
    assert out.tolist() == [7, 8, 9, 5, 6]

    r2t[1, :10] = torch.arange(100, 110, dtype=torch.int32)
    draft = torch.empty((1, 2, 3), dtype=torch.int64)  # topk 2, 3 steps
    assign_draft_cache_locs_contiguous_cpu(torch.tensor([1]), r2t, torch.tensor([2]), draft, 16, 2, 3)
    assert draft.view(-1).tolist() == [102, 103, 104, 105, 106, 107]

    meta = build_draft_decode_metadata_cpu(r2t, torch.tensor([1]), torch.tensor([2]), 2, 3, 16)
    assert meta[0, :5].tolist() == [100, 101, 102, 103, 104]  # prefix + branch 0's slots
    assert meta[1, :5].tolist() == [100, 101, 105, 106, 107]  # prefix + branch 1's slots

    bonus = torch.zeros(2, dtype=torch.int32)
    fill_bonus_tokens_cpu(torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [6, 10]

    acc = torch.zeros(4, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.tensor([40, 41, 42, 43]), acc)
    assert acc.tolist() == [40, 42, 43, 0]


def test_copy_all_layer_kv_cache_reads_sources_before_writing():
    import torch
    from sgl_kernel import copy_all_layer_kv_cache_cpu

    bufs = [torch.arange(12, dtype=torch.float32).view(6, 2), torch.arange(100, 118, dtype=torch.float32).view(6, 3)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    before = [b.clone() for b in bufs]
    # swap rows 1 and 2 (overlapping source/target sets), copy 0 -> 5
    copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([2, 1, 5]), torch.tensor([1, 2, 0]))
    for b, old in zip(bufs, before):
        assert torch.equal(b[2], old[1]) and torch.equal(b[1], old[2]) and torch.equal(b[5], old[0])



def _dense(q, k, v, visible, scale):
    import torch

    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.repeat_interleave(q.shape[1] // v.shape[1], 1))


def test_extend_attention_with_qlen_only_tree_mask_matches_dense_reference():
    import torch

    import sgl_kernel
    from sgl_kernel._attention import extend_attention

    torch.manual_seed(0)
    H, Hkv, D, P, E = 4, 2, 8, 5, 4
    kbuf, vbuf = torch.randn(32, Hkv, D), torch.randn(32, Hkv, D)
    r2t = torch.zeros((2, 32), dtype=torch.int32)
    r2t[1, : P + E] = torch.tensor([3, 9, 4, 11, 20, 21, 22, 23, 24], dtype=torch.int32)
    q = torch.randn(E, H, D)
    k_ext, v_ext = kbuf[[21, 22, 23, 24]].clone(), vbuf[[21, 22, 23, 24]].clone()
    # tree: 0 -> 1 -> 3, 0 -> 2 (row = query, column = visible draft token)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    o = torch.empty(E, H, D)
    extend_attention(q, k_ext, v_ext, o, kbuf, vbuf, r2t, torch.tensor([1]), torch.tensor([P + E]), torch.tensor([E]),
                     torch.tensor([0]), E, 0.3, 0.0, False, 0, None, None, tree.flatten())
    visible = torch.cat([torch.ones(E, P, dtype=torch.bool), tree], 1)
    idx = r2t[1, : P + E].long()
    ref = _dense(q, kbuf[idx], vbuf[idx], visible, 0.3)
    torch.testing.assert_close(o, ref)
    assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu") and sgl_kernel is not None


def test_decode_attention_writes_new_kv_then_attends():
    import torch

    from sgl_kernel._attention import decode_attention

    torch.manual_seed(1)
    H, Hkv, D = 4, 2, 8
    kbuf, vbuf = torch.randn(16, Hkv, D), torch.randn(16, Hkv, D)
    r2t = torch.zeros((1, 16), dtype=torch.int32)
    r2t[0, :4] = torch.tensor([2, 5, 7, 9], dtype=torch.int32)
    q, k_new, v_new = torch.randn(1, H, D), torch.randn(1, Hkv, D), torch.randn(1, Hkv, D)
    o = torch.empty(1, H, D)
    decode_attention(q, kbuf, vbuf, o, k_new, v_new, torch.tensor([9]), None, r2t, torch.tensor([0]), torch.tensor([4]),
                     0.5, 0.0, False, 0, None, None)
    assert torch.equal(kbuf[9], k_new[0]) and torch.equal(vbuf[9], v_new[0])
    idx = torch.tensor([2, 5, 7, 9])
    ref = _dense(q, kbuf[idx], vbuf[idx], torch.ones(1, 4, dtype=torch.bool), 0.5)
    torch.testing.assert_close(o, ref)


def test_reconstruct_indices_from_tree_mask_links_an_ngram_tree():
    """NGRAM's tree from its ancestor mask (row i marks root..i). Request 0, BFS-numbered::

        0 ── 1 ── 3
        └─── 2

    request 1 is a chain 0 ── 1 ── 2 ── 3.
    """
    import torch
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    tree = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    chain = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    mask = torch.tensor([tree, chain], dtype=torch.bool).flatten()
    seq = torch.tensor([10, 20])
    pos, ridx, nxt, sib = (torch.full((2, 4), -7, dtype=torch.int64) for _ in range(4))
    reconstruct_indices_from_tree_mask(mask, seq, pos, ridx, nxt, sib, 2, 4)
    assert pos.tolist() == [[10, 11, 11, 12], [20, 21, 22, 23]]
    assert ridx.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert nxt.tolist() == [[1, 3, -1, -1], [1, 2, 3, -1]]
    assert sib.tolist() == [[-1, 2, -1, -1], [-1, -1, -1, -1]]


def test_every_op_goes_through_the_kernel_hook_when_one_is_set():
    """The step probe (``step_times.TensorOpTimer.kernel``) times each stand-in op as one device op through
    ``_spec_ops.KERNEL_HOOK``: every public op routes there with its own function and arguments, and calls are plain
    again once the hook is cleared."""
    import sgl_kernel
    from sgl_kernel import _spec_ops

    seen = []

    def hook(fn, args, kwargs):
        seen.append(fn.__name__)
        return fn(*args, **kwargs)

    _spec_ops.KERNEL_HOOK[0] = hook
    try:
        for name in sgl_kernel.__all__:
            op = getattr(sgl_kernel, name)
            assert op.__wrapped__.__name__ == name  # functools.wraps: the hook gets the op itself
            try:
                op()  # wrong arguments: the op raises, but only after the hook handed the call over
            except TypeError:
                pass
        assert seen == list(sgl_kernel.__all__)
    finally:
        _spec_ops.KERNEL_HOOK[0] = None
    seen.clear()
    with pytest.raises(TypeError):
        sgl_kernel.fill_bonus_tokens_cpu()
    assert seen == []
