"""Stand-in for ``deep_gemm.utils`` (see the package docstring)."""

from deep_gemm._inert import module_getattr

__getattr__ = module_getattr(__name__)
