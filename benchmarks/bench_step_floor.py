"""What is left of (b) and what a leaner ledger could still cut: the 0.5.23 band's scheduler-thread CPU time per step,
split into a fixed part and a part per request, with a lower bound for the ledger's per-run Python.

After the native call, (b) -- the scheduler thread's extra time per constrained step -- is Python. Two questions
decide the next cut, and this benchmark answers both on this machine, outside the engine (the 0.5.23 band's own
functions on real ``XGrammarGrammar`` objects, 128k vocabulary, the ``nested`` JSON grammar, EAGLE topk 1, grammar
thread on; :func:`bench_thread_handoff.band_loop`):

1. **Fixed or per request?** The scheduler thread's CPU time in ``start_build`` + ``finish_build`` per step at bs
   1, 8 and 64; ``fixed`` and ``per request`` are the line through bs 1 and the largest batch. Before each step and
   between the two halves a stand-in forward writes 64 MB, so that the caches are as cold as after the engine's
   forward (hot, the same Python costs half as much).
2. **How far can the ledger's per-run Python go?** Step by step in the same process, alternating (A B B A), the
   shipped step and a *lean* one whose ``LedgerPlan.fill`` does only what a ledger kept in C++ would leave to Python:
   the run's tokens sliced from the native call's own reading, SGLang's ``XGrammarGrammar`` record, the ledger entry's
   position, liveness and history, one outcome per run (0.5.23's ``done`` reads them, in one pass) and no checks. It
   skips no native work, but it is **not exactly-once-safe** (no rejection or termination handling): a bound on the
   lever, not a candidate. ``lean/shipped`` is the ratio of the medians.

Run (the lock keeps it away from engine runs)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_step_floor.py

Writes ``benchmarks/results/step_floor.{json,md}``. Medians over the steps after a warm-up. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Dict, List, Tuple

# run as a script, benchmarks/ is on the path; bench_thread_handoff puts the checkout and dev/ there
from bench_thread_handoff import ROOT, paired_steps, save


def lean_variant() -> Tuple[Tuple[Any, ...], Tuple[Any, ...], Callable[[Tuple[Any, ...]], None]]:
    """The shipped ``(LedgerPlan.fill, step._fed)``, the lean ones (module docstring) and a function that installs one
    of the two pairs."""
    from sglang_eagle_overlap.core import ledger as ledger_mod
    from sglang_eagle_overlap.core import step as step_mod
    from sglang_eagle_overlap.core.ledger import LedgerPlan

    outcome = ledger_mod._outcome  # an FeedOutcome without its Python __new__ (0.5.23's done reads the outcomes)

    def lean_fill(plan: Any, feeds: Any, errors: Any, run_lens: Any, run_tokens: Any) -> None:
        batch = plan._batch
        plan._batch, plan._batched, plan._handles, plan._packed = [], set(), [], []
        plan._results, plan._result_at = [], {}
        out, depth = plan.out, plan.ledger._history
        at = 0
        for (slot, entry, start, grammar, _on_feed), n in zip(batch, run_lens):
            toks = run_tokens[at : at + n]  # as the native call read them (a tuple: the call's result is one)
            at += n
            grammar.current_token = toks[-1]
            grammar.accepted_tokens.extend(toks)
            entry.live, entry.consumed = True, start + len(toks)
            history = entry.history
            history[start] = toks
            if len(history) > depth:
                del history[next(iter(history))]
            out[slot] = outcome((start, toks, toks, False, None))

    shipped = (LedgerPlan.fill, step_mod._fed)
    lean = (lean_fill, lambda plan, slots: [plan.out[i] for i in slots])

    def install(pair: Tuple[Any, ...]) -> None:
        LedgerPlan.fill, step_mod._fed = pair

    return shipped, lean, install


def run(bs: int, steps: int, warmup: int) -> Dict[str, Any]:
    """One batch size: medians of the scheduler thread's CPU time per step, shipped and lean (alternating A B B A:
    :func:`bench_thread_handoff.paired_steps`)."""
    shipped, lean, install = lean_variant()
    per = paired_steps(bs, steps, warmup, lambda second: install(lean if second else shipped))
    a, b = statistics.median(per["a"]), statistics.median(per["b"])
    return {"bs": bs, "steps": len(per["a"]) + len(per["b"]), "shipped_ms": a * 1e3, "lean_ms": b * 1e3,
            "lean_ratio": b / a}


def markdown(res: Dict[str, Any]) -> str:
    m = res["machine"]
    rows = res["rows"]
    lines = [
        "# The scheduler thread's grammar time per step: fixed, per request, and the ledger's lower bound",
        "", f"Command: `{res['command']}`", "",
        f"xgrammar {m['xgrammar']}, torch {m['torch']}, Python {m['python']}, {m['cpus']} CPUs (shared, noisy). The "
        f"0.5.23 band outside the engine: real `XGrammarGrammar`s of SGLang {m['sglang']}, vocab 128000, `nested` JSON "
        "grammar, EAGLE topk 1, grammar thread on, caches evicted (64 MB written) before each step and between its "
        "halves. `shipped` / `lean` = medians of the scheduler thread's CPU ms in start_build + finish_build, the two "
        "alternating A B B A step by step in one process; `lean` is a bound, not exactly-once-safe (module "
        "docstring).", "",
        "| bs | steps | shipped ms | lean ms | lean/shipped |", "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['bs']} | {r['steps']} | {r['shipped_ms']:.3f} | {r['lean_ms']:.3f} | "
                     f"{r['lean_ratio']:.2f}x |")
    f = res["fit"]
    lines += ["", f"Line through bs {f['from_bs']} and {f['to_bs']}: shipped **{f['fixed_ms']:.3f} ms fixed + "
              f"{f['per_request_us']:.2f} us per request**; lean {f['lean_fixed_ms']:.3f} ms + "
              f"{f['lean_per_request_us']:.2f} us."]
    return "\n".join(lines) + "\n"


def fit(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """The line through the smallest and the largest batch size, for both variants."""
    lo, hi = min(rows, key=lambda r: r["bs"]), max(rows, key=lambda r: r["bs"])
    span = max(hi["bs"] - lo["bs"], 1)
    out: Dict[str, float] = {"from_bs": lo["bs"], "to_bs": hi["bs"]}
    for key, name in (("shipped_ms", ""), ("lean_ms", "lean_")):
        slope = (hi[key] - lo[key]) / span
        out[name + "per_request_us"] = slope * 1e3
        out[name + "fixed_ms"] = lo[key] - slope * lo["bs"]
    return out


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_floor"))
    args = ap.parse_args(argv)
    rows = []
    for bs in (int(x) for x in args.batches.split(",")):
        rows.append(run(bs, args.steps, args.warmup))
        print(rows[-1], flush=True)
    save(args.out, "benchmarks/bench_step_floor.py", argv, {"rows": rows, "fit": fit(rows)}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
