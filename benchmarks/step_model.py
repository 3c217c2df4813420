"""A mechanistic model of the constrained EAGLE decode step on a GPU, with ONE calibrated constant (issue 17).

In steady state an overlapped step lasts as long as its slowest resource::

    step(c) = max( G(c),                     # GPU work: the measured unconstrained step of cell c (GPU table)
                   k * (a(c) + b(c)),        # scheduler thread: SGLang's own CPU work + the grammar's share of it
                   k * w(c) )                # grammar thread (new path): its whole chain, which must end by sampling

* ``G`` comes from the measured GPU table (``benchmarks/data/gpu_h200_0.5.16.json``): unconstrained decoding is
  GPU-bound there, so its step time *is* the GPU work of the cell.
* ``a``, ``b``, ``w`` are this machine's scheduler-thread measurements (``bench_scheduler_budget.py``, same SGLang
  band): (a) SGLang's own scheduler-thread ms per unconstrained step, (b) the constrained step's extra
  scheduler-thread ms for the path (inline: all of the grammar work; grammar thread: hand-off + join wait + upload +
  its GIL time), ``w`` the grammar thread's work (advance + tree wait + mask; 0 for the inline path, whose work is in
  ``b``).
* ``k`` -- the only fitted number -- is the GPU host's CPU time per unit of this machine's. It is fitted on ONE cell
  (default topk 1, bs 64, where the measured plugin step is CPU-bound: ``k = plugin(c0) / (a + b_inline)(c0)``); every
  other cell of the measured plugin column is then predicted out of sample and its error reported. The same ``k``
  predicts the grammar-thread path, for which no GPU measurement exists yet: those numbers are PREDICTIONS.

What the one constant cannot hold (said next to the numbers): fill threads (8 on the GPU host, 1 here) speed up only
the fill share of the grammar work; the GPU host runs SGLang 0.5.16 with CUDA graphs, so its per-step launch work
is smaller relative to this machine's eager CPU forward bookkeeping.

Run::

    .venvs/sglang-0.5.16/bin/python benchmarks/step_model.py   # reads benchmarks/results/scheduler_budget_0.5.16.json

Writes ``benchmarks/results/step_model.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
GPU_TABLE = ROOT / "benchmarks" / "data" / "gpu_h200_0.5.16.json"

Cell = Tuple[str, int]


@dataclass(frozen=True)
class CpuTerms:
    """This machine's scheduler-thread ms per step for one cell (``bench_scheduler_budget``)."""

    a: float  # SGLang's own, unconstrained
    b_inline: float  # grammar's extra, inline path
    b_thread: float  # grammar's extra, grammar-thread path
    w_thread: float  # the grammar thread's work (advance + tree wait + mask)


def predict(g: float, k: float, a: float, b: float, w: float = 0.0) -> float:
    """``max(G, k (a + b), k w)`` (module docstring)."""
    return max(g, k * (a + b), k * w)


def fit_k(measured: float, g: float, a: float, b: float) -> float:
    """The one constant from one cell whose measured step is CPU-bound (``measured > G``)."""
    if measured <= g:
        raise ValueError(f"the fit cell must be CPU-bound: measured {measured} ms <= GPU work {g} ms")
    if a + b <= 0:
        raise ValueError("the fit cell has no CPU terms")
    return measured / (a + b)


def cpu_terms(budget: Dict[str, Any]) -> Dict[Cell, CpuTerms]:
    """Cells of a ``scheduler_budget_<v>.json`` result that have both paths measured."""
    out: Dict[Cell, CpuTerms] = {}
    for row in budget["rows"]:
        inl, thr = row.get("inline"), row.get("thread")
        if not inl or not thr:
            continue
        bi, bt = inl["budget"], thr["budget"]
        a_vals = [x for x in (bi.get("a_ms"), bt.get("a_ms")) if x is not None]
        if not a_vals or bi.get("b_ms") is None or bt.get("b_ms") is None:
            continue
        p = thr.get("plugin") or {}
        w = p.get("advance_ms", 0.0) + p.get("tree_wait_ms", 0.0) + p.get("mask_ms", 0.0)
        out[(row["spec"], int(row["bs"]))] = CpuTerms(a=sum(a_vals) / len(a_vals), b_inline=bi["b_ms"],
                                                      b_thread=bt["b_ms"], w_thread=w)
    return out


def evaluate(gpu: Sequence[Dict[str, Any]], cpu: Dict[Cell, CpuTerms], fit_cell: Cell) -> Dict[str, Any]:
    """Fit ``k`` on ``fit_cell``; predict every cell: the inline path against the measured plugin column (error
    out of sample everywhere but the fit cell), the grammar-thread path as a prediction."""
    table = {(c["spec"], int(c["bs"])): c for c in gpu}
    if fit_cell not in table or fit_cell not in cpu:
        raise ValueError(f"fit cell {fit_cell} needs both a GPU measurement and CPU terms")
    f, t = table[fit_cell], cpu[fit_cell]
    k = fit_k(f["plugin"], f["unconstrained"], t.a, t.b_inline)
    rows: List[Dict[str, Any]] = []
    for cell in sorted(set(table) & set(cpu), key=lambda c: (c[0], c[1])):
        m, t = table[cell], cpu[cell]
        g = m["unconstrained"]
        inline = predict(g, k, t.a, t.b_inline)
        thread = predict(g, k, t.a, t.b_thread, t.w_thread)
        rows.append({
            "spec": cell[0], "bs": cell[1], "gpu_ms": g, "measured_plugin_ms": m["plugin"],
            "pred_inline_ms": inline, "inline_error": inline / m["plugin"] - 1, "in_sample": cell == fit_cell,
            "pred_thread_ms": thread, "thread_over_unconstrained": thread / g - 1,
            "thread_bound": ("GPU" if thread == g else "scheduler thread" if thread == k * (t.a + t.b_thread)
                             else "grammar thread"),
            "cpu": t.__dict__,
        })
    oos = [abs(r["inline_error"]) for r in rows if not r["in_sample"]]
    return {"k": k, "fit_cell": list(fit_cell), "rows": rows, "max_oos_error": max(oos) if oos else None}


def markdown(res: Dict[str, Any], sources: Dict[str, str]) -> str:
    lines = [
        "# Step model: max(GPU work, k x scheduler-thread CPU, k x grammar-thread chain), one fitted constant",
        "",
        f"GPU work and the measured plugin column: {sources['gpu']}. CPU terms: `{sources['cpu']}` (this 2-core "
        f"machine, same SGLang band). k = **{res['k']:.3f}** (GPU host CPU ms per ms here), fitted on "
        f"{res['fit_cell'][0]} bs {res['fit_cell'][1]} only. Largest out-of-sample error of the inline prediction: "
        f"**{res['max_oos_error'] * 100:.1f} %**.",
        "",
        "`inline` is the path the GPU table measured (grammar on the scheduler thread); its prediction is checked "
        "against the measurement. `thread` (the grammar thread, the new default) is PREDICTED: no GPU has run it.",
        "",
        "| EAGLE3 | bs | GPU (unconstrained) ms | plugin measured ms | inline predicted ms | error | thread "
        "PREDICTED ms | thread over unconstrained | bound by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        err = f"{r['inline_error'] * 100:+.1f} %" + (" (fit)" if r["in_sample"] else "")
        lines.append(
            f"| {r['spec']} | {r['bs']} | {r['gpu_ms']:.2f} | {r['measured_plugin_ms']:.2f} | "
            f"{r['pred_inline_ms']:.2f} | {err} | {r['pred_thread_ms']:.2f} | "
            f"{r['thread_over_unconstrained'] * 100:+.1f} % | {r['thread_bound']} |"
        )
    lines += ["", "CPU terms per cell (ms on this machine): " + "; ".join(
        f"{r['spec']} bs{r['bs']}: a {r['cpu']['a']:.2f}, b inline {r['cpu']['b_inline']:.2f}, b thread "
        f"{r['cpu']['b_thread']:.2f}, w thread {r['cpu']['w_thread']:.2f}" for r in res["rows"]), ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default=str(ROOT / "benchmarks" / "results" / "scheduler_budget_0.5.16.json"))
    ap.add_argument("--gpu", default=str(GPU_TABLE))
    ap.add_argument("--fit", default="topk1,64", help="the one fit cell: spec,bs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    gpu = json.loads(Path(args.gpu).read_text())
    budget = json.loads(Path(args.budget).read_text())
    spec, bs = args.fit.split(",")
    res = evaluate(gpu["cells"], cpu_terms(budget), (spec, int(bs)))
    res["sources"] = {"gpu": gpu["source"], "cpu": Path(args.budget).name}
    md = markdown(res, res["sources"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_model.json").write_text(json.dumps(res, indent=1))
    (out / "step_model.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
