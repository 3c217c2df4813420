"""Start the real SGLang engine / HTTP server on CPU with EAGLE3 + the overlap scheduler (TEST ONLY).

Both helpers use the same configuration: ``device="cpu"``, ``attention_backend="intel_amx"`` (kept on a CPU without
AMX by :mod:`.plugin`, attention ops from the ``sgl_kernel`` stand-in), float32, no CUDA graphs, a small KV pool and
context so a start takes ~25-40 s on 2 cores, greedy verification, xgrammar with
``constrained_json_disable_any_whitespace``. Speculative variants: ``topk1`` (topk 1, 3 steps, 4 draft tokens) and
``topk4`` (topk 4, 3 steps, 8 draft tokens); ``None`` runs without speculation.

Speculative algorithm (``EngineConfig.algorithm``): ``EAGLE3`` with the ``random`` / ``follower`` / ``noisy-follower``
/ ``soft-follower`` (:mod:`.soft_pair`) pairs and the real ``smollm2`` pair (SmolLM2-135M-Instruct + a locally trained EAGLE3 draft, :mod:`..real_model`: the chat-trained draft; ``smollm2-json`` runs the JSON-trained one); ``EAGLE`` (EAGLE-2 draft), ``STANDALONE`` (small Llama draft), ``NGRAM`` (no draft) with the ``think-follower``
Llama target; ``NEXTN`` with ``think-follower-mtp`` (a MiMo target whose MTP layer is the draft, draft path = target
path). ``reasoning_parser`` passes ``--reasoning-parser`` (the think-follower tokenizer has ``</think>``).
``tp_size`` > 1 runs tensor parallelism: one scheduler process per rank, gloo collectives (no AMX: SGLang's
shared-memory all-reduce kernel is not used), one CPU-runtime / plugin stats file per rank (``<stem>.rank<r><ext>``).

Environment every SGLang process needs (also the spawned scheduler): ``SGLANG_USE_CPU_ENGINE=1``,
``SGLANG_EO_CPU_RUNTIME=1`` (activates the test plugin), ``PYTHONPATH`` with ``_site/`` (torchvision shim at
interpreter start), ``SGLANG_EO_STATS_FILE`` (overlap counters), and ``SGLANG_EAGLE_OVERLAP=0`` to switch the product
plugin off. Only one engine should run at a time on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Literal, Optional

from sglang_eagle_overlap.settings import ENV
from sglang_eo_dev.cpu_runtime import models
from sglang_eo_dev.cpu_runtime.stats import STATS_ENV, read_stats

__all__ = [
    "Algorithm",
    "EngineConfig",
    "NGRAM_ARGS",
    "SPEC_VARIANTS",
    "THREADS_BIND_ENV",
    "apply_cpu_env",
    "cpu_env",
    "engine_kwargs",
    "free_port",
    "launch_server",
    "model_pair",
    "read_stats",
    "server_cli_args",
    "ServerProcess",
    "start_engine",
    "threads_bind",
]

SITE_DIR = str(Path(__file__).resolve().parent / "_site")

SpecVariant = Optional[Literal["topk1", "topk4"]]
Algorithm = Literal["EAGLE3", "EAGLE", "NEXTN", "STANDALONE", "NGRAM"]
PairName = Literal["random", "follower", "noisy-follower", "soft-follower", "think-follower", "think-follower-mtp",
                   "smollm2", "smollm2-json"]
# NGRAM: drafts come from a token trie over the prompts and outputs (no model); a tree of 8 draft tokens, breadth <= 2.
NGRAM_ARGS: dict[str, int] = {"speculative_num_draft_tokens": 8, "speculative_ngram_max_bfs_breadth": 2}
SPEC_VARIANTS: dict[str, dict[str, int]] = {
    "topk1": {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
    "topk4": {"speculative_num_steps": 3, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8},
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """One engine configuration; equal configs can share a running engine."""

    pair: PairName = "random"
    spec: SpecVariant = "topk1"
    algorithm: Algorithm = "EAGLE3"  # ignored when spec is None
    reasoning_parser: Optional[str] = None  # --reasoning-parser (e.g. "deepseek-r1" with the think-follower models)
    overlap: bool = True
    product_plugin: bool = False  # False sets SGLANG_EAGLE_OVERLAP=0 (the product plugin honours it)
    vocab_size: int = 4096
    max_running_requests: int = 8
    tp_size: int = 1  # > 1: one scheduler process per TP rank, collectives over gloo (see cpu_env)
    forced_drafts: Optional[bool] = None  # SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS for the product plugin (None: its default)
    grammar_thread: Optional[bool] = None  # SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD for the product plugin (None: its default)
    native: Optional[bool] = None  # SGLANG_EAGLE_OVERLAP_NATIVE for the product plugin (None: its default, auto)
    extra: tuple[tuple[str, Any], ...] = ()  # further sglang.Engine keyword arguments

    def describe(self) -> str:
        spec = f"{self.algorithm}-{self.spec}" if self.spec else "nospec"
        return (
            f"{self.pair}-{spec}-{'overlap' if self.overlap else 'sync'}"
            f"-{'product' if self.product_plugin else 'stock'}"
            + (f"-reasoning-{self.reasoning_parser}" if self.reasoning_parser else "")
            + (f"-tp{self.tp_size}" if self.tp_size > 1 else "")
            + ("" if self.forced_drafts is None else f"-forced{'on' if self.forced_drafts else 'off'}")
            + ("" if self.grammar_thread is None else f"-thread{'on' if self.grammar_thread else 'off'}")
            + ("" if self.native is None else f"-native{'on' if self.native else 'off'}")
        )


# Noise of the "noisy-follower" pair: its target follows the chain ~2/3 of the time, context-dependent otherwise.
NOISY_FOLLOWER_NOISE = 0.15


def model_pair(cfg: EngineConfig) -> models.ModelPair:
    """Target and draft paths for ``cfg`` (``draft`` is "" when the algorithm needs no draft model)."""
    if cfg.pair in ("think-follower", "think-follower-mtp"):
        return _think_pair(cfg)
    if cfg.pair in ("smollm2", "smollm2-json"):
        return _real_pair(cfg)
    if cfg.spec is not None and cfg.algorithm != "EAGLE3":
        raise ValueError(f"pair {cfg.pair!r} has an EAGLE3 draft only; algorithm {cfg.algorithm} needs a "
                         "think-follower pair")
    if cfg.pair == "follower":
        return models.build_follower_pair(cfg.vocab_size)
    if cfg.pair == "noisy-follower":
        return models.build_follower_pair(cfg.vocab_size, noise=NOISY_FOLLOWER_NOISE)
    if cfg.pair == "soft-follower":
        from sglang_eo_dev.cpu_runtime.soft_pair import build_soft_follower_pair

        return build_soft_follower_pair(vocab_size=cfg.vocab_size)
    if cfg.pair == "random":
        return models.build_random_pair(cfg.vocab_size)
    raise ValueError(f"unknown model pair {cfg.pair!r}; expected 'random', 'follower', 'noisy-follower' or "
                     "'soft-follower'")


def _real_pair(cfg: EngineConfig) -> models.ModelPair:
    """SmolLM2-135M-Instruct and its drafts (built once, cached; see :mod:`sglang_eo_dev.real_model`): EAGLE3 (trained
    locally: on general chat answers for ``smollm2``, on JSON answers for ``smollm2-json``), STANDALONE (a
    layer-truncated copy of the target, untrained), NGRAM (no draft model)."""
    if cfg.spec is not None and cfg.algorithm not in ("EAGLE3", "STANDALONE", "NGRAM"):
        raise ValueError(f"pair 'smollm2' has EAGLE3, STANDALONE and NGRAM drafts, not {cfg.algorithm}")
    from sglang_eo_dev.real_model.build import build_all

    paths = build_all("json" if cfg.pair == "smollm2-json" else "chat")
    draft = paths["eagle3"]
    if cfg.spec is not None and cfg.algorithm == "STANDALONE":
        from sglang_eo_dev.real_model.standalone import build_standalone

        draft = str(build_standalone(Path(paths["target"])))
    elif cfg.spec is not None and cfg.algorithm == "NGRAM":
        draft = ""
    cfgj = json.loads((Path(paths["target"]) / "config.json").read_text())
    return models.ModelPair(paths["target"], draft, int(cfgj["vocab_size"]), int(cfgj["eos_token_id"]))


def _think_pair(cfg: EngineConfig) -> models.ModelPair:
    m = models.build_think_follower_models(cfg.vocab_size)
    mtp = cfg.pair == "think-follower-mtp"
    target = m.mtp_target if mtp else m.target
    drafts = {"EAGLE": m.eagle_draft, "STANDALONE": m.standalone_draft, "NGRAM": ""}
    if cfg.spec is None:
        draft = ""
    elif mtp:
        if cfg.algorithm != "NEXTN":
            raise ValueError(f"think-follower-mtp runs NEXTN (its MTP layer is the draft), not {cfg.algorithm}")
        draft = m.mtp_target
    elif cfg.algorithm in drafts:
        draft = drafts[cfg.algorithm]
    else:
        raise ValueError(f"think-follower runs EAGLE, STANDALONE or NGRAM (NEXTN: think-follower-mtp), not "
                         f"{cfg.algorithm}")
    return models.ModelPair(target, draft, m.vocab_size, m.eos_token_id, m.chain)


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
FORCED_ENV = ENV["forced_drafts"]  # the product plugin's forced-draft switch (EngineConfig.forced_drafts)
PLUGIN_STATS_ENV = ENV["stats_file"]  # the product plugin's stats file (launch_server's plugin_stats_file)
THREAD_ENV = ENV["grammar_thread"]  # the product plugin's grammar-thread switch (EngineConfig.grammar_thread)
# the product plugin's native-module switch (EngineConfig.native); a literal fallback for older plugin revisions that
# benchmarks run side by side (bench_scheduler_budget --before), whose ENV has no such key
NATIVE_ENV = ENV.get("native", "SGLANG_EAGLE_OVERLAP_NATIVE")


def threads_bind(ranks: int, cores: Optional[int] = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` scheduler processes: rank r on core ``r % cores``.

    SGLang's CPU backend asks for one NUMA node per rank unless this variable lists a core set per rank
    (``numa_utils.init_threads_binding``; this machine has one node). Without AMX SGLang then binds nothing
    (``init_cpu_threads_env`` is AMX/arm64-only) and all-reduces over gloo instead of its shared-memory kernel, so the
    value only has to have one entry per rank."""
    cores = cores or os.cpu_count() or 1
    return "|".join(str(r % cores) for r in range(ranks))


def cpu_env(stats_file: Optional[str] = None, product_plugin: bool = False, ranks: int = 1,
            forced_drafts: Optional[bool] = None, grammar_thread: Optional[bool] = None,
            native: Optional[bool] = None) -> dict[str, str]:
    """The environment variables (to add to ``os.environ``) an SGLang CPU test process needs; ``ranks`` > 1 (TP)
    adds :data:`THREADS_BIND_ENV` (:func:`threads_bind`); ``forced_drafts`` / ``grammar_thread`` / ``native`` set the
    plugin's forced-draft / grammar-thread / native-module switch (None: unset, the plugin's default)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SITE_DIR not in paths:
        paths.insert(0, SITE_DIR)
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_EO_CPU_RUNTIME": "1",
        "PYTHONPATH": os.pathsep.join(paths),
        "SGLANG_EAGLE_OVERLAP": "1" if product_plugin else "0",
        # 2 cores: keep torch from oversubscribing when engine, scheduler and test share them.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    if stats_file:
        env[STATS_ENV] = str(stats_file)
    if ranks > 1:
        env[THREADS_BIND_ENV] = threads_bind(ranks)
    for var, value in ((FORCED_ENV, forced_drafts), (THREAD_ENV, grammar_thread), (NATIVE_ENV, native)):
        if value is not None:
            env[var] = "1" if value else "0"
    return env


def apply_cpu_env(stats_file: Optional[str] = None, product_plugin: bool = False, ranks: int = 1,
                  forced_drafts: Optional[bool] = None, grammar_thread: Optional[bool] = None,
                  native: Optional[bool] = None) -> None:
    """Put :func:`cpu_env` into ``os.environ`` (SGLang's spawned subprocesses inherit it), drop what an earlier
    configuration set and this one does not, and make the torchvision shim active in this process."""
    env = cpu_env(stats_file, product_plugin, ranks, forced_drafts, grammar_thread, native)
    os.environ.update(env)
    for var in (FORCED_ENV, THREAD_ENV, NATIVE_ENV, STATS_ENV, THREADS_BIND_ENV):  # set only by some configurations
        if var not in env:
            os.environ.pop(var, None)
    from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

    install_import_hook()


def engine_kwargs(cfg: EngineConfig, pair: Optional[models.ModelPair] = None) -> dict[str, Any]:
    pair = pair or model_pair(cfg)
    kw: dict[str, Any] = dict(
        model_path=pair.target,
        device="cpu",
        attention_backend="intel_amx",
        dtype="float32",
        disable_cuda_graph=True,
        max_total_tokens=4096,
        max_running_requests=cfg.max_running_requests,
        context_length=1024,
        mem_fraction_static=0.05,
        random_seed=0,
        grammar_backend="xgrammar",
        constrained_json_disable_any_whitespace=True,
        disable_overlap_schedule=not cfg.overlap,
        log_level="warning",
    )
    if cfg.spec is not None and cfg.algorithm == "NGRAM":
        # NGRAM's memory check counts the machine's free memory before the model load against this fraction (0.05
        # failed when other processes held memory); the pool itself stays max_total_tokens.
        kw.update(speculative_algorithm="NGRAM", mem_fraction_static=0.3, **NGRAM_ARGS)
    elif cfg.spec is not None:
        kw.update(speculative_algorithm=cfg.algorithm, speculative_draft_model_path=pair.draft,
                  **SPEC_VARIANTS[cfg.spec])
    if cfg.reasoning_parser:
        kw.update(reasoning_parser=cfg.reasoning_parser)
    if cfg.tp_size > 1:
        kw.update(tp_size=cfg.tp_size)
    kw.update(dict(cfg.extra))
    return kw


def start_engine(cfg: EngineConfig, stats_file: Optional[str] = None):
    """Start an in-process ``sglang.Engine``. The caller must run under ``if __name__ == "__main__"`` or pytest (the
    scheduler is spawned) and call ``.shutdown()``."""
    apply_cpu_env(stats_file, cfg.product_plugin, cfg.tp_size, cfg.forced_drafts, cfg.grammar_thread, cfg.native)
    if stats_file:
        from sglang_eagle_overlap.core.stats import rank_stats_path

        for path in {rank_stats_path(stats_file, r, cfg.tp_size) for r in range(cfg.tp_size)} | {stats_file}:
            if os.path.exists(path):
                os.remove(path)
    pair = model_pair(cfg)
    import sglang

    return sglang.Engine(**engine_kwargs(cfg, pair))


def server_cli_args(cfg: EngineConfig, port: int, pair: Optional[models.ModelPair] = None) -> list[str]:
    """``python -m sglang.launch_server`` arguments equivalent to :func:`engine_kwargs`."""
    args = ["--host", "127.0.0.1", "--port", str(port)]
    for key, value in engine_kwargs(cfg, pair).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
        else:
            args += [flag, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    stats_file: Optional[str]
    plugin_stats_file: Optional[str] = None  # the product plugin's stats file (launch_server's plugin_stats_file)

    def stats(self) -> dict[str, Any]:
        return read_stats(self.stats_file) if self.stats_file else {}

    def plugin_stats(self) -> dict[str, Any]:
        """The product plugin's last stats (empty dict when it has not written any, or none was asked for)."""
        return read_stats(self.plugin_stats_file) if self.plugin_stats_file else {}

    def get_json(self, path: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as r:
            return json.loads(r.read().decode())

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)


def launch_server(
    cfg: EngineConfig, log_path: str, stats_file: Optional[str] = None, timeout: float = 240,
    plugin_stats_file: Optional[str] = None,
) -> ServerProcess:
    """Run ``python -m sglang.launch_server`` in its own process group and wait until it answers a generate.
    ``plugin_stats_file``: the product plugin's stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``, set for the server's
    processes only), read with :meth:`ServerProcess.plugin_stats`."""
    pair = model_pair(cfg)
    port = free_port()
    env = dict(os.environ)
    env.update(cpu_env(stats_file, cfg.product_plugin, cfg.tp_size, cfg.forced_drafts, cfg.grammar_thread, cfg.native))
    if cfg.tp_size <= 1:
        env.pop(THREADS_BIND_ENV, None)
    if not stats_file:
        env.pop(STATS_ENV, None)
    elif os.path.exists(stats_file):
        os.remove(stats_file)
    if plugin_stats_file:
        env[PLUGIN_STATS_ENV] = plugin_stats_file
        if os.path.exists(plugin_stats_file):
            os.remove(plugin_stats_file)
    cmd = [sys.executable, "-m", "sglang.launch_server", *server_cli_args(cfg, port, pair), "--skip-server-warmup"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path, stats_file, plugin_stats_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health_generate", timeout=20) as r:
                if r.status == 200:
                    return server
        except Exception:
            time.sleep(1.0)
    server.stop()
    raise TimeoutError(f"sglang.launch_server did not become healthy in {timeout} s:\n{server.log_tail()}")
