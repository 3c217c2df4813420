"""The ``sglang.Engine`` keyword arguments of every GPU engine this project starts, built in one place.

Used by ``benchmarks/bench_gpu_constrained.py`` (``--device cuda``) and by the CUDA tests (``tests/gpu/conftest.py``);
``tests/test_gpu_engine_args.py`` checks on CPU, for the SGLang installed in each test venv, that every argument they
pass is a field of that SGLang's ``ServerArgs`` (``sglang.Engine(**kwargs)`` builds a ``ServerArgs`` and raises
``TypeError`` on any other name).

Per band, the name of the decode CUDA-graph batch-size limit is :data:`CUDA_GRAPH_MAX_BS_FIELD` (both 0.5.16 and
0.5.23 call it ``cuda_graph_max_bs_decode``; the shorter spelling is only a deprecated *command-line* alias there).

Pure: importing this module imports neither SGLang nor torch; :func:`server_arg_names` imports SGLang when called.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

__all__ = ["CUDA_GRAPH_MAX_BS_FIELD", "band", "cuda_graph_max_bs_field", "gpu_engine_kwargs", "installed_version",
           "server_arg_names", "unknown_args"]

# band -> the ServerArgs field that caps the batch sizes captured as decode CUDA graphs
CUDA_GRAPH_MAX_BS_FIELD: Dict[str, str] = {"0.5.16": "cuda_graph_max_bs_decode", "0.5.23": "cuda_graph_max_bs_decode"}


def installed_version() -> Tuple[int, ...]:
    """The installed SGLang's version as integers (``(0, 5, 16)``), from its distribution metadata (no import)."""
    from importlib.metadata import version

    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version("sglang").split(".")[:3])


def band(version: Tuple[int, ...]) -> str:
    """The supported band a version belongs to: ``"0.5.16"`` up to 0.5.16.x, ``"0.5.23"`` after."""
    return "0.5.16" if version < (0, 5, 17) else "0.5.23"


def cuda_graph_max_bs_field(version: Optional[Tuple[int, ...]] = None) -> str:
    """The decode CUDA-graph batch-size field of ``version`` (default: the installed SGLang)."""
    return CUDA_GRAPH_MAX_BS_FIELD[band(version if version is not None else installed_version())]


def gpu_engine_kwargs(
    *,
    model_path: str,
    max_bs: int,
    draft_model_path: Optional[str] = None,
    spec: Optional[Mapping[str, int]] = None,
    dtype: str = "bfloat16",
    attention_backend: Optional[str] = "triton",
    sampling_backend: Optional[str] = "pytorch",
    mem_fraction_static: float = 0.8,
    context_length: Optional[int] = None,
    dummy_weights: bool = False,
    disable_radix_cache: bool = False,
    version: Optional[Tuple[int, ...]] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Engine arguments for one GPU engine: EAGLE3 with ``spec`` (``speculative_num_steps`` / ``_eagle_topk`` /
    ``_num_draft_tokens``) when given, else no speculation; CUDA graphs captured up to ``max_bs`` decode requests,
    ``max_bs`` running requests; xgrammar with ``constrained_json_disable_any_whitespace`` (what the measured H200
    table ran: random-weight models otherwise write whitespace until the token limit); seed 0. ``None`` backends
    leave SGLang's default; ``extra`` is applied last (it may override anything)."""
    kw: Dict[str, Any] = dict(
        model_path=model_path,
        dtype=dtype,
        max_running_requests=max_bs,
        mem_fraction_static=mem_fraction_static,
        random_seed=0,
        grammar_backend="xgrammar",
        constrained_json_disable_any_whitespace=True,
        log_level="warning",
    )
    kw[cuda_graph_max_bs_field(version)] = max_bs
    if spec is not None:
        if not draft_model_path:
            raise ValueError("EAGLE3 needs draft_model_path")
        kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_model_path, **dict(spec))
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if sampling_backend:
        kw["sampling_backend"] = sampling_backend
    if context_length:
        kw["context_length"] = context_length
    if dummy_weights:
        kw["load_format"] = "dummy"
    if disable_radix_cache:
        kw["disable_radix_cache"] = True
    kw.update(dict(extra or {}))
    return kw


def server_arg_names() -> FrozenSet[str]:
    """The field names of the installed SGLang's ``ServerArgs`` (a dataclass on 0.5.16, a ``msgspec.Struct`` on
    0.5.23), read from the class: nothing is instantiated, no server starts. Imports SGLang (seconds)."""
    from sglang.srt.server_args import ServerArgs

    if dataclasses.is_dataclass(ServerArgs):
        return frozenset(f.name for f in dataclasses.fields(ServerArgs))
    import msgspec

    if isinstance(ServerArgs, type) and issubclass(ServerArgs, msgspec.Struct):
        return frozenset(f.name for f in msgspec.structs.fields(ServerArgs))
    raise TypeError(f"sglang ServerArgs is neither a dataclass nor a msgspec.Struct: {ServerArgs!r}; update "
                    "benchmarks/gpu_engine_args.py")


def unknown_args(kwargs: Mapping[str, Any], names: FrozenSet[str]) -> list:
    """The keys of ``kwargs`` that are not ``ServerArgs`` fields, sorted (empty when ``sglang.Engine`` takes them)."""
    return sorted(k for k in kwargs if k not in names)
