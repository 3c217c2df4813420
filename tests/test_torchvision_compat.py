"""The dev package's torchvision shim (``sglang_eo_dev.cpu_runtime.torchvision_compat``): it defines torchvision's
two operator schemas only where torchvision's own native library cannot load against this torch (the CPU venvs'
CUDA-built wheel). Where it can (a CUDA host), a second definition aborts the process in C++ (SIGABRT): the H200's
CUDA tests died of it. Each case runs in a fresh interpreter: operator registrations are process-wide."""

from __future__ import annotations

import subprocess
import sys

_PRELUDE = "import torch\nfrom sglang_eo_dev.cpu_runtime import torchvision_compat as t\n"
_NMS = "bool(torch._C._jit_get_schemas_for_operator('torchvision::nms'))"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PRELUDE + code], capture_output=True, text=True, timeout=300)


def test_the_shim_defines_nothing_when_torchvision_loads_its_own_operators():
    r = _run("t._load_torchvision_library = lambda: True\nt.define_torchvision_schemas()\n"
             f"print(t._LIB is None, {_NMS})")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "False"]  # no library made, no schema defined by the shim


def test_torchvision_imports_after_the_shim_whichever_defines_the_operators():
    """Here (the CPU venvs) torchvision's library does not load and the shim defines the schemas; with a torchvision
    built for this torch the library loads and the shim defines nothing. Either way torchvision then imports (a
    double definition would abort the interpreter) and ``nms`` is defined."""
    r = _run("loaded = t._load_torchvision_library()\nt.define_torchvision_schemas()\nimport torchvision\n"
             f"print(loaded, t._LIB is None, {_NMS})")
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    loaded, no_lib, nms = r.stdout.split()[-3:]
    assert loaded == no_lib and nms == "True"
