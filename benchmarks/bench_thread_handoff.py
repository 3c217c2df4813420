"""When can the grammar thread start? Its hand-off against a scheduler thread that holds the GIL.

``GrammarStep.start_build`` hands the step's native call to the grammar thread and returns; the scheduler thread then
launches the target verify. The helper needs the GIL for a few bytecodes before its GIL-free call (it wakes from a
lock, then runs Python to reach the call). While the scheduler thread runs pure Python -- a verify launch that makes
no GIL-releasing call -- CPython hands the GIL over only at the end of a switch interval (5 ms) or when that thread
blocks: at the join. This benchmark measures that, outside the engine, with the 0.5.23 band's functions on real
``XGrammarGrammar`` objects (128k vocabulary, the ``nested`` JSON grammar, EAGLE topk 1, the previous step's runs fed in
the same native call): per step, the wall time from ``start_build`` to the end of ``finish_build`` around a stand-in
launch that busy-loops in Python for ``--launch-ms``, and the helper's hand-off latency (``StepTelemetry.stats``'
``handoff_s``: from the hand-off to its first bytecode). Paths:

* ``inline``: the whole grammar work after the launch, on the scheduler thread;
* ``thread``: the product's grammar thread;
* ``thread+handshake``: the same, with ``start_build`` waiting (GIL released) until the helper has entered its job: a
  stand-in for a start that needs no GIL from the scheduler thread (not the product's code: this benchmark patches it).

A CPU model of one question a GPU run must answer (how much Python the GPU host's verify launch runs before its first
GIL-releasing call), not a GPU measurement; on the CPU engine the forward's torch calls release the GIL and the
helper starts ~0.3-0.4 ms after the hand-off (``bench_scheduler_budget.py``'s ``handoff_ms``). Run::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_thread_handoff.py

Writes ``benchmarks/results/thread_handoff.{json,md}``. Medians over the steps after a warm-up. Not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "dev"))
from bench_engine_step import _machine  # noqa: E402
from bench_grammar_step import _accept_lists, _grammars, make_plan  # noqa: E402
from sglang_eo_dev.helpers.devices import DecodeMode  # noqa: E402
from sglang_eo_dev.helpers.steps import make_step  # noqa: E402

VOCAB = 128000
STRIDE = 8
PATHS = ("inline", "thread", "thread+handshake")


def _busy(seconds: float) -> None:
    """The stand-in verify launch: Python that holds the GIL throughout."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _handshake(step_mod: Any) -> None:
    """Make ``start_build`` wait (GIL released) until the grammar thread has entered its job (benchmark-only patch)."""
    started = threading.Lock()
    started.acquire()
    job, submit = step_mod._native_job, step_mod._GrammarThread.submit

    def entered(*args: Any) -> Any:
        started.release()
        return job(*args)

    def submit_and_wait(self: Any, fn: Any, *args: Any) -> Any:
        out = submit(self, fn, *args)
        started.acquire()
        return out

    step_mod._native_job = entered
    step_mod._GrammarThread.submit = submit_and_wait


def band_loop(bs: int, steps: int, grammar_thread: bool, launch: Callable[[], None],
              before_step: Optional[Callable[[int], None]] = None) -> Iterator[Dict[str, float]]:
    """The 0.5.23 band's verify step, ``steps`` times, outside the engine: real ``XGrammarGrammar`` objects (``VOCAB``,
    the ``nested`` JSON grammar, EAGLE topk 1), each step's barrier feeding the previous step's runs
    (``band.advance_grammar_fsm``), ``start_build`` -> ``launch()`` (the stand-in verify launch) -> ``finish_build``,
    and the retained runs appended as SGLang's post-processing would. ``before_step(s)`` runs before step ``s``
    (outside the timed part; the band's and the requests module's functions are looked up at every step, so it may
    swap them). Yields per step: ``s``, ``wall_s`` (start_build .. end of finish_build), ``sched_cpu_s`` (the calling
    thread's CPU time in start_build and finish_build, not in the launch), ``handoff_s``, and ``kept`` / ``offered``:
    the tokens the step's retained runs hold and the tokens its result offered (equal: every run kept whole)."""
    from sglang_eagle_overlap.adapters.v0_5_23 import band
    from sglang_eagle_overlap.core.step import GrammarStep
    from sglang_eagle_overlap.integration import requests as rq
    from sglang_eagle_overlap.integration.runtime import load_native_for

    plan = make_plan("nested", VOCAB, 1, 3, bs, steps + 1, 0)
    reqs = [SimpleNamespace(grammar=g, rid=f"r{i}", finished=lambda: False, to_finish=None, is_retracted=False,
                            inflight_middle_chunks=0, output_ids=list(plan.docs[i][: plan.starts[i]]))
            for i, g in enumerate(_grammars("nested", VOCAB, plan, bs))]
    batch = SimpleNamespace(reqs=reqs, forward_mode=DecodeMode(), has_grammar=True,
                            sampling_info=SimpleNamespace(vocab_size=VOCAB))
    step = make_step(grammar_thread=grammar_thread, grammar_thread_min_batch=1, mask_time_limit_s=None,
                     native=functools.partial(load_native_for, True))
    rt = SimpleNamespace(step=step, band=None)  # the runtime fields the band reads (its band made at first use)
    try:
        for s in range(1, steps + 1):
            if before_step is not None:
                before_step(s)
            ids, lens = _accept_lists(plan, s - 1, bs, STRIDE)
            result = SimpleNamespace(next_token_ids=ids, accept_lens=lens, copy_done=None, grammar_advanced=False,
                                     speculative_output_stride=STRIDE, grammar_retained_tokens=None)
            nxt, sib, tok = (t[:bs] for t in plan.trees[s])
            pending = step.copy_host_tree(nxt, sib, tok)
            draft = tok.clone()
            h0 = step.telemetry.stats.handoff_s
            t0, c0 = time.perf_counter(), time.thread_time()
            job = step.start_build(rq.mask_requests(reqs), pending, vocab_size=VOCAB,
                                   barrier=lambda: band.advance_grammar_fsm(rt, result, batch), allow_timeout=False)
            c1 = time.thread_time()
            launch()
            c2 = time.thread_time()
            step.finish_build(job, device="cpu", draft_device=draft)
            c3, t3 = time.thread_time(), time.perf_counter()
            yield {"s": s, "wall_s": t3 - t0, "sched_cpu_s": (c1 - c0) + (c3 - c2),
                   "handoff_s": step.telemetry.stats.handoff_s - h0,
                   "kept": sum(map(len, result.grammar_retained_tokens)), "offered": int(lens.sum())}
            for i, r in enumerate(reqs):
                r.output_ids.extend(result.grammar_retained_tokens[i])
    finally:
        step.close()


EVICT_BYTES = 64 << 20  # what a stand-in forward writes: the caches as cold as after the engine's forward


def paired_steps(bs: int, steps: int, warmup: int, install: Callable[[bool], None]) -> Dict[str, List[float]]:
    """:func:`band_loop` (grammar thread on) with two versions of the step alternated A B B A in this process:
    ``install(True)`` before the steps of the second (B), ``install(False)`` before the others and at the end; 64 MB
    written before each step and between its halves (the stand-in launch). A B B A puts each version on as many odd as
    even steps (consecutive steps differ: the plan's runs and the grammar thread's cadence; plain alternation measured
    a ~3 % bias for whichever version took the odd steps). Returns the scheduler thread's CPU seconds per step after
    the warm-up, ``"a"`` and ``"b"``; raises if a step kept fewer tokens than its result offered."""
    import torch

    trash = torch.zeros(EVICT_BYTES // 4)

    def evict() -> None:
        trash.add_(1.0)

    def is_b(s: int) -> bool:
        return s % 4 in (1, 2)

    per: Dict[str, List[float]] = {"a": [], "b": []}
    try:
        for r in band_loop(bs, steps, True, evict, lambda s: (install(is_b(s)), evict())):
            if r["kept"] != r["offered"]:
                raise RuntimeError(f"bs {bs}, step {r['s']}: {r['offered'] - r['kept']} offered tokens not kept")
            if r["s"] > warmup:
                per["b" if is_b(r["s"]) else "a"].append(r["sched_cpu_s"])
    finally:
        install(False)
    return per


def run_path(path: str, bs: int, launch_s: float, steps: int, warmup: int) -> Dict[str, float]:
    """One path at one batch size in this process: medians of the step wall (start_build .. finish_build end) and of
    the hand-off latency."""
    rows = [r for r in band_loop(bs, steps, path != "inline", lambda: _busy(launch_s)) if r["s"] > warmup]
    return {"wall_ms": statistics.median(r["wall_s"] for r in rows) * 1e3,
            "handoff_ms": statistics.median(r["handoff_s"] for r in rows) * 1e3}


def markdown(res: Dict[str, Any]) -> str:
    m = res["machine"]
    lines = [
        "# The grammar thread's hand-off against a GIL-holding launch", "",
        f"Command: `{res['command']}`", "",
        f"xgrammar {m['xgrammar']}, torch {m['torch']}, Python {m['python']}, {m['cpus']} CPUs (shared, noisy). "
        f"Real `XGrammarGrammar`s of SGLang {m['sglang']}, vocab {VOCAB}, `nested` JSON grammar, EAGLE topk 1 (4 "
        f"nodes), {res['steps']} steps after {res['warmup']} of warm-up, medians. `wall` = start_build .. end of "
        "finish_build around a launch stand-in that runs Python for `launch` ms; `over` = wall - launch (what the "
        "grammar work added to the scheduler thread's step); `handoff` = hand-off to the helper's first bytecode. "
        "A CPU model, not a GPU measurement.", "",
        "| launch ms | bs | path | wall ms | over ms | handoff ms |", "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['launch_ms']:.1f} | {r['bs']} | {r['path']} | {r['wall_ms']:.3f} | "
                     f"{r['wall_ms'] - r['launch_ms']:.3f} | {r['handoff_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--launch-ms", default="0.5,2")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "thread_handoff"))
    ap.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)  # one cell in this process (child)
    ap.add_argument("--bs", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--launch", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.path:  # a child: the handshake patch must not leak into the other paths
        if args.path == "thread+handshake":
            from sglang_eagle_overlap.core import step as step_mod

            _handshake(step_mod)
        print(json.dumps(run_path(args.path, args.bs, args.launch / 1e3, args.steps, args.warmup)))
        return 0
    import subprocess

    rows = []
    for launch in (float(x) for x in args.launch_ms.split(",")):
        for bs in (int(x) for x in args.batches.split(",")):
            for path in PATHS:
                out = subprocess.run([sys.executable, __file__, "--path", path, "--bs", str(bs), "--launch",
                                      str(launch), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                                     check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                rows.append({"launch_ms": launch, "bs": bs, "path": path, **json.loads(out)})
                print(rows[-1], flush=True)
    save(args.out, "benchmarks/bench_thread_handoff.py", argv, {"steps": args.steps, "warmup": args.warmup,
                                                               "rows": rows}, markdown)
    return 0


def save(out: str, script: str, argv: Any, fields: Dict[str, Any], markdown_of: Callable[[Dict[str, Any]], str]) -> None:
    """Write ``out``.json (the command, this machine and ``fields``) and ``out``.md (``markdown_of`` of it), and print
    the latter."""
    res = {"command": " ".join([script, *(argv if argv is not None else sys.argv[1:])]), "machine": _machine(),
           **fields}
    Path(out + ".json").write_text(json.dumps(res, indent=1) + "\n")
    Path(out + ".md").write_text(markdown_of(res))
    print(markdown_of(res))


if __name__ == "__main__":
    raise SystemExit(main())
