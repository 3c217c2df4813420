"""The plugin's native module for tests and benchmarks: built once per process into the default cache (outside the
clone), the same way a worker loads it. A build failure raises: tests that need the module fail, never skip."""

from __future__ import annotations

import functools

from sglang_eagle_overlap.core.native import NativeGrammar, load_native

__all__ = ["native"]


@functools.lru_cache(maxsize=None)
def native() -> NativeGrammar:
    return load_native()
