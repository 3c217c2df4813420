"""The grammar thread next to a busy scheduler thread: what each GIL round trip costs.

xgrammar releases the GIL inside every native call -- ``accept_token``, ``rollback``, ``is_terminated``, the fills.
A thread that makes many short native calls must win the GIL back after each one; while another thread runs Python,
CPython hands it back only when that thread's switch interval (``sys.getswitchinterval()``, 5 ms) runs out. So the
grammar thread's latency depends on the *number of native calls* it makes, not only on their cost, as soon as the
scheduler thread has Python to run at the same time. (Today it mostly has not: the scheduler thread joins the grammar
job right after the target-verify launch and waits with the GIL released. A loop that processes the previous result
before the join -- the reorder that would hide the grammar work behind the GPU's verify -- runs exactly into this.)

Two measurements, each alone and next to a thread that runs pure Python for the whole time (a stand-in for
``process_batch_result`` / scheduling; its own speed is reported too):

* ``calls``: 64 requests' matchers, one token each, accepted and rolled back: per request (2 x 64 native calls) vs
  xgrammar's batched ``BatchGrammarMatcher.batch_accept_token`` + ``batch_rollback`` (2 calls);
* ``job``: the plugin's grammar job of one verify step as the grammar thread runs it today -- ``AcceptLedger.advance``
  per request (the barrier) then ``TreeMaskBuilder.build`` (lockstep walk, batched fills) -- on the replayed decode of
  ``bench_grammar_step.py`` (``nested`` JSON grammar, vocab 128k, bs 64, EAGLE trees topk 1 / topk 4, 3 steps).

Run::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_gil_convoy.py [--quick]

Writes benchmarks/results/gil_convoy.{json,md} (``--out`` to change; ``--switch-interval-ms X`` runs with another
switch interval and adds ``_switchXms`` to the names). CPU only; medians; nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_grammar_step as step_bench  # noqa: E402
from sglang_eo_dev.helpers.steps import feed_one  # noqa: E402

VOCAB = 128000
BS = 64
TREES = [(1, 3), (4, 3)]


class Spinner:
    """A thread that runs pure Python until stopped, counting loop turns (its speed = turns per second)."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> "Spinner":
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()


def spinner_rate(seconds: float = 0.5) -> float:
    with Spinner() as s:
        c0, t0 = s.count, time.perf_counter()
        time.sleep(seconds)
        return (s.count - c0) / (time.perf_counter() - t0)


def timed(fn: Callable[[], object], seconds: float, busy: bool) -> Tuple[float, Optional[float]]:
    """Median wall seconds per call of ``fn`` over ``seconds`` (at least 3 calls), and the spinner's turns per second
    meanwhile when ``busy``."""
    def loop() -> List[float]:
        walls: List[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(walls) < 3:
            t = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t)
        return walls

    if not busy:
        return statistics.median(loop()), None
    with Spinner() as s:
        c0, t0 = s.count, time.perf_counter()
        walls = loop()
        rate = (s.count - c0) / (time.perf_counter() - t0)
    return statistics.median(walls), rate


def call_cases() -> Dict[str, Callable[[], object]]:
    import random

    import xgrammar as xgr

    from sglang_eo_dev.helpers import grammars as G

    docs = [list(G.doc_tokens("nested", random.Random(i), VOCAB)) for i in range(BS)]
    matchers = [G.matcher("nested", VOCAB, d[:3]) for d in docs]
    toks = [d[3] for d in docs]

    def per_request() -> None:
        for m, t in zip(matchers, toks):
            if not m.accept_token(t):
                raise RuntimeError("token rejected")
            m.rollback(1)

    def batched() -> None:
        if not all(xgr.BatchGrammarMatcher.batch_accept_token(matchers, toks)):
            raise RuntimeError("token rejected")
        xgr.BatchGrammarMatcher.batch_rollback(matchers, 1)

    return {f"{BS} x (accept_token + rollback): {2 * BS} native calls": per_request,
            "batch_accept_token + batch_rollback: 2 native calls": batched}


def job_case(topk: int, steps: int, n_steps: int) -> Tuple[Callable[[], object], int]:
    """One replayed verify step per call (cycling through ``n_steps`` planned steps on fresh grammars each cycle)."""
    from sglang_eagle_overlap.core.ledger import AcceptLedger
    from sglang_eagle_overlap.core.mask import TreeMaskBuilder
    from sglang_eagle_overlap.integration.requests import mask_request_for

    plan = step_bench.make_plan("nested", VOCAB, topk, steps, BS, n_steps, 3)
    stride = step_bench.num_draft_tokens(topk, steps)
    inputs = []
    for s in range(n_steps):
        ids, lens = step_bench._accept_lists(plan, s, BS, stride)
        inputs.append((ids.tolist(), lens.tolist(), [t[:BS] for t in plan.trees[s]]))
    state: Dict[str, Any] = {"step": n_steps}
    builder = TreeMaskBuilder(strategy="lockstep", threads=1)

    def run() -> None:
        if state["step"] == n_steps:  # a new cycle: fresh matchers at the plan's start
            state.update(step=0, ledger=AcceptLedger(), pos=list(plan.starts),
                         reqs=[SimpleNamespace(grammar=g, rid=f"r{i}", finished=lambda: False)
                               for i, g in enumerate(step_bench._grammars("nested", VOCAB, plan, BS))])
        nti, lens, (nxt, sib, tok) = inputs[state["step"]]
        ledger, pos = state["ledger"], state["pos"]
        for i, r in enumerate(state["reqs"]):
            out = feed_one(ledger, r.rid, r.grammar, pos[i], nti[i * stride: i * stride + lens[i]])
            pos[i] += len(out.retained)
        builder.build([mask_request_for(r) for r in state["reqs"]], nxt, sib, tok, VOCAB)
        state["step"] += 1

    return run, stride


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter timings (a smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for this run (default: CPython's 5 ms); results get a suffix")
    args = ap.parse_args()
    suffix = ""
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
        suffix = f"_switch{args.switch_interval_ms:g}ms"
    seconds = 0.3 if args.quick else 2.0
    alone_rate = spinner_rate()
    rows = []
    for name, fn in call_cases().items():
        fn()
        a, _ = timed(fn, seconds, False)
        b, rate = timed(fn, seconds, True)
        rows.append({"case": "calls", "what": name, "alone_ms": a * 1e3, "busy_ms": b * 1e3,
                     "scheduler_speed": (rate or 0.0) / alone_rate})
    for topk, steps in TREES:
        fn, n = job_case(topk, steps, 4 if args.quick else 10)
        fn()
        a, _ = timed(fn, seconds, False)
        b, rate = timed(fn, seconds, True)
        rows.append({"case": "job", "what": f"grammar job of one verify step, topk {topk} ({n} nodes), bs {BS}",
                     "alone_ms": a * 1e3, "busy_ms": b * 1e3, "scheduler_speed": (rate or 0.0) / alone_rate})
    import xgrammar  # noqa: F401
    from importlib.metadata import version

    env = (f"xgrammar {version('xgrammar')}, Python {platform.python_version()}, switch interval "
           f"{sys.getswitchinterval() * 1e3:.1f} ms, {len(__import__('os').sched_getaffinity(0))} CPUs (shared, noisy)")
    cmd = "flock /tmp/sglang-engine.lock " + shlex.join([sys.executable.replace(str(ROOT) + "/", ""),
                                                          "benchmarks/bench_gil_convoy.py", *sys.argv[1:]])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gil_convoy{suffix}.json").write_text(json.dumps({"command": cmd, "env": env, "rows": rows}, indent=1))
    lines = ["# The grammar thread next to a busy scheduler thread", "",
             f"Command: `{cmd}`", "", env + ". Medians per call. `busy` = while another thread runs pure Python "
             "throughout (the scheduler thread's stand-in); `scheduler speed` = that thread's loop rate meanwhile, "
             "relative to its rate alone.", "",
             "| case | what | alone ms | next to busy Python ms | slowdown | scheduler speed |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['what']} | {r['alone_ms']:.3f} | {r['busy_ms']:.1f} | "
                     f"{r['busy_ms'] / r['alone_ms']:.0f}x | {r['scheduler_speed']:.2f} |")
    (args.out / f"gil_convoy{suffix}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
