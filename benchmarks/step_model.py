"""A mechanistic model of the overlapped, constrained EAGLE decode step on a GPU, with ONE calibrated constant.

In steady state an overlapped step lasts as long as its slower side::

    step(c) = max( G(c),               # GPU work: the measured unconstrained step of cell c (H200, 2026-11-24)
                   k * (a(c) + b(c)) ) # scheduler thread: SGLang's own CPU work + the grammar's, this machine's ms x k

* ``G``: the median unconstrained decode step of the cell, measured on the H200 by ``bench_gpu_constrained.py``
  (``benchmarks/results/gpu_constrained_cuda_0.5.16_h200_*.json``, the scheduler-timed step records).
* ``a``, ``b``: this machine's scheduler-thread ms per step for the same cell and SGLang band
  (``bench_scheduler_budget.py``): (a) SGLang's own CPU work of an unconstrained step -- step minus device work, the
  model forward and the device share of every other tensor op, so what remains is what a GPU host's scheduler thread
  also runs --, (b) the extra of a constrained step for one plugin revision (its grammar calls).
* ``k`` -- the only fitted number -- is the GPU host's CPU time per unit of this machine's. It is fitted on ONE cell
  from a quantity both machines measured the same way: the CPU time of SGLang's own ``run_batch`` in an
  unconstrained step (launches and their Python; on the GPU host ``run_batch`` does not wait for the device in an
  overlapped EAGLE v2 step, here its device work is taken out): ``k = R_gpu(c0) / r_here(c0)``.

Checked out of sample, with the errors printed next to the predictions:

1. ``k x r_here`` against the GPU host's ``run_batch`` ms on every other cell (does one constant carry this machine's
   CPU time to the GPU host's, across batch sizes and tree shapes?);
2. the step of the plugin revision the H200 measured (``--measured-rev``, inline path, forced drafts off) against its
   measured median on every cell.

Then the new path (this checkout's default, the grammar thread) is PREDICTED per cell, with its margin
``G - k (a + b)``: a positive margin is CPU work hidden under the GPU's. Its (b) is what the scheduler thread spends:
the barrier's ledger checks and the build's preparation before the launch, the join's wait and the records after it,
plus the grammar thread's GIL time. How much of the native call the GPU host's verify launch overlaps is not measured
(on the CPU engine the synchronous forward hides all of it, so the join waits ~0): the prediction is therefore given
as a range, from ``b = b_thread`` (all of it overlapped) to ``b = b_inline`` (none of it: the same native call made
serially on the scheduler thread, measured in the same run), and the verdict is read from the second.

What the model is not: the stock SGLang column (grammar batches leave the overlap, so its step is GPU + a serial part
of the CPU work plus sync bubbles, not ``max``) is outside it and not predicted, nor the first grammar thread design
(its Python on the helper: its step was set by GIL round trips, a latency the CPU-time terms do not hold). Nor does
it hold the mean step, which the slow xgrammar mask states set (docs/troubleshooting.md, "Known upstream limits").

Run (needs no GPU and no engine: it reads committed results)::

    python benchmarks/step_model.py

Writes ``benchmarks/results/step_model.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GPU_FILES = tuple(RESULTS / f"gpu_constrained_cuda_0.5.16_h200_{s}.json"
                  for s in ("topk1", "topk1_inline", "topk4", "topk4_inline"))
# the new path measured on the H200 (2026-11-27, `run.sh bench-table`, the mask upload on its side stream): its `json`
# variant is this checkout's default path (the same path with the upload on the verify's stream: ..._h200_table.json)
NEW_GPU_FILES = (RESULTS / "gpu_constrained_cuda_0.5.16_h200_table_upload.json",)
BUDGET = RESULTS / "scheduler_budget_0.5.16_step_model.json"
# the budget file's path holding the revision the H200 measured (recorded in the file; forced drafts off)
MEASURED_REV = "before"
NEW_PATH = "thread"  # this checkout's default path
BOUND_PATH = "inline"  # the same native call made on the scheduler thread: the new path with nothing overlapped

Cell = Tuple[str, int]


def full_batch_records(results: Sequence[Dict[str, Any]]) -> Dict[Tuple[str, int, str], List[List[float]]]:
    """Per (shape, bs, variant), the step records ``[step_ms, grammar_ms, run_batch_ms, bs, ...]`` of every round whose
    batch held all ``bs`` requests, pooled over the runs given; a variant without such a record is left out."""
    pooled: Dict[Tuple[str, int, str], List[List[float]]] = {}
    for res in results:
        for raw in res.get("raw", []):
            key = (raw["shape"], int(raw["bs"]), raw["variant"])
            for rnd in raw["rounds"]:
                pooled.setdefault(key, []).extend(s for s in rnd["steps"] if int(s[3]) == int(raw["bs"]))
    return {k: v for k, v in pooled.items() if v}


def gpu_cells(results: Sequence[Dict[str, Any]]) -> Dict[Cell, Dict[str, float]]:
    """Per cell, medians over the full-batch step records of the H200 runs: ``G`` (unconstrained step), ``R``
    (unconstrained ``run_batch`` ms) and ``inline`` (the plugin's inline path, ``json-inline``). A variant measured in
    several runs pools their records."""
    cells: Dict[Cell, Dict[str, float]] = {}
    for (spec, bs, variant), steps in full_batch_records(results).items():
        c = cells.setdefault((spec, bs), {})
        if variant == "unconstrained":
            c["G"] = statistics.median(s[0] for s in steps)
            c["R"] = statistics.median(s[2] for s in steps)
        elif variant == "json-inline":
            c["inline"] = statistics.median(s[0] for s in steps)
    return {k: v for k, v in cells.items() if "G" in v and "R" in v}


def new_path_cells(results: Sequence[Dict[str, Any]]) -> Dict[Cell, Dict[str, float]]:
    """Per cell, from H200 runs of the new path (``json`` = the default path of the code they ran): ``G_run`` (that
    run's own unconstrained median step) and ``new`` (the new path's median step), full-batch records pooled."""
    names = {"unconstrained": "G_run", "json": "new"}
    out: Dict[Cell, Dict[str, float]] = {}
    for (spec, bs, variant), steps in full_batch_records(results).items():
        if variant in names:
            out.setdefault((spec, bs), {})[names[variant]] = statistics.median(s[0] for s in steps)
    return {k: v for k, v in out.items() if "G_run" in v and "new" in v}


def cpu_cells(budget: Dict[str, Any], paths: Sequence[str]) -> Dict[Cell, Dict[str, float]]:
    """Per cell of a ``bench_scheduler_budget`` result: ``a`` and ``r`` (SGLang's own scheduler-thread ms and its
    ``run_batch`` CPU ms per unconstrained step, averaged over the engines of ``paths``) and ``b_<path>`` for each
    path. Only cells whose records carry the device split (``device_ms``)."""
    out: Dict[Cell, Dict[str, float]] = {}
    for row in budget["rows"]:
        a_vals, r_vals, c = [], [], {}
        for path in paths:
            p = row.get(path)
            if not p:
                continue
            unc = p["unconstrained"]
            if unc.get("device_ms") is None or unc.get("run_cpu_ms") is None:
                continue
            a_vals.append(unc["cpu_ms"])
            r_vals.append(unc["run_cpu_ms"])
            if p["budget"].get("b_ms") is not None:
                c[f"b_{path}"] = p["budget"]["b_ms"]
        if a_vals:
            c["a"] = sum(a_vals) / len(a_vals)
            c["r"] = sum(r_vals) / len(r_vals)
            out[(row["spec"], int(row["bs"]))] = c
    return out


def margin(g: float, k: float, a: float, b: float) -> float:
    """``G - k (a + b)``: the CPU work still hidden under the GPU's (negative: the scheduler thread sets the step)."""
    return g - k * (a + b)


def predict(g: float, k: float, a: float, b: float) -> float:
    """``max(G, k (a + b))`` (module docstring)."""
    return g - min(0.0, margin(g, k, a, b))


def fit_k(r_gpu: float, r_here: float) -> float:
    """The one constant from one cell: the GPU host's ``run_batch`` CPU ms over this machine's."""
    if r_gpu <= 0 or r_here <= 0:
        raise ValueError(f"the fit cell needs positive run_batch CPU times on both machines, got {r_gpu} / {r_here}")
    return r_gpu / r_here


def evaluate(gpu: Dict[Cell, Dict[str, float]], cpu: Dict[Cell, Dict[str, float]], fit_cell: Cell,
             measured: str = MEASURED_REV, new: str = NEW_PATH, bound: Optional[str] = BOUND_PATH,
             new_gpu: Optional[Dict[Cell, Dict[str, float]]] = None) -> Dict[str, Any]:
    """Fit ``k`` on ``fit_cell``; per cell: the ``run_batch`` check, the measured revision's step against the H200's
    median (both out of sample everywhere but the fit cell's ``run_batch``), the new path's prediction and margin, and
    with ``bound`` the same for that path's (b) (module docstring: the new path with none of its native call
    overlapped). With ``new_gpu`` (:func:`new_path_cells`), the new path's prediction is checked against its H200
    measurement: the predicted overhead over G carried to that run's own unconstrained step, against the measured
    step (``new_error``; out of sample on every cell: nothing of that run went into the fit)."""
    if fit_cell not in gpu or fit_cell not in cpu:
        raise ValueError(f"fit cell {fit_cell} needs both an H200 measurement and this machine's CPU terms")
    k = fit_k(gpu[fit_cell]["R"], cpu[fit_cell]["r"])
    cells = sorted(set(gpu) & set(cpu))
    rows: List[Dict[str, Any]] = []
    for cell in cells:
        g, c = gpu[cell], cpu[cell]
        row: Dict[str, Any] = {"spec": cell[0], "bs": cell[1], "G": g["G"], "fit": cell == fit_cell,
                               "R_gpu": g["R"], "R_pred": k * c["r"], "R_error": k * c["r"] / g["R"] - 1,
                               "a": c["a"], "r": c["r"]}
        b_old, b_new = c.get(f"b_{measured}"), c.get(f"b_{new}")
        if b_old is not None and g.get("inline") is not None:
            pred = predict(g["G"], k, c["a"], b_old)
            row.update(b_measured=b_old, measured_step=g["inline"], measured_over_G=g["inline"] / g["G"] - 1,
                       pred_measured=pred, step_error=pred / g["inline"] - 1)
        if b_new is not None:
            pred = predict(g["G"], k, c["a"], b_new)
            row.update(b_new=b_new, pred_new=pred, pred_new_over_G=pred / g["G"] - 1,
                       margin_ms=margin(g["G"], k, c["a"], b_new))
            m = (new_gpu or {}).get(cell)
            if m is not None:
                row.update(new_measured=m["new"], new_measured_over_G=m["new"] / m["G_run"] - 1,
                           new_error=(pred / g["G"]) * m["G_run"] / m["new"] - 1)
        b_bound = c.get(f"b_{bound}") if bound else None
        if b_bound is not None:
            pred = predict(g["G"], k, c["a"], b_bound)
            row.update(b_bound=b_bound, pred_bound=pred, pred_bound_over_G=pred / g["G"] - 1,
                       margin_bound_ms=margin(g["G"], k, c["a"], b_bound))
        rows.append(row)
    # the same model fitted on each cell in turn: does the new path's verdict depend on which cell set k?
    by_fit = []
    for cell in cells:
        kc = fit_k(gpu[cell]["R"], cpu[cell]["r"])
        margins = [margin(gpu[c]["G"], kc, cpu[c]["a"], cpu[c][f"b_{new}"]) for c in cells if f"b_{new}" in cpu[c]]
        by_fit.append({"spec": cell[0], "bs": cell[1], "k": kc, "min_margin_ms": min(margins) if margins else None})
    r_oos = [abs(r["R_error"]) for r in rows if not r["fit"]]
    s_oos = [abs(r["step_error"]) for r in rows if "step_error" in r]
    n_oos = [abs(r["new_error"]) for r in rows if "new_error" in r]
    return {"k": k, "fit_cell": list(fit_cell), "rows": rows, "by_fit_cell": by_fit,
            "max_R_error": max(r_oos) if r_oos else None, "max_step_error": max(s_oos) if s_oos else None,
            "max_new_error": max(n_oos) if n_oos else None,
            "max_new_over_G": max((r["pred_new_over_G"] for r in rows if "pred_new_over_G" in r), default=None),
            "max_bound_over_G": max((r["pred_bound_over_G"] for r in rows if "pred_bound_over_G" in r),
                                    default=None)}


def markdown(res: Dict[str, Any]) -> str:
    def pct(x: Optional[float]) -> str:
        return "–" if x is None else f"{x * 100:+.1f} %"

    def ms(x: Optional[float]) -> str:
        return "–" if x is None else f"{x:.2f}"

    src = res["sources"]
    lines = [
        "# Step model: max(GPU work, k x scheduler-thread CPU), one fitted constant",
        "",
        f"GPU: {src['gpu']} (medians of the scheduler-timed full-batch steps). CPU terms: `{src['cpu']}` (this 2-core "
        f"machine, SGLang {src.get('sglang', '0.5.16')}). k = **{res['k']:.3f}** (GPU host CPU ms per ms here), "
        f"fitted on the unconstrained `run_batch` CPU time of {res['fit_cell'][0]} bs {res['fit_cell'][1]} only.",
        "",
        f"Out of sample: largest `run_batch` error **{pct(res['max_R_error'])[1:]}**; largest step error for the "
        f"revision the H200 measured (`{src['measured']}`) **{pct(res['max_step_error'])[1:]}**. The new path "
        f"(`{src['new']}`) is PREDICTED: largest predicted overhead over unconstrained "
        f"**{pct(res['max_new_over_G'])}**"
        + (f", **{pct(res.get('max_bound_over_G'))}** with none of its native call overlapped (`{src['bound']}`'s "
           f"(b))" if res.get("max_bound_over_G") is not None else "") + "."
        + (f" Against the new path's H200 measurement ({src.get('new_gpu', '')}, each cell over its own run's "
           f"unconstrained step): largest error **{pct(res['max_new_error'])[1:]}**."
           if res.get("max_new_error") is not None else ""),
        "",
        "| EAGLE3 | bs | G: unconstrained ms (H200) | run_batch ms: H200 / k x here | error | measured rev.: H200 ms "
        "(over G) | predicted ms | error | new path PREDICTED ms (over G) | margin ms | no overlap: PREDICTED ms "
        "(over G) | margin ms | a / b new / b no overlap ms here | new path MEASURED ms (over its run's unc.) | "
        "error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['spec']} | {r['bs']} | {ms(r['G'])} | {ms(r['R_gpu'])} / {ms(r['R_pred'])} | "
            f"{pct(r['R_error'])}{' (fit)' if r['fit'] else ''} | "
            f"{ms(r.get('measured_step'))} ({pct(r.get('measured_over_G'))}) | {ms(r.get('pred_measured'))} | "
            f"{pct(r.get('step_error'))} | {ms(r.get('pred_new'))} ({pct(r.get('pred_new_over_G'))}) | "
            f"{ms(r.get('margin_ms'))} | {ms(r.get('pred_bound'))} ({pct(r.get('pred_bound_over_G'))}) | "
            f"{ms(r.get('margin_bound_ms'))} | {ms(r['a'])} / {ms(r.get('b_new'))} / {ms(r.get('b_bound'))} | "
            f"{ms(r.get('new_measured'))} ({pct(r.get('new_measured_over_G'))}) | {pct(r.get('new_error'))} |")
    fits = res.get("by_fit_cell") or []
    if fits:
        lines += ["", "The new path's smallest margin with k fitted on each cell in turn: " + "; ".join(
            f"{f['spec']} bs {f['bs']}: k {f['k']:.2f}, {ms(f['min_margin_ms'])} ms" for f in fits) + "."]
    lines += ["", "Not modelled: stock SGLang (non-overlapped grammar batches), the first grammar thread design (GIL "
              "round trips), the mean step (slow xgrammar mask states). See the module docstring.", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default=str(BUDGET), help="a bench_scheduler_budget result (SGLang 0.5.16)")
    ap.add_argument("--gpu", nargs="*", default=[str(p) for p in GPU_FILES], help="bench_gpu_constrained results")
    ap.add_argument("--new-gpu", nargs="*", default=[str(p) for p in NEW_GPU_FILES],
                    help="bench_gpu_constrained results of the new path (its `json` variant), to check the prediction")
    ap.add_argument("--fit", default="topk1,64", help="the one fit cell: spec,bs")
    ap.add_argument("--measured-rev", default=MEASURED_REV, help="the budget path of the revision the H200 measured")
    ap.add_argument("--new", default=NEW_PATH, help="the budget path of the new code")
    ap.add_argument("--bound", default=BOUND_PATH, help="the budget path whose (b) is the new code's without overlap")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    budget = json.loads(Path(args.budget).read_text())
    gpu = gpu_cells([json.loads(Path(p).read_text()) for p in args.gpu])
    paths = list(dict.fromkeys(r["path"] for r in budget["runs"]))
    spec, bs = args.fit.split(",")
    new_gpu = new_path_cells([json.loads(Path(p).read_text()) for p in args.new_gpu])
    res = evaluate(gpu, cpu_cells(budget, paths), (spec, int(bs)), args.measured_rev, args.new, args.bound,
                   new_gpu=new_gpu)
    res["sources"] = {"gpu": ", ".join(f"`{Path(p).name}`" for p in args.gpu), "cpu": Path(args.budget).name,
                      "sglang": budget["machine"]["sglang"], "measured": f"{args.measured_rev} = "
                      f"{budget.get('before')} (forced drafts {budget.get('before_forced') or 'default'})",
                      "new": args.new, "bound": args.bound,
                      "new_gpu": ", ".join(f"`{Path(p).name}`" for p in args.new_gpu)}
    md = markdown(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_model.json").write_text(json.dumps(res, indent=1))
    (out / "step_model.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
