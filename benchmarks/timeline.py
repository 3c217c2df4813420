"""Overlap timeline of the grammar work per EAGLE3 verify step, and a TPOT prediction per batch size.

Two steps:

``run`` (one per venv; starts the real SGLang engine on CPU twice: stock SGLang, then with the plugin)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python benchmarks/timeline.py run
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/timeline.py run

Each engine (CPU test runtime, "json-follower" tiny model pair, EAGLE3 topk 1 / 3 steps / 4 draft tokens, overlap
scheduler on) decodes, per batch size in ``--batch-sizes``, a batch of FOLLOWER_SCHEMA-constrained requests and the
same batch unconstrained (the follower writes the same tokens either way, so both batches take the same steps). The
scheduler records every step's phases (:mod:`sglang_eagle_overlap.core.timeline`; stock paths through the CPU
runtime's test-only :mod:`sglang_eo_dev.cpu_runtime.timeline_probe`). Writes
``benchmarks/results/timeline_<sglang>_<stock|plugin>.json``.

``plot`` (any python with matplotlib; no engine)::

    .venvs/sglang-0.5.23/bin/python benchmarks/timeline.py plot

merges those JSONs into ``timeline.png`` (one measured step per path, phases relative to the verify launch),
``timeline_tpot.png`` + ``timeline.md`` (predicted TPOT for batch sizes 1-64, the model check against the CPU engine)
and ``timeline.json``.

What a CPU engine can and cannot show: its "GPU" forward runs synchronously inside the launch call, so the measured
timeline shows the CPU phases and where they sit relative to the launch and the sampling, but no real overlap. The
prediction replaces the forward by a GPU verify-time model (:class:`GpuModel`, defaults from published H100
Llama-3.1-8B + EAGLE3 numbers) and the grammar costs by measured per-step costs at a 32k vocabulary
(``benchmarks/results/grammar_step.json``). Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from sglang_eagle_overlap.core.timeline import (  # noqa: E402
    GRAMMAR_PHASES,
    TIMELINE_ENV,
    group_steps,
    load_events,
    median_or_none,
    step_periods,
)

PATHS = {  # (sglang minor band, plugin) -> label, how its grammar work is scheduled
    ("0.5.16", False): ("SGLang 0.5.16, no plugin (forced sync)", "sync", "sglang_ms"),
    ("0.5.16", True): ("SGLang 0.5.16 + plugin", "overlap", "lockstep1_ms"),
    ("0.5.23", False): ("SGLang 0.5.23 upstream overlap", "overlap", "sglang_ms"),
    ("0.5.23", True): ("SGLang 0.5.23 + plugin", "overlap", "lockstep1_ms"),
}
PHASE_COLORS = {"advance": "tab:orange", "tree_wait": "tab:purple", "mask_build": "tab:red", "mask_upload": "tab:brown",
                "mask_apply": "tab:gray"}
LANES = ("forward", *GRAMMAR_PHASES, "mask_apply")


# -- prediction model -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuModel:
    """Per-step GPU time of Llama-3.1-8B + EAGLE3 on one H100 (bf16), as a function of the batch size.

    * ``decode_ms`` 6.32: one memory-bound target forward at bs 1 = 1 / 158.34 tok/s, SGLang without speculation on
      1x H100, Llama-3.1-8B-Instruct, MT-bench (SGLang docs, "Speculative Decoding" performance table,
      https://docs.sglang.ai/advanced_features/speculative_decoding.html). A verify forward of a few tokens per request
      reads the same weights, so it costs the same until it becomes compute-bound.
    * ``per_token_us`` 32.5: compute-bound cost per verified token = 2 x 8.03e9 FLOP / (989 TFLOP/s dense bf16, H100
      SXM datasheet, x 0.5 achieved utilisation).
    * ``draft_step_ms`` 0.35 per draft step (3 steps): one EAGLE3 head layer (1/32 of the target's layers) plus its
      lm_head over the draft vocabulary and launch overheads -- an estimate, not a published figure.
    * ``accept_len`` 2.86: EAGLE3, Llama-3.1-8B, JSON Mode Eval, draft length 3 (NVIDIA TensorRT-LLM blog on guided
      decoding + speculative decoding, quoted in notes/landscape.md).

    Check: with these defaults bs 1 unconstrained predicts 1000 / ((6.32 + 3 x 0.35) / 2.86) = 388 tok/s against the
    373.25 tok/s SGLang publishes for EAGLE3 on the same model and GPU (MT-bench, its own draft settings).
    """

    decode_ms: float = 6.32
    per_token_us: float = 32.5
    draft_steps: int = 3
    draft_step_ms: float = 0.35
    draft_tokens: int = 4
    accept_len: float = 2.86

    def verify_ms(self, bs: int) -> float:
        return max(self.decode_ms, bs * self.draft_tokens * self.per_token_us / 1e3)

    def draft_ms(self, bs: int) -> float:
        return self.draft_steps * self.draft_step_ms


def interpolate(points: Sequence[Tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), linear extrapolation past the ends."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    if x <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif x >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(pts, pts[1:]) if a[0] <= x <= b[0])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def step_ms(mode: str, gpu: GpuModel, bs: int, grammar_ms: float, serial_ms: float = 0.0) -> float:
    """One decode step. ``sync``: the grammar work runs after the forward (forced sync: forward + grammar).
    ``overlap``: it runs under the verify forward; only what exceeds it, plus ``serial_ms`` (work that cannot start
    before the forward is ready), delays sampling: max(verify, grammar) + serial."""
    if mode == "sync":
        return gpu.draft_ms(bs) + gpu.verify_ms(bs) + grammar_ms + serial_ms
    if mode == "overlap":
        return gpu.draft_ms(bs) + max(gpu.verify_ms(bs), grammar_ms) + serial_ms
    raise ValueError(f"mode must be 'sync' or 'overlap', got {mode!r}")


def predict(cost_points: Dict[str, List[Tuple[float, float]]], gpu: GpuModel, batch_sizes: Iterable[int],
            serial_ms: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """TPOT (ms per output token) per path and batch size, and the first bs at which grammar is no longer hidden.

    ``cost_points[key]``: (bs, grammar ms per step) measured for that cost source (``sglang_ms`` / ``lockstep1_ms``).
    """
    serial_ms = serial_ms or {}
    out: Dict[str, Any] = {"batch_sizes": list(batch_sizes), "paths": {}}
    for (ver, plugin), (label, mode, cost_key) in PATHS.items():
        key = f"{ver}-{'plugin' if plugin else 'stock'}"
        rows = []
        first_unhidden = None
        for bs in out["batch_sizes"]:
            g = max(0.0, interpolate(cost_points[cost_key], bs))
            s = step_ms(mode, gpu, bs, g, serial_ms.get(key, 0.0))
            hidden = mode == "overlap" and g <= gpu.verify_ms(bs)
            if mode == "overlap" and not hidden and first_unhidden is None:
                first_unhidden = bs
            rows.append({"bs": bs, "grammar_ms": g, "verify_ms": gpu.verify_ms(bs), "step_ms": s,
                         "tpot_ms": s / gpu.accept_len, "hidden": hidden})
        unconstrained = [step_ms("overlap", gpu, r["bs"], 0.0) / gpu.accept_len for r in rows]
        out["paths"][key] = {"label": label, "mode": mode, "cost": cost_key, "rows": rows,
                             "first_unhidden_bs": first_unhidden, "unconstrained_tpot_ms": unconstrained}
    return out


def grammar_cost_points(path: Path, grammar: str = "nested", vocab: int = 32000, topk: int = 1,
                        steps: int = 3) -> Dict[str, List[Tuple[float, float]]]:
    rows = json.loads(path.read_text())["rows"]
    sel = [r for r in rows if r["grammar"] == grammar and r["vocab"] == vocab and r["topk"] == topk
           and r["steps"] == steps]
    if not sel:
        raise ValueError(f"{path}: no rows for grammar={grammar} vocab={vocab} topk={topk} steps={steps}")
    return {k: [(r["bs"], r[k]) for r in sel] for k in ("sglang_ms", "lockstep1_ms")}


# -- the CPU engine run ---------------------------------------------------------------------------------------------
def summarize(events: List[Tuple[str, float, float, int, bool]]) -> Dict[str, Any]:
    """Per bs: medians of the grammar phases, forward, constrained and unconstrained step periods; plus the model
    check: predicted constrained period = unconstrained period + grammar + mask application (on CPU nothing is
    hidden)."""
    steps = group_steps(events)
    free = step_periods(events, grammar=False)
    free_fwd: Dict[int, List[float]] = {}
    loop: Dict[Tuple[str, int, bool], List[float]] = {}  # (run_batch | postprocess, bs, grammar) -> ms
    for e in events:
        if e[0] == "forward" and not e[4]:
            free_fwd.setdefault(e[3], []).append((e[2] - e[1]) * 1e3)
        if e[0] in ("run_batch", "postprocess"):
            loop.setdefault((e[0], e[3], e[4]), []).append((e[2] - e[1]) * 1e3)
    by_bs: Dict[int, Dict[str, Any]] = {}
    for bs in sorted({s["bs"] for s in steps}):
        ss = [s for s in steps if s["bs"] == bs]
        phase_ms = {p: statistics.median([sum(e - b for b, e in s["phases"].get(p, [])) for s in ss])
                    for p in GRAMMAR_PHASES}
        row: Dict[str, Any] = {
            "steps": len(ss),
            "grammar_ms": statistics.median([s["grammar_ms"] for s in ss]),
            "apply_ms": statistics.median([s["apply_ms"] for s in ss]),
            "phase_ms": phase_ms,
            "forward_ms": statistics.median([s["forward"][1] for s in ss]),
            "sample_ms": statistics.median([s["sample"] for s in ss]),
            "period_ms": median_or_none([s["period_ms"] for s in ss if s["period_ms"] is not None]),
            "free_period_ms": median_or_none(free.get(bs, [])),
            "free_forward_ms": median_or_none(free_fwd.get(bs, [])),
            "loop_ms": {f"{part}_{'constrained' if g else 'free'}": statistics.median(loop[(part, bs, g)])
                        for part in ("run_batch", "postprocess") for g in (True, False) if loop.get((part, bs, g))},
        }
        if row["period_ms"] and row["free_period_ms"]:
            row["predicted_period_ms"] = row["free_period_ms"] + row["grammar_ms"] + row["apply_ms"]
            row["prediction_error"] = row["predicted_period_ms"] / row["period_ms"] - 1.0
        by_bs[bs] = row
    return {"by_bs": by_bs, "steps": steps}


def run_path(plugin: bool, batch_sizes: Sequence[int], repeats: int) -> Dict[str, Any]:
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, start_engine
    from sglang_eo_dev.cpu_runtime.models import FOLLOWER_SCHEMA

    tmp = tempfile.mkdtemp(prefix="eo-timeline-")
    tl_file = os.path.join(tmp, "timeline.json")
    os.environ[TIMELINE_ENV] = tl_file
    cfg = EngineConfig(pair="follower", spec="topk1", overlap=True, product_plugin=plugin,
                       max_running_requests=max(batch_sizes))
    t0 = time.monotonic()
    engine = start_engine(cfg, stats_file=os.path.join(tmp, "stats.json"))
    try:
        params = {"temperature": 0.0, "max_new_tokens": 48}
        constrained = dict(params, json_schema=json.dumps(FOLLOWER_SCHEMA))
        engine.generate(prompt=["warm up"] * 2, sampling_params=constrained)  # compile + first steps
        t_measured = time.perf_counter()  # CLOCK_MONOTONIC: comparable with the scheduler process's stamps
        for _ in range(repeats):
            for bs in batch_sizes:
                prompts = [f"Request {i}:" for i in range(bs)]
                engine.generate(prompt=prompts, sampling_params=constrained)
                engine.generate(prompt=prompts, sampling_params=params)
        time.sleep(1.0)  # the recorder thread rewrites the file every 0.25 s
        events = [e for e in load_events(tl_file) if e[1] >= t_measured]
        with open(tl_file) as f:
            meta = json.load(f).get("meta", {})
    finally:
        engine.shutdown()
        os.environ.pop(TIMELINE_ENV, None)
    summary = summarize(events)
    return {"meta": dict(meta, plugin=plugin, engine_s=round(time.monotonic() - t0, 1)), **summary}


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform(terse=True)}, no GPU"


def cmd_run(args: argparse.Namespace) -> None:
    from importlib.metadata import version

    ver = version("sglang")
    band = "0.5.16" if ver.startswith("0.5.16") else "0.5.23"
    RESULTS.mkdir(parents=True, exist_ok=True)
    for plugin in (False, True):
        res = run_path(plugin, args.batch_sizes, args.repeats)
        res["meta"].update(sglang=ver, xgrammar=version("xgrammar"), machine=machine(), band=band,
                           command="flock /tmp/sglang-engine.lock " + " ".join(
                               shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT), *sys.argv]))
        out = RESULTS / f"timeline_{band}_{'plugin' if plugin else 'stock'}.json"
        out.write_text(json.dumps(res, indent=1))
        print(f"{out.relative_to(ROOT)}: " + json.dumps({bs: {k: r[k] for k in ("steps", "grammar_ms", "period_ms",
              "free_period_ms")} for bs, r in res["by_bs"].items()}))


# -- plot -----------------------------------------------------------------------------------------------------------
def representative(steps: List[Dict[str, Any]], bs: int) -> Optional[Dict[str, Any]]:
    """The median-grammar step among those with every phase, in the middle of a batch's decode (a batch's first step
    carries the prefill's grammar work or none)."""
    idx = [i for i, s in enumerate(steps) if s["bs"] == bs]
    if not idx:
        return None
    periods = [steps[i]["period_ms"] for i in idx if steps[i]["period_ms"] is not None]
    limit = 1.5 * statistics.median(periods) if periods else float("inf")
    ss = [steps[i] for i in idx if i > 0 and steps[i - 1]["bs"] == bs
          and steps[i - 1]["period_ms"] is not None and steps[i - 1]["period_ms"] <= limit] or [steps[i] for i in idx]
    most = max(len(s["phases"]) for s in ss)
    ss = sorted((s for s in ss if len(s["phases"]) == most), key=lambda s: s["grammar_ms"])
    return ss[len(ss) // 2]


def plot_timeline(runs: Dict[str, Dict[str, Any]], bs: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("0.5.16-stock", "0.5.16-plugin", "0.5.23-stock", "0.5.23-plugin") if k in runs]
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.9 * len(keys) + 1.2), squeeze=False)
    lanes = list(LANES)
    for ax, key in zip(axes[:, 0], keys):
        run = runs[key]
        step = representative(run["steps"], bs)
        ver, kind = key.split("-")
        n_steps = run["by_bs"].get(str(bs), {}).get("steps", 0)
        ax.set_title(PATHS[(ver, kind == "plugin")][0] + f"  (bs {bs}, median step of {n_steps})",
                     fontsize=9, loc="left")
        if step is None:
            continue
        ax.barh(0, step["forward"][1], left=0, color="tab:blue", height=0.6)
        for i, p in enumerate(LANES[1:], start=1):
            for s, e in step["phases"].get(p, []):
                ax.barh(i, max(e - s, 0.01), left=s, color=PHASE_COLORS[p], height=0.6)
        ax.axvline(0, color="k", lw=0.8)
        ax.axvline(step["sample"], color="green", lw=1.2, ls="--")
        ax.text(step["sample"], len(lanes) - 0.4, " sampling needs mask", color="green", fontsize=7, va="top")
        if step.get("tree_copy") is not None:
            ax.plot([step["tree_copy"]], [LANES.index("tree_wait")], marker="v", color="k")
            ax.text(step["tree_copy"], LANES.index("tree_wait") + 0.45, "async tree copy start ", fontsize=6,
                    ha="right")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(["verify forward (CPU, sync)", "grammar advance", "tree copy wait", "mask build",
                            "mask upload", "mask apply (sampler)"], fontsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms relative to the target-verify launch (0); negative = before the launch")
    fig.suptitle("Grammar work per EAGLE3 verify step, measured in the running SGLang engine ON CPU (tiny model; the "
                 "forward runs synchronously\nin the launching thread, so no real overlap is visible: on a GPU the "
                 "phases right of 0 run while the forward computes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_tpot(pred: Dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    styles = {"0.5.16-stock": ("tab:red", "-"), "0.5.23-stock": ("tab:orange", "-"),
              "0.5.16-plugin": ("tab:blue", "--"), "0.5.23-plugin": ("tab:green", ":")}
    bss = pred["batch_sizes"]
    first = next(iter(pred["paths"].values()))
    ax.plot(bss, first["unconstrained_tpot_ms"], color="gray", lw=1, label="no grammar")
    for key, p in pred["paths"].items():
        color, ls = styles[key]
        ax.plot(bss, [r["tpot_ms"] for r in p["rows"]], color=color, ls=ls, label=p["label"])
        if p["first_unhidden_bs"] is not None:
            r = next(r for r in p["rows"] if r["bs"] == p["first_unhidden_bs"])
            ax.plot([r["bs"]], [r["tpot_ms"]], marker="o", color=color)
            ax.annotate(f"grammar > verify from bs {r['bs']}", (r["bs"], r["tpot_ms"]), fontsize=7, color=color,
                        xytext=(4, -12), textcoords="offset points")
    ax.set_xlabel("batch size (constrained requests)")
    ax.set_ylabel("predicted TPOT, ms / output token")
    ax.set_title("Predicted TPOT, Llama-3.1-8B + EAGLE3 (topk 1, 4 draft tokens) on 1x H100: GPU time model from "
                 "published numbers,\ngrammar cost per step measured on this CPU (32k vocab, nested JSON schema)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def cmd_plot(args: argparse.Namespace) -> None:
    runs: Dict[str, Dict[str, Any]] = {}
    for f in sorted(RESULTS.glob("timeline_0.5.*_*.json")):
        band, kind = f.stem.split("_")[1:]
        run = json.loads(f.read_text())
        # a batch size seen only in a stray step (the warm-up's last one) says nothing
        run["by_bs"] = {bs: r for bs, r in run["by_bs"].items() if r["steps"] >= 3}
        runs[f"{band}-{kind}"] = run
    if not runs:
        raise SystemExit("no benchmarks/results/timeline_<band>_<stock|plugin>.json yet: run the 'run' step first")
    gpu = GpuModel(decode_ms=args.verify_ms, accept_len=args.accept_len)
    costs = grammar_cost_points(RESULTS / "grammar_step.json")
    serial = {k: statistics.median([r["phase_ms"]["mask_upload"] for r in run["by_bs"].values()])
              for k, run in runs.items()}
    pred = predict(costs, gpu, range(1, 65), serial)
    plot_timeline(runs, args.bs, RESULTS / "timeline.png")
    plot_tpot(pred, RESULTS / "timeline_tpot.png")
    cols = ("grammar_ms", "apply_ms", "free_period_ms", "period_ms", "predicted_period_ms", "prediction_error")
    check = {k: {bs: {c: r.get(c) for c in cols} for bs, r in run["by_bs"].items()} for k, run in runs.items()}
    (RESULTS / "timeline.json").write_text(json.dumps(
        {"gpu_model": asdict(gpu), "serial_ms": serial, "prediction": pred, "cpu_check": check,
         "runs_meta": {k: r["meta"] for k, r in runs.items()}}, indent=1))
    (RESULTS / "timeline.md").write_text(render_md(runs, pred, gpu, check))
    print((RESULTS / "timeline.md").read_text())


def render_md(runs: Dict[str, Any], pred: Dict[str, Any], gpu: GpuModel, check: Dict[str, Any]) -> str:
    lines = ["# Overlap timeline and TPOT prediction", ""]
    lines.append("Commands:")
    lines.append("")
    for k, r in runs.items():
        lines.append(f"- `{r['meta'].get('command', '?')}` ({k}; {r['meta'].get('machine', '?')}, "
                     f"SGLang {r['meta'].get('sglang')}, xgrammar {r['meta'].get('xgrammar')})")
    lines.append("- `.venvs/sglang-0.5.23/bin/python benchmarks/timeline.py plot`")
    lines += ["", "## Measured on the CPU engine (medians per step, ms; tiny 4k-vocab follower model, EAGLE3 topk 1)",
              "",
              "| path | bs | steps | advance | tree wait | mask build | upload | grammar | mask apply | "
              "verify fwd (CPU) | step, constrained | step, unconstrained | predicted step | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, run in runs.items():
        for bs, r in run["by_bs"].items():
            ph = r["phase_ms"]
            fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
            err = r.get("prediction_error")
            lines.append(f"| {k} | {bs} | {r['steps']} | {fmt(ph['advance'])} | {fmt(ph['tree_wait'])} | "
                         f"{fmt(ph['mask_build'])} | {fmt(ph['mask_upload'])} | {fmt(r['grammar_ms'])} | "
                         f"{fmt(r['apply_ms'])} | "
                         f"{fmt(r['forward_ms'])} | {fmt(r['period_ms'])} | {fmt(r['free_period_ms'])} | "
                         f"{fmt(r.get('predicted_period_ms'))} | {'—' if err is None else f'{err:+.1%}'} |")
    lines += ["", "Model check: on CPU nothing is hidden, so the model predicts a constrained step = the unconstrained "
              "step of the same batch in the same engine + the measured grammar phases + the sampler's mask "
              "application; `error` = predicted / measured - 1.", "",
              "Where a decode loop iteration spends its time (medians, ms; `run_batch` = draft + verify forward + "
              "grammar + sampling, `postprocess` = `process_batch_result`), constrained / unconstrained:", "",
              "| path | bs | run_batch | postprocess | step | rest (scheduling, other processes) |",
              "|---|---|---|---|---|---|"]
    for k, run in runs.items():
        for bs, r in run["by_bs"].items():
            lm = r.get("loop_ms") or {}
            if not lm or r["period_ms"] is None or r["free_period_ms"] is None:
                continue
            rb = (lm.get("run_batch_constrained"), lm.get("run_batch_free"))
            pp = (lm.get("postprocess_constrained"), lm.get("postprocess_free"))
            if None in rb or None in pp:
                continue
            rest = (r["period_ms"] - rb[0] - pp[0], r["free_period_ms"] - rb[1] - pp[1])
            lines.append(f"| {k} | {bs} | {rb[0]:.2f} / {rb[1]:.2f} | {pp[0]:.2f} / {pp[1]:.2f} | "
                         f"{r['period_ms']:.2f} / {r['free_period_ms']:.2f} | {rest[0]:.2f} / {rest[1]:.2f} |")
    lines += ["",
              "## Predicted TPOT on 1x H100, Llama-3.1-8B + EAGLE3 (ms per output token)", "",
              f"GPU model: {asdict(gpu)} (sources in `benchmarks/timeline.py`, `GpuModel`). Grammar cost per step: "
              "`benchmarks/results/grammar_step.json` (32k vocab, nested JSON schema, topk 1 / 3 steps / 4 nodes; "
              "SGLang's Python DFS for the stock paths, the plugin's one-thread lockstep build for the plugin). "
              "Forced sync: draft + verify + grammar; overlapped: draft + max(verify, grammar) + upload. "
              "**bold** = grammar no longer hidden under the verify forward.", ""]
    show = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    lines.append("| path | " + " | ".join(f"bs {b}" for b in show) + " | grammar unhidden from bs |")
    lines.append("|---|" + "---|" * (len(show) + 1))
    first = next(iter(pred["paths"].values()))
    free = first["unconstrained_tpot_ms"]
    lines.append("| no grammar | " + " | ".join(f"{free[b - 1]:.2f}" for b in show) + " | — |")
    for k, p in pred["paths"].items():
        cells = []
        for b in show:
            r = p["rows"][b - 1]
            v = f"{r['tpot_ms']:.2f}"
            cells.append(f"**{v}**" if p["mode"] == "overlap" and not r["hidden"] else v)
        fu = p["first_unhidden_bs"]
        if p["mode"] == "sync":
            where = "always (sync)"
        else:
            where = "never (≤ 64)" if fu is None else str(fu)
        lines.append(f"| {p['label']} | " + " | ".join(cells) + f" | {where} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run both paths (stock, plugin) of this venv's SGLang on the CPU engine")
    r.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    r.add_argument("--repeats", type=int, default=2)
    p = sub.add_parser("plot", help="merge the runs: timeline.png, timeline_tpot.png, timeline.{md,json}")
    p.add_argument("--bs", type=int, default=8, help="batch size of the step drawn in timeline.png")
    p.add_argument("--verify-ms", type=float, default=GpuModel.decode_ms, help="GPU verify forward at small bs, ms")
    p.add_argument("--accept-len", type=float, default=GpuModel.accept_len)
    args = ap.parse_args(argv)
    {"run": cmd_run, "plot": cmd_plot}[args.cmd](args)


if __name__ == "__main__":
    main()
