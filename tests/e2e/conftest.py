"""Fixtures for the end-to-end tests that run the real SGLang engine on CPU (``@pytest.mark.engine``).

An engine start costs ~25-40 s on 2 cores, so engines are shared: :class:`EnginePool` keeps at most ONE engine alive
per session and swaps it only when a test asks for a different :class:`EngineConfig`. Test modules are ordered so each
configuration is started once: :data:`MODULE_ORDER` (applied in ``pytest_collection_modifyitems``) is that order,
so it does not depend on file names. Results every module compares against (non-speculative greedy outputs) are cached in
the pool.

The whole directory is skipped, with the reason, when the interpreter has no SGLang or no CPU test runtime
(``scripts/setup_cpu_env.sh <version>`` builds one).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import pytest

_MISSING = [m for m in ("sglang", "sgl_kernel", "sglang_eo_dev") if importlib.util.find_spec(m) is None]


# Engine modules in the order that starts each shared engine configuration once (the pool keeps one engine alive):
# in-process engines first, then the modules that start their own servers. Modules not listed run after these, in
# collection order.
MODULE_ORDER = (
    "test_spec_equivalence",
    "test_grammar_follower",
    "test_plugin_equivalence",
    "test_tp",  # TP 2 engines; reuses test_plugin_equivalence's TP 1 baseline from the pool
    # the speculative-algorithm tests: these four share one engine per configuration through algo_runs (results cached in the pool)
    "test_algorithms",
    "test_reasoning_grammar",
    "test_logprobs",
    "test_mixed_grammar_kinds",
    "test_llguidance",  # --grammar-backend llguidance: 3 engines of its own
    # the real pair (SmolLM2-135M-Instruct + trained EAGLE3 draft), 4 engines per version
    "test_real_model",
    "test_server",
    "test_operator_metrics_server",
    "test_faults",
    "test_patch_v0_5_23",
    "test_patch_v0_5_16",
    "test_demo",
)


def _module_rank(item) -> int:
    name = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)


def pytest_collection_modifyitems(config, items) -> None:
    e2e = [i for i in items if "/e2e/" in str(i.fspath).replace("\\", "/")]
    if e2e:
        first = items.index(e2e[0])
        ordered = sorted(e2e, key=_module_rank)  # stable: keeps collection order inside a module
        in_e2e = set(map(id, e2e))
        rest = [i for i in items if id(i) not in in_e2e]
        items[:] = rest[:first] + ordered + rest[first:]
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

        from sglang_eo_dev.cpu_runtime.engine import start_engine

        self.stats_file = os.path.join(self.tmp_dir, f"stats-{cfg.describe()}.json")
        t0 = time.monotonic()
        self.engine = start_engine(cfg, stats_file=self.stats_file)
        self.starts.append((cfg.describe(), time.monotonic() - t0))
        self.cfg = cfg
        return self.engine

    def get_with_plugin_stats(self, cfg, tag: str):
        """:meth:`get`, with the product plugin of a newly started engine writing its stats file to a fresh path
        (``SGLANG_EAGLE_OVERLAP_STATS_FILE``, read by the spawned scheduler when it starts and unset right after, so
        later engines never write there). Returns ``(engine, read_plugin_stats)``; the reader gives the file's JSON,
        or None if the plugin never wrote it."""
        import json

        path = os.path.join(self.tmp_dir, f"{tag}-plugin-stats-{cfg.describe()}.json")
        if os.path.exists(path):
            os.remove(path)
        os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = path
        try:
            engine = self.get(cfg)
        finally:
            os.environ.pop("SGLANG_EAGLE_OVERLAP_STATS_FILE", None)

        def read() -> Optional[dict[str, Any]]:
            if not os.path.exists(path):
                return None
            with open(path) as f:
                return json.load(f)

        return engine, read

    def stats(self) -> dict[str, Any]:
        from sglang_eo_dev.cpu_runtime.stats import read_stats

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
    from sglang_eo_dev.cpu_runtime.plugin import sglang_version as v

    return v()
