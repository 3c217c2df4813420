"""The pieces of ``scripts/gpu/`` that can run without a GPU host: the pinned package lists, list parsing and pruning
(``lib.sh``), the import stand-ins, and the scripts' syntax. The full archive build downloads ~460 MB of wheels, so
it is not run here (see ``scripts/gpu/build_archive.sh``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


def _bash(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'. "{GPU / "lib.sh"}"; {script}', "bash", *args],
                          capture_output=True, text=True)


def test_read_pins_drops_comments_and_rejects_unpinned(tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("# header\n\nsglang==0.5.16   # the engine\n  xgrammar==0.2.1\nfoo==1.0")  # no final newline
    r = _bash('read_pins "$1"', str(f))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["sglang==0.5.16", "xgrammar==0.2.1", "foo==1.0"]
    f.write_text("sglang==0.5.16\ntorch>=2.11\n")
    r = _bash('read_pins "$1"', str(f))
    assert r.returncode != 0 and "list.txt:2" in r.stderr and "not pinned" in r.stderr


@pytest.mark.parametrize("name", ["packages-0.5.16-py312.txt", "extra-0.5.16-py312.txt"])
def test_shipped_lists_are_fully_pinned_and_unique(name):
    r = _bash('read_pins "$1"', str(GPU / name))
    assert r.returncode == 0, r.stderr
    pins = r.stdout.split()
    names = [p.split("==")[0].lower().replace("_", "-") for p in pins]
    assert len(names) == len(set(names)), names
    assert "torch" not in names  # the host's own torch (2.11+cu130) must never be replaced


def test_package_list_has_what_the_engine_needs_and_nothing_the_image_has():
    pins = dict(p.split("==") for p in _bash('read_pins "$1"', str(GPU / "packages-0.5.16-py312.txt")).stdout.split())
    assert pins["sglang"] == "0.5.16" and pins["xgrammar"] == "0.2.1" and "sglang-kernel" in pins
    extra = dict(p.split("==") for p in _bash('read_pins "$1"', str(GPU / "extra-0.5.16-py312.txt")).stdout.split())
    assert extra == {"transformers": "5.12.1", "tokenizers": "0.22.2"}
    assert not {"torch", "triton", "numpy", "transformers", "tokenizers"} & set(pins)


def test_prune_site_drops_the_unused_kernels_and_keeps_the_rest(tmp_path):
    site = tmp_path / "site"
    keep = ["sgl_kernel/__init__.py", "sgl_kernel/sm90/common_ops.abi3.so", "sgl_kernel/spatial_ops.abi3.so",
            "xgrammar/__init__.py", "xgrammar/xgrammar_bindings.so", "sglang/srt/server_args.py",
            "zstandard/backend_c.cpython-312-x86_64-linux-gnu.so"]
    drop = ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm90/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
            "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so",
            "xgrammar/lib/libxgrammar.a", "bin/openai", "jedi/third_party/typeshed/stdlib/os.pyi",
            "sglang/__pycache__/version.cpython-312.pyc", "sglang/old.pyc",
            "zstandard/_cffi.cpython-312-x86_64-linux-gnu.so"]
    for rel in keep + drop:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x")
    r = _bash('prune_site "$1"', str(site))
    assert r.returncode == 0, r.stderr
    assert [k for k in keep if not (site / k).exists()] == []
    assert [d for d in drop if (site / d).exists()] == []
    assert not (site / "sgl_kernel" / "sm100").exists() and not (site / "sglang" / "__pycache__").exists()
    assert _bash('prune_site "$1"', str(tmp_path / "missing")).returncode != 0


def test_pip_platform_args_target_cpython_312_manylinux():
    args = _bash("pip_platform_args").stdout.split()
    assert args[:4] == ["--python-version", "3.12", "--implementation", "cp"]
    assert "--only-binary=:all:" in args and "manylinux_2_28_x86_64" in args and args[-1] == "any"


def test_scripts_parse():
    for script in ("build_archive.sh", "run.sh", "lib.sh"):
        r = subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)
        if script != "lib.sh":
            assert os.access(GPU / script, os.X_OK), script


def test_import_stand_ins_cover_what_sglang_imports(tmp_path):
    code = (
        "import deep_gemm, deep_gemm.utils.layout\n"
        "from deep_gemm import SymmBuffer, transform_sf_into_required_layout\n"
        "from deep_gemm.utils import align, get_tma_aligned_size\n"
        "from deep_gemm.utils.layout import get_mn_major_tma_aligned_tensor\n"
        "from flashinfer.sampling import min_p_sampling_from_probs, top_k_top_p_sampling_from_probs\n"
        "try:\n    top_k_top_p_sampling_from_probs(None)\nexcept RuntimeError as e:\n    print('raised', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(GPU / "stand-ins"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "raised" in r.stdout and "sampling-backend pytorch" in r.stdout
