"""Placeholders for the deep_gemm stand-in and its submodules.

A ``MagicMock`` per name, as in the recipe measured on the H200 (notes/gpu-runtime.md): the import-time uses SGLang
makes of deep_gemm (decorators, constants, ``from ... import`` lists) all accept one, and nothing on a Llama + EAGLE3
path calls it."""

from typing import Callable
from unittest.mock import MagicMock


def module_getattr(module: str) -> Callable[[str], MagicMock]:
    """A module-level ``__getattr__`` for ``module``; each public name resolves to one cached placeholder."""
    cache: dict = {}

    def __getattr__(name: str) -> MagicMock:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in cache:
            cache[name] = MagicMock(name=f"{module}.{name} (deep_gemm stand-in)")
        return cache[name]

    return __getattr__
