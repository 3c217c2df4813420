"""Fixtures for the end-to-end tests that run the real SGLang engine on CPU (``@pytest.mark.engine``).

An engine start costs ~25-40 s on 2 cores, so engines are shared: :class:`EnginePool` keeps at most ONE engine alive
per session and swaps it only when a test asks for a different :class:`EngineConfig`. Test modules are ordered so each
configuration is started once. Results every module compares against (non-speculative greedy outputs) are cached in
the pool.

The whole directory is skipped, with the reason, when the interpreter has no SGLang or no CPU test runtime
(``scripts/setup_cpu_env.sh <version>`` builds one).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import pytest

_MISSING = [m for m in ("sglang", "sgl_kernel", "sglang_eo_cpu_runtime") if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config, items) -> None:
    if not _MISSING:
        return
    skip = pytest.mark.skip(
        reason=f"engine tests need SGLang and the CPU test runtime (missing: {', '.join(_MISSING)}); run with "
        "the python of a venv built by scripts/setup_cpu_env.sh <version>"
    )
    for item in items:
        if "engine" in item.keywords:
            item.add_marker(skip)


class EnginePool:
    """At most one live ``sglang.Engine``; ``get(cfg)`` returns it, restarting only when ``cfg`` changes."""

    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.cfg = None
        self.engine = None
        self.stats_file: Optional[str] = None
        self.cache: dict[Any, Any] = {}
        self.starts: list[tuple[str, float]] = []

    def get(self, cfg):
        if self.cfg == cfg and self.engine is not None:
            return self.engine
        self.close()
        import time

        from sglang_eo_cpu_runtime.engine import start_engine

        self.stats_file = os.path.join(self.tmp_dir, f"stats-{cfg.describe()}.json")
        t0 = time.monotonic()
        self.engine = start_engine(cfg, stats_file=self.stats_file)
        self.starts.append((cfg.describe(), time.monotonic() - t0))
        self.cfg = cfg
        return self.engine

    def stats(self) -> dict[str, Any]:
        from sglang_eo_cpu_runtime.stats import read_stats

        return read_stats(self.stats_file) if self.stats_file else {}

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
                self.cfg = None


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    pool = EnginePool(str(tmp_path_factory.mktemp("engines")))
    yield pool
    pool.close()
    if pool.starts:
        print("\n[engine starts] " + ", ".join(f"{name}: {secs:.0f}s" for name, secs in pool.starts))


@pytest.fixture(scope="session")
def sglang_version() -> tuple[int, ...]:
    from sglang_eo_cpu_runtime.plugin import sglang_version as v

    return v()
