"""TEST ONLY: a stand-in for the CPU build of ``sgl_kernel`` (not on PyPI), in plain torch.

SGLang imports CPU ops from a top-level ``sgl_kernel`` when ``SGLANG_USE_CPU_ENGINE=1``. This package provides exactly
the ops the EAGLE v2 + ``intel_amx`` attention path calls, so the real engine runs on a CPU without the native kernels.
It deliberately does NOT define ``torch.ops.sgl_kernel.convert_weight_packed``: SGLang takes that op as the sign of a
full AMX kernel build and would then route linear layers through AMX-only kernels.

Installed only with the ``sglang-eo-cpu-runtime`` test distribution; never ship it next to a real ``sgl_kernel``.
"""

from sgl_kernel._attention import register_attention_ops
from sgl_kernel._spec_ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+eo-cpu-runtime"

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

# Importing the real sgl_kernel registers its torch ops; the stand-in does the same for the two attention ops.
register_attention_ops()
