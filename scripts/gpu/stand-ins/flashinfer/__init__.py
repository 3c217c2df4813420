"""Import stand-in for the offline CUDA host (scripts/gpu/run.sh puts it on PYTHONPATH only when no real flashinfer is
installed). SGLang 0.5.16's sampler imports ``flashinfer.sampling`` unconditionally on CUDA; with
``--sampling-backend pytorch`` and ``SGLANG_IS_FLASHINFER_AVAILABLE=false`` nothing ever calls it."""
