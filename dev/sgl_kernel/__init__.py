"""TEST ONLY: a stand-in for the CPU build of ``sgl_kernel`` (not on PyPI), in plain torch.

SGLang imports CPU ops from a top-level ``sgl_kernel`` when ``SGLANG_USE_CPU_ENGINE=1``. This package provides exactly
the ops the EAGLE v2 + ``intel_amx`` attention path calls, so the real engine runs on a CPU without the native kernels.
It deliberately does NOT define ``torch.ops.sgl_kernel.convert_weight_packed``: SGLang takes that op as the sign of a
full AMX kernel build and would then route linear layers through AMX-only kernels.

Installed only with the ``sglang-eo-cpu-runtime`` test distribution; never ship it next to a real ``sgl_kernel``.
"""

from sgl_kernel import _spec_ops
from sgl_kernel._attention import register_attention_ops
from sgl_kernel._spec_ops import *  # noqa: F401,F403 - the nine *_cpu ops, listed once in _spec_ops.__all__

__version__ = "0.0.0+eo-cpu-runtime"

__all__ = list(_spec_ops.__all__)

# Importing the real sgl_kernel registers its torch ops; the stand-in does the same for the two attention ops.
register_attention_ops()
