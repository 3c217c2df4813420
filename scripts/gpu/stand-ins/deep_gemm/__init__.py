"""Import stand-in for the offline CUDA host (scripts/gpu/run.sh puts it on PYTHONPATH only when no real deep_gemm is
installed). SGLang 0.5.16 imports deep_gemm while it captures the EAGLE draft's CUDA graphs (through the DSA attention
backend module); a Llama model never calls it. Every attribute is an inert placeholder (`_inert.py`)."""

from deep_gemm._inert import module_getattr

__getattr__ = module_getattr(__name__)
