"""Overlap timeline of the grammar work per EAGLE3 verify step, measured in the SGLang engine on CPU.

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
``timeline.md`` (per-step medians and the CPU decomposition of :func:`decompose`) and ``timeline.json``.

What a CPU engine can and cannot show: its "GPU" forward runs synchronously inside the launch call, so the measured
timeline shows the CPU phases and where they sit relative to the launch and the sampling, but no real overlap. Nothing
here predicts GPU step time (``benchmarks/step_model.py`` does that). Not a test: nothing here gates CI.
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
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))

from sglang_eagle_overlap.core.timeline import GRAMMAR_PHASES, TIMELINE_ENV  # noqa: E402
from sglang_eo_dev.timeline_events import group_steps, load_events, median_or_none, step_periods  # noqa: E402

PATHS = {  # (sglang minor band, plugin) -> plot label
    ("0.5.16", False): "SGLang 0.5.16, no plugin (forced sync)",
    ("0.5.16", True): "SGLang 0.5.16 + plugin",
    ("0.5.23", False): "SGLang 0.5.23 upstream overlap",
    ("0.5.23", True): "SGLang 0.5.23 + plugin",
}
PHASE_COLORS = {"advance": "tab:orange", "tree_wait": "tab:purple", "mask_build": "tab:red", "mask_upload": "tab:brown",
                "mask_apply": "tab:gray"}
LANES = ("forward", *GRAMMAR_PHASES, "mask_apply")


# -- the CPU engine run ---------------------------------------------------------------------------------------------
DECOMPOSITION = ("parts_ms", "unaccounted_ms", "unaccounted_share")  # the fields decompose() adds


def decompose(row: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """CPU decomposition of one batch size's medians (a measurement, not a prediction): on CPU nothing is hidden, so
    the measured constrained step is compared with the sum of its measured parts -- the unconstrained step of the same
    bs in the same engine + the recorded grammar phases + the sampler's mask application.

    Returns ``parts_ms`` (that sum), ``unaccounted_ms`` (measured constrained step - parts; > 0: the constrained step
    costs more than its recorded parts) and ``unaccounted_share`` (unaccounted / measured constrained step), or None
    when either step period is missing."""
    period, free = row.get("period_ms"), row.get("free_period_ms")
    if not period or not free:
        return None
    parts = free + row["grammar_ms"] + row["apply_ms"]
    return {"parts_ms": parts, "unaccounted_ms": period - parts, "unaccounted_share": (period - parts) / period}


def summarize(events: List[Tuple[str, float, float, int, bool]]) -> Dict[str, Any]:
    """Per bs: medians of the grammar phases, forward, constrained and unconstrained step periods, the loop's
    ``run_batch`` / ``postprocess`` spans, and the :func:`decompose` fields when both periods were measured."""
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
        row.update(decompose(row) or {})
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
        ax.set_title(PATHS[(ver, kind == "plugin")] + f"  (bs {bs}, median step of {n_steps})",
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


def load_runs(results: Path) -> Dict[str, Dict[str, Any]]:
    """The ``timeline_<band>_<stock|plugin>.json`` files under ``results``, keyed ``<band>-<kind>``. Batch sizes with
    fewer than 3 steps are dropped, and the :func:`decompose` fields are recomputed from each row's medians (files
    written before the decomposition existed carry other keys)."""
    runs: Dict[str, Dict[str, Any]] = {}
    for f in sorted(results.glob("timeline_0.5.*_*.json")):
        band, kind = f.stem.split("_")[1:]
        run = json.loads(f.read_text())
        # a batch size seen only in a stray step (the warm-up's last one) says nothing
        run["by_bs"] = {bs: r for bs, r in run["by_bs"].items() if r["steps"] >= 3}
        for r in run["by_bs"].values():
            for old in ("predicted_period_ms", "prediction_error", *DECOMPOSITION):
                r.pop(old, None)
            r.update(decompose(r) or {})
        runs[f"{band}-{kind}"] = run
    return runs



def cmd_plot(args: argparse.Namespace) -> None:
    results: Path = args.results
    runs = load_runs(results)
    if not runs:
        raise SystemExit(f"no {results}/timeline_<band>_<stock|plugin>.json yet: run the 'run' step first")
    plot_timeline(runs, args.bs, results / "timeline.png")
    cols = ("grammar_ms", "apply_ms", "free_period_ms", "period_ms", *DECOMPOSITION)
    decomposition = {k: {bs: {c: r.get(c) for c in cols} for bs, r in run["by_bs"].items()}
                     for k, run in runs.items()}
    (results / "timeline.json").write_text(json.dumps(
        {"cpu_decomposition": decomposition, "runs_meta": {k: r["meta"] for k, r in runs.items()}}, indent=1))
    (results / "timeline.md").write_text(render_md(runs))
    print((results / "timeline.md").read_text())


def render_md(runs: Dict[str, Any]) -> str:
    """``timeline.md``: the commands, the per-bs medians with the CPU decomposition, the decode loop's spans."""
    lines = ["# Overlap timeline of the grammar work (measured on the CPU engine)", ""]
    lines.append("Commands:")
    lines.append("")
    for k, r in runs.items():
        lines.append(f"- `{r['meta'].get('command', '?')}` ({k}; {r['meta'].get('machine', '?')}, "
                     f"SGLang {r['meta'].get('sglang')}, xgrammar {r['meta'].get('xgrammar')})")
    lines.append("- `.venvs/sglang-0.5.23/bin/python benchmarks/timeline.py plot`")
    lines += ["", "## Measured on the CPU engine (medians per step, ms; tiny 4k-vocab follower model, EAGLE3 topk 1)",
              "",
              "| path | bs | steps | advance | tree wait | mask build | upload | grammar | mask apply | "
              "verify fwd (CPU) | step, constrained | step, unconstrained | unconstrained + grammar + apply | "
              "unaccounted |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.2f}"  # noqa: E731
    for k, run in runs.items():
        for bs, r in run["by_bs"].items():
            ph = r["phase_ms"]
            un = ("—" if r.get("unaccounted_ms") is None else
                  f"{r['unaccounted_ms']:+.2f} ({r['unaccounted_share']:+.1%})")
            lines.append(f"| {k} | {bs} | {r['steps']} | {fmt(ph['advance'])} | {fmt(ph['tree_wait'])} | "
                         f"{fmt(ph['mask_build'])} | {fmt(ph['mask_upload'])} | {fmt(r['grammar_ms'])} | "
                         f"{fmt(r['apply_ms'])} | "
                         f"{fmt(r['forward_ms'])} | {fmt(r['period_ms'])} | {fmt(r['free_period_ms'])} | "
                         f"{fmt(r.get('parts_ms'))} | {un} |")
    lines += ["", "CPU decomposition (measurements only, no prediction): on CPU nothing is hidden, so the measured "
              "constrained step is set against the sum of its measured parts -- the unconstrained step of the same "
              "batch size in the same engine + the recorded grammar phases + the sampler's mask application. "
              "`unaccounted` = measured constrained step - that sum, in ms and as a share of the constrained step "
              "(> 0: the constrained step costs more than its recorded parts).", "",
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
    lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run both paths (stock, plugin) of this venv's SGLang on the CPU engine")
    r.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    r.add_argument("--repeats", type=int, default=2)
    p = sub.add_parser("plot", help="merge the runs: timeline.png, timeline.{md,json}")
    p.add_argument("--bs", type=int, default=8, help="batch size of the step drawn in timeline.png")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="folder with the timeline_<band>_<stock|plugin>.json runs; the outputs are written there")
    args = ap.parse_args(argv)
    {"run": cmd_run, "plot": cmd_plot}[args.cmd](args)


if __name__ == "__main__":
    main()
