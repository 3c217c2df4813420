"""TEST ONLY: put on PYTHONPATH by ``sglang_eo_dev.cpu_runtime.engine`` so every SGLang process of a CPU test run (also
the spawned scheduler/detokenizer) can import a CUDA-built torchvision against CPU torch. No-op unless
``SGLANG_EO_CPU_RUNTIME=1``."""

import os

if os.environ.get("SGLANG_EO_CPU_RUNTIME") == "1":
    try:
        from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

        install_import_hook()
    except Exception:  # never break interpreter start-up
        pass
