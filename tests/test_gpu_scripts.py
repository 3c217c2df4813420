"""The pieces of ``scripts/gpu/`` that can run without a GPU host: the pinned package lists, list parsing and pruning
(``lib.sh``), the import stand-ins, the scripts' syntax, and ``run.sh``'s sub-commands (``DRY_RUN=1`` prints the
command each would run: checked against the benchmark's own argument parser and the CUDA test functions; ``merge``
runs for real, it needs no GPU). The full archive build downloads ~460 MB of wheels, so it is not run here (see
``scripts/gpu/build_archive.sh``)."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from sglang_eo_dev.helpers.scripts import loaded_script

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
            "sglang/srt/constrained/llguidance_backend.py", "_soundfile_data/libsndfile_x86_64.so",
            "zstandard/backend_c.cpython-312-x86_64-linux-gnu.so"]
    drop = ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm90/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
            "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so",
            "xgrammar/lib/libxgrammar.a", "bin/openai", "jedi/third_party/typeshed/stdlib/os.pyi",
            "sglang/__pycache__/version.cpython-312.pyc", "sglang/old.pyc",
            "zstandard/_cffi.cpython-312-x86_64-linux-gnu.so", "sglang/multimodal_gen/__init__.py",
            "llguidance/__init__.py", "llguidance-1.3.0.dist-info/METADATA", "datasets/__init__.py",
            "multiprocess/__init__.py", "Cryptodome/__init__.py"]
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


def _run_sh(*args: str, dry: bool = True, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    # without the plugin's switches of this process: a dry run prints those set for the call in front of its command
    call_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EAGLE_OVERLAP")}
    call_env.update(PYTHON=sys.executable, DRY_RUN="1" if dry else "0", **(env or {}))
    return subprocess.run(["bash", str(GPU / "run.sh"), *args], capture_output=True, text=True, env=call_env, cwd=ROOT)


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_gpu_constrained.py", "bench_gpu_constrained_run_sh")


@pytest.mark.parametrize("sub, extra, shapes, workload", [
    ("bench-topk1", [], ["topk1"], "dummy-8b-json"),
    ("bench-paths", [], ["topk1", "topk4"], "dummy-8b-json"),
    ("bench-topk4", ["--", "--rounds", "3"], ["topk4"], "dummy-8b-json"),
    ("bench-workload", ["dummy-8b-json", "topk4"], ["topk4"], "dummy-8b-json"),
    ("bench-workload", ["dummy-8b-json"], ["topk1"], "dummy-8b-json"),
    ("bench-stock", ["topk4"], ["topk4"], "dummy-8b-json"),
])
def test_bench_sub_commands_run_one_shape_into_the_named_folder(bench, tmp_path, sub, extra, shapes, workload):
    r = _run_sh(sub, str(tmp_path / "out"), *extra)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(r.stdout)
    assert cmd[:2] == [sys.executable, "benchmarks/bench_gpu_constrained.py"]
    args = bench.parse_args(cmd[2:])  # the benchmark's own parser accepts exactly what run.sh passes
    assert args.device == "cuda" and args.out == str(tmp_path / "out")
    assert [s.name for s in args.shape_list] == shapes and args.workload == workload
    assert (args.attention_backend, args.sampling_backend) == ("triton", "pytorch")  # no flashinfer on the host
    rounds = 3 if "--rounds" in extra else 1 if sub == "bench-paths" else 2  # bench-paths: one slot for both shapes
    assert args.rounds == rounds and args.batch_sizes == [1, 8, 32, 64]
    # the table's calls put the default path, unconstrained, stock and the inline path side by side in one run
    # (topk 4 leaves stock to its own call: its slow steps would not fit the 10 minutes)
    table = {"bench-topk1": ["json", "unconstrained", "json-off", "json-inline"],
             "bench-topk4": ["json", "unconstrained", "json-inline"],
             "bench-paths": ["json", "unconstrained", "json-inline"],
             "bench-stock": ["json-off"]}.get(sub, list(bench.DEFAULT_VARIANTS))
    assert args.variant_list == table


@pytest.mark.parametrize("upload_ab", [False, True], ids=["table", "with-upload-ab"])
def test_bench_table_is_three_parts_then_one_merge(bench, tmp_path, upload_ab):
    """``bench-table``: the default path with unconstrained (both shapes), stock topk 1 and the inline path topk 1,
    each one round into its own folder under OUT (extra arguments reach every part), then one merge of those three
    into OUT; ``TABLE_UPLOAD_AB=1`` adds, last and unmerged, the topk 4 default path with the mask upload on the
    verify's stream."""
    out = tmp_path / "out"
    r = _run_sh("bench-table", str(out), "--", "--batch-sizes", "1,8",
                env={"TABLE_UPLOAD_AB": "1" if upload_ab else "0"})
    assert r.returncode == 0, r.stderr
    lines = [shlex.split(line) for line in r.stdout.splitlines()]
    assert len(lines) == (5 if upload_ab else 4)
    parts = []
    for cmd in lines[:-1]:
        env = [a for a in cmd if a.startswith("SGLANG_EAGLE_OVERLAP")]
        cmd = cmd[len(env):]
        assert cmd[:2] == [sys.executable, "benchmarks/bench_gpu_constrained.py"]
        args = bench.parse_args(cmd[2:])
        assert args.device == "cuda" and args.rounds == 1 and args.batch_sizes == [1, 8]
        parts.append((args.out, args.variant_list, [s.name for s in args.shape_list], env))
    table = [(str(out / "on"), ["json", "unconstrained"], ["topk1", "topk4"], []),
             (str(out / "stock"), ["json-off"], ["topk1"], []),
             (str(out / "inline"), ["json-inline"], ["topk1"], [])]
    upload0 = [(str(out / "upload0"), ["json", "unconstrained"], ["topk4"],
                ["SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM=0"])]
    assert parts == table + (upload0 if upload_ab else [])
    # the merged table holds the default path, stock and inline: the upload A/B stays in its own folder
    assert lines[-1][-5:] == ["merge", str(out), str(out / "on"), str(out / "stock"), str(out / "inline")]


def test_cuda_test_sub_commands_split_the_cuda_tests_between_them(tmp_path):
    """``tests-greedy`` and ``tests-other`` together select every test function of ``tests/gpu``, each once, and
    write their junit xml into the named folder."""
    engine_tests = ROOT / "tests" / "gpu" / "test_cuda_engine.py"
    functions = [n.name for n in ast.parse(engine_tests.read_text()).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    assert sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")) == ["test_cuda_engine.py"]
    greedy = shlex.split(_run_sh("tests-greedy", str(tmp_path)).stdout)
    other = shlex.split(_run_sh("tests-other", str(tmp_path), "--", "-x").stdout)
    assert greedy[:3] == [sys.executable, "-m", "pytest"] and other[:3] == greedy[:3]
    assert "tests/core/test_tree_copy.py" in greedy and (ROOT / "tests" / "core" / "test_tree_copy.py").exists()
    picked = [a.split("::")[1] for a in greedy if a.startswith("tests/gpu/test_cuda_engine.py::")]
    assert picked and all(f in functions for f in picked)
    k = other[other.index("-k") + 1]
    assert k == "not greedy" and "tests/gpu/test_cuda_engine.py" in other and other[-1] == "-x"
    by_other = [f for f in functions if "greedy" not in f]
    assert sorted(picked + by_other) == sorted(functions) and not set(picked) & set(by_other)
    assert greedy[greedy.index("--junitxml") + 1] == str(tmp_path / "tests-greedy.xml")
    assert other[other.index("--junitxml") + 1] == str(tmp_path / "tests-other.xml")
    # a call cut short by its time limit still shows each test's start (-v) and every thread's stack (faulthandler)
    for cmd in (greedy, other):
        assert "-v" in cmd and cmd[cmd.index("-o") + 1] == "faulthandler_timeout=200", cmd


@pytest.mark.parametrize("args, message", [
    ([], "SUBCOMMAND OUT"),
    (["bench-topk1"], "name an output folder"),
    (["bench-topk1", "--", "--rounds", "1"], "name an output folder"),
    (["bench-workload", "/tmp/x"], "name the workload"),
    (["bench-stock", "/tmp/x"], "name the shape"),
    (["merge", "/tmp/x"], "name the result folders"),
    (["all", "/tmp/x"], "unknown sub-command 'all'"),
])
def test_run_sh_refuses_incomplete_calls(args, message):
    r = _run_sh(*args)
    assert r.returncode == 2 and message in r.stderr and r.stdout == ""


def test_usage_lists_every_sub_command():
    usage = _run_sh().stderr
    source = (GPU / "run.sh").read_text()
    accepted = source.split('case "$mode" in', 1)[1].split(")", 1)[0].strip().split("|")
    assert accepted == ["check", "tests-greedy", "tests-other", "bench-paths", "bench-table", "bench-topk1", "bench-topk4", "bench-stock",
                        "bench-workload", "merge"]
    for sub in accepted + ["env"]:
        assert f"  {sub} " in usage, sub


def test_merge_joins_the_runs_of_two_device_calls(bench, tmp_path):
    """Two one-shape results (what ``bench-topk1`` / ``bench-topk4`` write) become one table with both shapes; the
    merge runs for real (no GPU, no engine)."""
    def cell(ms):
        rec = [[ms, 0.0, 1.0, 8, 1.0]]
        return bench.summarize_cell([{"ms_step": ms, "n_steps": 1, "steps": rec, "accept_len": 1.0,
                                      "full_batch": True, "requests": 8}], [])

    machine = {"device": "cuda", "device_name": "H200", "cpus": 16, "sglang": "0.5.16", "xgrammar": "0.2.1",
               "torch": "2.11", "python": "3.12"}
    for i, (shape, ms) in enumerate((("topk1", 10.0), ("topk4", 20.0))):
        cells = {(shape, 8, v): cell(ms * f) for v, f in (("json", 1.1), ("unconstrained", 1.0), ("json-off", 2.0))}
        result = {"command": f"run {shape}", "machine": machine, "workload": "dummy-8b-json", "model": "m",
                  "shapes": [{"name": shape}], "batch_sizes": [8], "max_new_tokens": 160, "rounds": 1, "repeats": 1,
                  "wall_s": 100.0, "rows": bench.table_rows(cells, [shape], [8]), "engines": [], "raw": [],
                  "problems": []}
        d = tmp_path / f"call{i}"
        d.mkdir()
        (d / bench.result_name("cuda", "0.5.16", "dummy-8b-json", [shape])).with_suffix(".json").write_text(
            json.dumps(result))
    r = _run_sh("merge", str(tmp_path / "table"), str(tmp_path / "call0"), str(tmp_path / "call1"), dry=False)
    assert r.returncode == 0, r.stderr + r.stdout
    merged = json.loads((tmp_path / "table" / "gpu_constrained_cuda_0.5.16_merged.json").read_text())
    assert [(row["shape"], row["bs"]) for row in merged["rows"]] == [("topk1", 8), ("topk4", 8)]
    assert merged["commands"] == ["run topk1", "run topk4"] and merged["problems"] == []
    md = (tmp_path / "table" / "gpu_constrained_cuda_0.5.16_merged.md").read_text()
    assert "| topk1 | 8 | 10.00" in md and "| topk4 | 8 | 20.00" in md and "`run topk1`; `run topk4`" in md


def test_env_puts_the_dev_package_on_the_path_but_never_dev_itself(tmp_path):
    """The CUDA tests import ``sglang_eo_dev``: ``run.sh`` (``env``, as for ``tests-*``) puts a folder holding only a
    link to it on ``PYTHONPATH``, after the checkout and the archive, and never ``dev/`` (its CPU ``sgl_kernel``
    stand-in would shadow the real kernels). Runs for real on a one-file archive (no GPU needed)."""
    archive, site = tmp_path / "archive", tmp_path / "site"
    (archive / "payload").mkdir(parents=True)
    (archive / "payload" / "marker.txt").write_text("x")
    subprocess.run(f"tar -C '{archive / 'payload'}' -c marker.txt | xz -1 > '{archive / 'site.tar.xz'}'",
                   shell=True, check=True)
    env = dict(os.environ, PYTHON=sys.executable, DRY_RUN="0", ARCHIVE_DIR=str(archive), SITE=str(site))
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", str(GPU / "run.sh"), "env"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("export PYTHONPATH="))
    paths = shlex.split(line.split("=", 1)[1])[0].split(":")
    assert paths[:2] == [str(ROOT), str(site)] and (site / "marker.txt").exists()
    assert str(ROOT / "dev") not in paths
    links = [Path(p) / "sglang_eo_dev" for p in paths if (Path(p) / "sglang_eo_dev").is_symlink()]
    assert len(links) == 1 and links[0].resolve() == (ROOT / "dev" / "sglang_eo_dev").resolve()
    assert sorted(x.name for x in links[0].parent.iterdir()) == ["sglang_eo_dev"]  # nothing else rides along
