"""Fixtures for the CUDA engine tests (``@pytest.mark.cuda``; the root conftest skips them without a CUDA device).

They run the real SGLang engine on the GPU with the tiny local model pairs: no dev-package CPU shim is imported into
this process. The pairs are built by the dev package's model builder in a *subprocess* (its cache helper installs the
CPU venvs' torchvision shim, which must not touch a CUDA process). ``scripts/gpu/run.sh`` runs them on the offline
host; anywhere else with SGLang on CUDA: ``pytest -m cuda tests/gpu``.

Engines are expensive (CUDA graph capture), so :class:`GpuEnginePool` keeps at most one alive and swaps it only when
a test asks for another :class:`GpuConfig`; the plugin switch (``SGLANG_EAGLE_OVERLAP``) and its stats file are set
in the environment before each start, which the scheduler subprocess inherits.

Engine arguments come from ``benchmarks/gpu_engine_args.py`` (shared with the GPU benchmark; its field names are
checked against the installed ``ServerArgs`` on CPU by ``tests/test_gpu_engine_args.py``). Backends default to what
the offline host supports without flashinfer (``triton`` attention, ``pytorch`` sampling);
``SGLANG_EO_GPU_ATTENTION_BACKEND`` / ``SGLANG_EO_GPU_SAMPLING_BACKEND`` / ``SGLANG_EO_GPU_DTYPE`` override them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import pytest

from benchmarks.gpu_engine_args import gpu_engine_kwargs

ROOT = Path(__file__).resolve().parents[2]
STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
SWITCH_ENV = "SGLANG_EAGLE_OVERLAP"
SHAPES = {
    "topk1": {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
    "topk4": {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
}


def build_pair(kind: str) -> Dict[str, Any]:
    """``{"target", "draft", "vocab_size", "eos_token_id"}`` of a tiny local pair (``random`` or ``follower``), built
    (once, cached) by the dev package in a subprocess."""
    code = (
        "import json, sys; from sglang_eo_dev.cpu_runtime import models as m; "
        f"p = m.build_{kind}_pair(); "
        "print(json.dumps({'target': str(p.target), 'draft': str(p.draft), 'vocab_size': p.vocab_size, "
        "'eos_token_id': p.eos_token_id}))"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "dev"), str(ROOT), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the builder saves CPU tensors; keep it off the GPU
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode != 0:  # say why: the builder's own output, not only its exit status
        raise RuntimeError(f"building the {kind} pair failed (exit {out.returncode}):\n{out.stderr[-4000:]}"
                           f"\n{out.stdout[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    pair: str = "random"
    spec: Optional[str] = "topk1"  # None: no speculation
    plugin: bool = True
    extra: tuple = ()

    def describe(self) -> str:
        return f"{self.pair}-{self.spec or 'nospec'}-plugin-{'on' if self.plugin else 'off'}"


# The small-KV-pool server of test_small_kv_pool_retractions_next_to_aborts: 1536 tokens for 16 requests of up to
# 600 tokens forces retractions.
RETRACTION_CONFIG = GpuConfig(spec="topk1", plugin=True, extra=(("max_total_tokens", 1536),))


def engine_kwargs(cfg: GpuConfig, pair: Dict[str, Any]) -> Dict[str, Any]:
    """``sglang.Engine`` keyword arguments (also the server's flags) for ``cfg`` on ``pair``: 16 requests and decode
    CUDA graphs up to 16, 30 % of the GPU memory, 1024-token context."""
    return gpu_engine_kwargs(
        model_path=pair["target"],
        max_bs=16,
        draft_model_path=pair["draft"],
        spec=SHAPES[cfg.spec] if cfg.spec is not None else None,
        dtype=os.environ.get("SGLANG_EO_GPU_DTYPE", "bfloat16"),
        attention_backend=os.environ.get("SGLANG_EO_GPU_ATTENTION_BACKEND", "triton"),
        sampling_backend=os.environ.get("SGLANG_EO_GPU_SAMPLING_BACKEND", "pytorch"),
        mem_fraction_static=0.3,
        context_length=1024,
        extra=dict(cfg.extra),
    )


def server_flags(kwargs: Dict[str, Any]) -> list:
    """``python -m sglang.launch_server`` flags for engine keyword arguments (``True`` -> bare flag, ``False`` ->
    omitted)."""
    args: list = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            args += [flag] if v else []
        else:
            args += [flag, str(v)]
    return args


class GpuEnginePool:
    """At most one live in-process engine; ``get`` swaps it when the configuration changes."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pairs: Dict[str, Dict[str, Any]] = {}
        self.cfg: Optional[GpuConfig] = None
        self.engine: Any = None
        self.stats_file: Optional[str] = None

    def pair(self, kind: str) -> Dict[str, Any]:
        if kind not in self.pairs:
            self.pairs[kind] = build_pair(kind)
        return self.pairs[kind]

    def get(self, cfg: GpuConfig):
        if self.cfg == cfg:
            return self.engine
        self.close()
        pair = self.pair(cfg.pair)
        self.stats_file = str(self.tmp / f"stats-{cfg.describe()}.json")
        if os.path.exists(self.stats_file):
            os.remove(self.stats_file)
        os.environ[SWITCH_ENV] = "1" if cfg.plugin else "0"
        os.environ[STATS_ENV] = self.stats_file  # also with the plugin off: a file then means the switch failed
        import sglang

        self.engine = sglang.Engine(**engine_kwargs(cfg, pair))
        self.cfg = cfg
        return self.engine

    def stats(self) -> Dict[str, Any]:
        try:
            with open(self.stats_file or "", encoding="utf-8") as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.cfg = None, None
        os.environ.pop(STATS_ENV, None)
        os.environ.pop(SWITCH_ENV, None)


@pytest.fixture(scope="session")
def gpu_pool():
    with tempfile.TemporaryDirectory(prefix="sglang-eo-gpu-") as tmp:
        pool = GpuEnginePool(Path(tmp))
        try:
            yield pool
        finally:
            pool.close()
