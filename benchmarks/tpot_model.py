"""Calibrated per-phase TPOT model of constrained EAGLE3 decoding on a GPU (issue #11, part 4).

Why a second model: the one in ``benchmarks/timeline.py`` adds only the grammar work to an idealised GPU step and
predicted the plugin's grammar "never unhidden up to bs 64"; measured on an H200 it is +14-22 % at bs 32-64
(``MEASURED_H200``, from the notes' GPU run). This model is calibrated on that measured table and is what a change is
judged by when no GPU is at hand. Pure Python, no SGLang, no torch.

The step model (per decode step = per output token at accept length ~1, all times in ms; ``k`` = EAGLE3 shape with
``nodes`` draft-tree nodes per request, ``bs`` = running requests):

* ``gpu(bs, k)``: the unconstrained step, i.e. verify + draft forwards on the GPU, the overlapped scheduler hiding all
  of SGLang's CPU work: ``base[k] + per_token * bs * nodes + per_token2 * (bs * nodes)**2 + per_req * bs``.
* ``sched(bs)``: SGLang's own CPU work per scheduler iteration (schedule, launch, post-process the previous result,
  per-request bookkeeping): ``sched_base + sched_per_req * bs``. Hidden under ``gpu`` when nothing else runs on the
  scheduler thread.
* plugin: its grammar work runs on the scheduler thread after the verify launch (advance of the previous batch's
  tokens, tree wait, mask build on ``threads`` fill threads, upload) and so *displaces* SGLang's CPU work into the
  window the GPU covers::

      advance = plugin_fixed + bs * advance_per_token * accept
      mask    = bs * nodes * fill_1thread / threads ** thread_exponent
      plugin  = max(gpu, advance + mask + draft, advance + mask + sched) + first_step / out_tokens

  ``mask_off_critical_path`` (a lever) lets the mask overlap SGLang's own work: ``max(gpu, advance + max(mask,
  sched))``. ``draft`` (``draft_ms``, an estimate) is the GPU work after sampling, so ``advance + mask + draft``
  binds only when the mask is later than the verify forward. ``first_step`` is the one-off first-step mask cost
  (every request hit the 50 ms time limit once), amortised over the ``out_tokens`` of a request.
* stock 0.5.16 (forced sync): nothing overlaps, grammar in Python on the scheduler thread::

      stock = gpu + sched + sync_fixed + bs * (stock_advance + nodes * stock_fill)

Calibration: :func:`fit` (scipy least squares on relative error) over the 24 cells of ``MEASURED_H200`` plus the
one-mask-thread point (bs 64, topk 1: 36.9 ms). The fitted values are frozen in :data:`CALIBRATED`; the test
``tests/benchmarks/test_tpot_model.py`` checks they reproduce every measured cell within +-10 %. Every prediction
printed by this module carries the calibration error of the nearest measured cell (``err``); cells that were never
measured (other bs, other shapes, what-if levers) are predictions, marked as such.

Usage::

    python benchmarks/tpot_model.py        # table vs measured + what-if rows -> benchmarks/results/tpot_model.*
    python benchmarks/tpot_model.py --fit  # re-fit the parameters (needs scipy), print them

API for the lead: ``predict(bs, shape, params=CALIBRATED, levers=Levers(...))`` -> :class:`Prediction` with the
phases; ``what_if_rows()`` for the standard levers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

__all__ = [
    "CALIBRATED",
    "DRAFT_NODES",
    "Levers",
    "MEASURED_H200",
    "MEASURED_H200_ONE_THREAD",
    "Params",
    "Prediction",
    "calibration_errors",
    "fit",
    "markdown",
    "predict",
    "what_if_rows",
]

ROOT = Path(__file__).resolve().parents[1]
Shape = Literal["topk1", "topk4"]
Column = Literal["unconstrained", "stock", "plugin"]

DRAFT_NODES: Dict[str, int] = {"topk1": 4, "topk4": 8}  # EAGLE3 num_draft_tokens: 3 steps, topk 1 / topk 4
BATCH_SIZES = (1, 8, 32, 64)

# ms per decode step; one H200, SGLang 0.5.16, 8B-shaped dummy model, CUDA graphs, triton attention, 160-token outputs,
# best of 2 (notes/gpu-runtime.md "Performance measured there"). MEASURED, not predicted.
MEASURED_H200: Dict[Tuple[str, int], Dict[str, float]] = {
    ("topk1", 1): {"unconstrained": 6.88, "stock": 11.84, "plugin": 7.27},
    ("topk1", 8): {"unconstrained": 7.80, "stock": 13.62, "plugin": 8.42},
    ("topk1", 32): {"unconstrained": 11.47, "stock": 26.52, "plugin": 13.38},
    ("topk1", 64): {"unconstrained": 17.38, "stock": 40.77, "plugin": 21.17},
    ("topk4", 1): {"unconstrained": 7.40, "stock": 13.24, "plugin": 7.73},
    ("topk4", 8): {"unconstrained": 8.78, "stock": 18.26, "plugin": 10.25},
    ("topk4", 32): {"unconstrained": 15.10, "stock": 36.34, "plugin": 17.49},
    ("topk4", 64): {"unconstrained": 26.16, "stock": 67.02, "plugin": 29.85},
}
# SGLANG_EAGLE_OVERLAP_MASK_THREADS=1 at bs 64, topk 1 (default 8 threads on 16 cores: 21.2 ms). MEASURED.
MEASURED_H200_ONE_THREAD = {"shape": "topk1", "bs": 64, "threads": 1, "plugin": 36.9}
MEASURED_MACHINE = "1x NVIDIA H200 (141 GB), 16 host cores, SGLang 0.5.16, xgrammar 0.2.1, 8B-shaped dummy model"


@dataclasses.dataclass(frozen=True)
class Params:
    """Per-phase costs in ms (see the module docstring for where each enters)."""

    base_topk1: float
    base_topk4: float
    per_token: float  # GPU ms per verified token
    per_token2: float  # GPU ms per verified token squared (attention over the tree grows faster than linear)
    per_req: float  # GPU ms per request
    sched_base: float  # SGLang CPU work per iteration
    sched_per_req: float  # SGLang CPU work per request per iteration
    plugin_fixed: float  # plugin per-step fixed cost (tree wait, upload, launch of the mask copy)
    advance_per_token: float  # matcher advance per accepted token (real work, waits excluded)
    fill_1thread: float  # one node fill (128k vocab bitmask) on one thread
    thread_exponent: float  # fill speed-up = threads ** thread_exponent
    sync_fixed: float  # stock 0.5.16: blocking tree copy + sync per step
    stock_advance: float  # stock: advance per token in SGLang's post-processing
    stock_fill: float  # stock: Python DFS fill per node
    first_step: float = 50.0  # one-off first-step mask cost per request (the 50 ms time-limit hit)
    draft_ms: float = 1.5  # GPU draft part of the step (after sampling); enters only when the mask is later than it

    def base(self, shape: str) -> float:
        return self.base_topk1 if shape == "topk1" else self.base_topk4


# Fitted with `python benchmarks/tpot_model.py --fit` (scipy 1.17) on MEASURED_H200 + MEASURED_H200_ONE_THREAD.
CALIBRATED = Params(
    base_topk1=6.718,
    base_topk4=7.402,
    per_token=0.01432,
    per_token2=2.306e-05,
    per_req=0.0843,
    sched_base=4.51,
    sched_per_req=0.02942,
    plugin_fixed=0.6042,
    advance_per_token=0.08487,
    fill_1thread=0.09437,
    thread_exponent=0.5028,
    sync_fixed=0.008146,
    stock_advance=0.00976,
    stock_fill=0.06384,
)


@dataclasses.dataclass(frozen=True)
class Levers:
    """What-if changes to the plugin's path (defaults = the measured configuration)."""

    threads: int = 8
    advance_scale: float = 1.0  # 0.5 = advance twice as cheap
    fill_scale: float = 1.0  # 0.5 = half the fills (or fills twice as cheap)
    fixed_scale: float = 1.0  # 0.0 = no per-step fixed cost (tree wait, waits on the scheduler thread)
    first_step: bool = True  # False = the first-step time-limit hit gone
    mask_off_critical_path: bool = False  # True = mask built on threads while SGLang's own CPU work runs
    accept_len: float = 1.0  # accepted tokens per request per step (random weights: 1.0)
    out_tokens: int = 160


@dataclasses.dataclass(frozen=True)
class Prediction:
    shape: str
    bs: int
    gpu_ms: float
    sched_ms: float
    advance_ms: float
    mask_ms: float
    first_step_ms: float
    unconstrained_ms: float
    stock_ms: float
    plugin_ms: float

    @property
    def plugin_over_unconstrained(self) -> float:
        return self.plugin_ms / self.unconstrained_ms - 1.0

    @property
    def stock_over_plugin(self) -> float:
        return self.stock_ms / self.plugin_ms


def predict(bs: int, shape: str, params: Params = CALIBRATED, levers: Levers = Levers()) -> Prediction:
    """Predicted ms per decode step of the three columns, with the plugin's phases (see the module docstring)."""
    if shape not in DRAFT_NODES:
        raise ValueError(f"unknown EAGLE3 shape {shape!r}; expected one of {sorted(DRAFT_NODES)}")
    if bs < 1 or levers.threads < 1:
        raise ValueError(f"bs and threads must be >= 1, got bs={bs}, threads={levers.threads}")
    p, nodes = params, DRAFT_NODES[shape]
    tokens = bs * nodes
    gpu = p.base(shape) + p.per_token * tokens + p.per_token2 * tokens * tokens + p.per_req * bs
    sched = p.sched_base + p.sched_per_req * bs
    advance = p.plugin_fixed * levers.fixed_scale + bs * p.advance_per_token * levers.accept_len * levers.advance_scale
    mask = bs * nodes * p.fill_1thread * levers.fill_scale / levers.threads ** p.thread_exponent
    first = p.first_step / levers.out_tokens if levers.first_step else 0.0
    if levers.mask_off_critical_path:
        cpu_path = advance + max(mask, sched)
    else:
        cpu_path = advance + mask + sched
    # the GPU waits for the mask only past the verify (gpu - draft); the scheduler thread must also fit its own work
    plugin = max(gpu, advance + mask + p.draft_ms, cpu_path) + first
    stock = gpu + sched + p.sync_fixed + bs * (p.stock_advance + nodes * p.stock_fill)
    return Prediction(shape, bs, gpu, sched, advance, mask, first, gpu, stock, plugin)


def _value(pred: Prediction, column: str) -> float:
    return {"unconstrained": pred.unconstrained_ms, "stock": pred.stock_ms, "plugin": pred.plugin_ms}[column]


def calibration_errors(params: Params = CALIBRATED) -> Dict[Tuple[str, int, str], float]:
    """Relative error (predicted / measured - 1) of every measured cell, plus the one-thread point as
    ``(shape, bs, "plugin_1thread")``."""
    errs = {}
    for (shape, bs), cols in MEASURED_H200.items():
        pred = predict(bs, shape, params)
        for col, measured in cols.items():
            errs[(shape, bs, col)] = _value(pred, col) / measured - 1.0
    one = MEASURED_H200_ONE_THREAD
    pred = predict(int(one["bs"]), str(one["shape"]), params, Levers(threads=int(one["threads"])))
    errs[(str(one["shape"]), int(one["bs"]), "plugin_1thread")] = pred.plugin_ms / float(one["plugin"]) - 1.0
    return errs


def error_for(shape: str, bs: int, column: str, params: Params = CALIBRATED) -> Optional[float]:
    """The calibration error of the measured cell a prediction is judged against: same shape and column, nearest
    measured batch size; None when the shape was never measured."""
    if (shape, BATCH_SIZES[0]) not in MEASURED_H200:
        return None
    near = min(BATCH_SIZES, key=lambda b: abs(b - bs))
    return calibration_errors(params)[(shape, near, column)]


def fit(start: Params = CALIBRATED) -> Params:
    """Least-squares fit (relative errors) of every field except ``first_step`` and ``draft_ms`` (taken from the
    notes / an estimate). Needs scipy."""
    import numpy as np
    from scipy.optimize import least_squares

    fixed = {"first_step", "draft_ms"}
    names = [f.name for f in dataclasses.fields(Params) if f.name not in fixed]

    def make(x: Sequence[float]) -> Params:
        return dataclasses.replace(start, **dict(zip(names, (float(v) for v in x))))

    def residuals(x: Sequence[float]) -> Any:
        return np.array(list(calibration_errors(make(x)).values()))

    x0 = [getattr(start, n) for n in names]
    upper = [50.0 if n.startswith("base") or n.startswith("sched_base") or n.endswith("fixed") else 5.0 for n in names]
    res = least_squares(residuals, x0, bounds=([0.0] * len(names), upper))
    return make(res.x)


def what_if_rows(params: Params = CALIBRATED) -> List[Dict[str, Any]]:
    """Predicted plugin ms/step at the measured batch sizes for a few levers (all PREDICTED)."""
    levers = [
        ("measured configuration (8 threads)", Levers()),
        ("first-step time-limit hit gone", Levers(first_step=False)),
        ("advance 2x cheaper", Levers(advance_scale=0.5)),
        ("fills 2x cheaper / half the fills", Levers(fill_scale=0.5)),
        ("no fixed per-step cost (waits, tree wait)", Levers(fixed_scale=0.0)),
        ("mask off the critical path (overlaps SGLang's CPU work)", Levers(mask_off_critical_path=True)),
        ("mask off the critical path + no first-step hit", Levers(mask_off_critical_path=True, first_step=False)),
        ("all of the above", Levers(first_step=False, advance_scale=0.5, fill_scale=0.5, fixed_scale=0.0,
                                    mask_off_critical_path=True)),
        ("1 mask thread", Levers(threads=1)),
    ]
    rows = []
    for name, lv in levers:
        for shape in DRAFT_NODES:
            cells = []
            for bs in BATCH_SIZES:
                pr = predict(bs, shape, params, lv)
                cells.append({"bs": bs, "plugin_ms": pr.plugin_ms, "over_unconstrained": pr.plugin_over_unconstrained,
                              "err_plugin": error_for(shape, bs, "plugin", params)})
            rows.append({"lever": name, "levers": dataclasses.asdict(lv), "shape": shape, "cells": cells})
    return rows


def markdown(params: Params = CALIBRATED) -> str:
    errs = calibration_errors(params)
    lines = [
        "# TPOT model calibrated on the measured H200 table",
        "",
        f"Measured: {MEASURED_MACHINE} (notes/gpu-runtime.md). Everything else in this file is PREDICTED by "
        "`benchmarks/tpot_model.py`; `err` = predicted / measured - 1 of the measured cell (for what-if rows: the "
        "calibration error of the plugin cell at that bs, i.e. how far the baseline of the lever is off).",
        "",
        "## Calibration: predicted vs measured (ms per decode step)",
        "",
        "| EAGLE3 | bs | unconstrained meas / pred (err) | stock meas / pred (err) | plugin meas / pred (err) "
        "| plugin phases pred: gpu / sched / advance / mask / first-step |",
        "|---|---|---|---|---|---|",
    ]
    for (shape, bs), cols in MEASURED_H200.items():
        pr = predict(bs, shape, params)
        cells = [f"{cols[c]:.2f} / {_value(pr, c):.2f} ({errs[(shape, bs, c)] * 100:+.1f} %)"
                 for c in ("unconstrained", "stock", "plugin")]
        lines.append(f"| {shape} | {bs} | " + " | ".join(cells) + f" | {pr.gpu_ms:.2f} / {pr.sched_ms:.2f} / "
                     f"{pr.advance_ms:.2f} / {pr.mask_ms:.2f} / {pr.first_step_ms:.2f} |")
    one = MEASURED_H200_ONE_THREAD
    e1 = errs[(str(one["shape"]), int(one["bs"]), "plugin_1thread")]
    worst = max(abs(v) for v in errs.values())
    one_pred = predict(int(one["bs"]), str(one["shape"]), params, Levers(threads=1)).plugin_ms
    lines += [
        "",
        f"One mask thread, {one['shape']} bs {one['bs']}: measured {one['plugin']} ms, predicted "
        f"{one_pred:.2f} ms ({e1 * 100:+.1f} %). "
        f"Worst calibration error over all {len(errs)} measured cells: {worst * 100:.1f} %.",
        "",
        "## What-if (PREDICTED plugin ms/step; in brackets: over unconstrained; err = calibration error at that bs)",
        "",
        "| lever | EAGLE3 | " + " | ".join(f"bs {b}" for b in BATCH_SIZES) + " |",
        "|---|---|" + "---|" * len(BATCH_SIZES),
    ]
    for row in what_if_rows(params):
        cells = [f"{c['plugin_ms']:.2f} ({c['over_unconstrained'] * 100:+.0f} %, err {c['err_plugin'] * 100:+.1f} %)"
                 for c in row["cells"]]
        lines.append(f"| {row['lever']} | {row['shape']} | " + " | ".join(cells) + " |")
    lines += ["", "Parameters (ms): " + ", ".join(f"{k} {v:g}" for k, v in dataclasses.asdict(params).items()), ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Calibrated TPOT model: table vs measured H200 numbers, what-if rows.")
    ap.add_argument("--fit", action="store_true", help="re-fit the parameters on the measured table (needs scipy)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    params = fit() if args.fit else CALIBRATED
    if args.fit:
        print("fitted:", dataclasses.asdict(params))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(params)
    (out / "tpot_model.md").write_text(md)
    data = {
        "params": dataclasses.asdict(params),
        "measured_machine": MEASURED_MACHINE,
        "calibration_errors": {"/".join(map(str, k)): v for k, v in calibration_errors(params).items()},
        "what_if": what_if_rows(params),
    }
    (out / "tpot_model.json").write_text(json.dumps(data, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
