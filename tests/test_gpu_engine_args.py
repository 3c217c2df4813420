"""The GPU engines' arguments against the installed SGLang, on CPU (no engine starts, nothing is instantiated).

``sglang.Engine(**kwargs)`` builds a ``ServerArgs`` from its keyword arguments and raises ``TypeError`` on a name that
is not one of its fields, so a GPU run would fail at its first engine start. Here every argument set that the GPU
benchmark (``benchmarks/bench_gpu_constrained.py --device cuda``) and the CUDA tests (``tests/gpu``) build is checked
against the field names of the ``ServerArgs`` class installed in this venv (0.5.16: a dataclass; 0.5.23: a
``msgspec.Struct``); run in both venvs, that covers both bands. Both build their arguments with
``benchmarks/gpu_engine_args.py``; a source scan also catches the old ``cuda_graph_max_bs`` spelling written anywhere
else in the files that start GPU engines.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import List

import pytest

from benchmarks import gpu_engine_args as gea
from sglang_eo_dev.helpers.scripts import loaded_script
from tests.gpu.conftest import RETRACTION_CONFIG, SHAPES, GpuConfig, engine_kwargs, server_flags

ROOT = Path(__file__).resolve().parents[1]
OLD_FIELD = "cuda_graph_max_bs"  # SGLang's name before the decode/prefill split; no ServerArgs field on either band
# files that build arguments for a GPU engine or server
GPU_ENGINE_FILES = ["benchmarks/bench_gpu_constrained.py", "benchmarks/gpu_engine_args.py", "tests/gpu/conftest.py",
                    "tests/gpu/test_cuda_engine.py", "scripts/demo.py", "scripts/demo.sh", "scripts/gpu/run.sh"]


@pytest.fixture(scope="module")
def names():
    return gea.server_arg_names()


@pytest.fixture(scope="module")
def bench():
    yield from loaded_script(ROOT / "benchmarks" / "bench_gpu_constrained.py", "bench_gpu_constrained_args")


def test_the_installed_band_names_a_real_cuda_graph_field(names):
    assert gea.band((0, 5, 16)) == "0.5.16" and gea.band((0, 5, 16, 1)) == "0.5.16"
    assert gea.band((0, 5, 17)) == "0.5.23" and gea.band((0, 5, 23)) == "0.5.23"
    field = gea.cuda_graph_max_bs_field()
    assert field == gea.CUDA_GRAPH_MAX_BS_FIELD[gea.band(gea.installed_version())]
    assert field in names, f"{field} is not a ServerArgs field of SGLang {gea.installed_version()}"


def test_the_check_rejects_the_old_spelling(names):
    kw = gea.gpu_engine_kwargs(model_path="/m", max_bs=16, extra={OLD_FIELD: 16})
    assert gea.unknown_args(kw, names) == [OLD_FIELD]


@pytest.mark.parametrize("argv", [
    ["--shapes", "topk1,topk4", "--attention-backend", "triton", "--sampling-backend", "pytorch"],
    ["--shapes", "wide", "--shape", "wide=5,8,64", "--batch-sizes", "1,2", "--dtype", "float16"],
    ["--shapes", "topk1", "--model-path", "/target", "--draft-model-path", "/draft", "--context-length", "0"],
], ids=["table", "other-shape-default-backends", "real-pair"])
def test_every_gpu_benchmark_engine_argument_is_a_server_arg(names, bench, argv):
    args = bench.parse_args(["--device", "cuda", *argv])
    for shape in args.shape_list:
        kw = bench.gpu_engine_kwargs(args, shape, "/target", "/draft")
        assert gea.unknown_args(kw, names) == [], kw
        assert kw[gea.cuda_graph_max_bs_field()] == max(args.batch_sizes)


@pytest.mark.parametrize("cfg", [GpuConfig(spec=None, plugin=False)]
                         + [GpuConfig(spec=s, plugin=p) for s in SHAPES for p in (True, False)] + [RETRACTION_CONFIG],
                         ids=lambda c: c.describe() + ("-small-kv" if c.extra else ""))
def test_every_cuda_test_engine_argument_is_a_server_arg(names, cfg):
    kw = engine_kwargs(cfg, {"target": "/target", "draft": "/draft", "vocab_size": 4096, "eos_token_id": 1})
    assert gea.unknown_args(kw, names) == [], kw
    assert kw["constrained_json_disable_any_whitespace"] is True


def test_the_cuda_tests_server_command_line_parses(names):
    """The retraction test starts ``python -m sglang.launch_server`` with these flags: the installed SGLang's own
    argument parser (built, not run) takes them and maps each back to its field."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    kw = engine_kwargs(RETRACTION_CONFIG, {"target": "/target", "draft": "/draft"})
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(server_flags(kw))
    assert {k: getattr(ns, k) for k in kw} == kw


def _old_spellings(source: str, suffix: str) -> List[str]:
    """Where ``source`` names the old field: Python identifiers and string literals equal to it (keyword arguments,
    dict keys, ``setattr`` names), and in any file its command-line flag not followed by ``-decode``/``-prefill``."""
    hits = [f"flag at offset {m.start()}" for m in re.finditer(r"--cuda-graph-max-bs(?![-\w])", source)]
    if suffix != ".py":
        return hits
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string == OLD_FIELD:
            hits.append(f"name at line {tok.start[0]}")
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if value == OLD_FIELD:
                hits.append(f"string at line {tok.start[0]}")
    return hits


def test_the_source_scan_finds_each_spelling():
    assert len(_old_spellings("kw.update(cuda_graph_max_bs=16)\nd = {'cuda_graph_max_bs': 1}\n", ".py")) == 2
    assert _old_spellings("kw['cuda_graph_max_bs_decode'] = 1  # not cuda_graph_max_bs\n", ".py") == []
    assert len(_old_spellings("python x.py --cuda-graph-max-bs 16 --cuda-graph-max-bs-decode 8\n", ".sh")) == 1


@pytest.mark.parametrize("rel", GPU_ENGINE_FILES)
def test_no_gpu_engine_file_spells_the_old_field(rel):
    path = ROOT / rel
    assert _old_spellings(path.read_text(), path.suffix) == [], rel
