"""The scheduler thread's budget per decode step, measured in the real SGLang scheduler on CPU.

In steady state an overlapped step lasts max(GPU work, scheduler-thread CPU work). This benchmark measures the
scheduler-thread side on the real engine (CPU runtime), with the 128k-vocabulary tokenizer, the GPU table's schema
(``BENCH_SCHEMA`` of ``bench_gpu_constrained.py``, ``constrained_json_disable_any_whitespace``) and the random model
pair (accept ~1: every step pays the full tree mask), for EAGLE3 topk 1 (3 steps / 4 tokens) and topk 4 (3 steps /
8 tokens) at bs 1 / 8 / 32 / 64. Reported side by side, from one run:

* (a) SGLang's own scheduler-thread time per *unconstrained* decode step: step wall minus device work (on a CPU engine
  the GPU's work runs synchronously on the scheduler thread, so it is timed and taken out: ``ModelRunner.forward``,
  draft and target, and every other tensor op beyond its dispatch, ``step_times.TensorOpTimer``) and minus the
  probe's own cost. The engines run with jemalloc (``use_allocator``), so that freeing a large host tensor costs what
  a GPU's caching allocator costs, not an ``munmap``;
* (b) the extra scheduler-thread time of a *constrained* step with the plugin: the time the scheduler thread spends
  inside grammar calls (SGLang's grammar entry points and the plugin's, nested counted once: with the grammar thread
  this is the hand-off, the join wait and the upload) plus the GIL time the plugin's grammar thread can have taken
  from it (its CPU time outside its GIL-free native call, from the plugin's stats: an upper bound);
* (b') a cross-check that needs no attribution: constrained (step - device) minus unconstrained (step - device),
  i.e. everything extra a constrained step costs the scheduler thread, SGLang's own grammar bookkeeping included.

Paths compared in the same run: ``thread`` (the default: the barrier's ledger checks and the build's preparation on
the scheduler thread before the verify launch, the step's one native call -- feeds and tree walk -- on the grammar
thread, joined before sampling: ``SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=1``) and ``inline`` (all of it on the scheduler
thread after the verify launch: ``SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=0``). Each path gets its own engine; the paths
alternate per topk (repeated ``--repeats`` times, every other repeat in reverse order). Inside one engine every
batch size is warmed up, then unconstrained and json rounds alternate. The json outputs of the two paths are compared
token for token (greedy). ``--paths thread-noforced,thread`` compares the grammar thread with grammar-forced drafts
off and on; ``inline-forced`` is the inline path with them switched on; ``stock`` is SGLang without the plugin.
``--before REV`` adds the path ``before``: the plugin as git revision REV of this checkout had it, with that
revision's defaults (``--before-forced`` overrides its forced-drafts switch), in an engine started from a child
interpreter whose ``PYTHONPATH`` puts REV's package (``package_at``: ``git archive``) first -- so a change is
compared with the code it replaces in one run, same harness, same tokens checked; the criterion column then reads
``inline`` (the new default) against it::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_scheduler_budget.py \
        --before REV --paths inline,thread --batches 8,64 --max-new-tokens 16

(REV: the baseline, e.g. the all-inline code before the grammar thread for the criterion; the file is named
``..._inline_thread_vs_baseline`` and records REV in its ``before`` field.)

Run (one engine at a time: the lock keeps other engine runs off the 2 cores; the engines use jemalloc, Debian's
``libjemalloc2``, unless ``--allocator system``)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_scheduler_budget.py
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.16/bin/python benchmarks/bench_scheduler_budget.py

``--breakdown`` also times the plugin's functions on the scheduler thread one by one inside every engine (the dev
step probe's ``Breakdown``: each function timed whole, per call, by batch size) and adds "Where (b) goes" tables: per
path, at the largest batch size, every function's calls per grammar step, median and mean ms per call, and ms per step
(calls x mean). Its wrappers cost a few microseconds per call, so use a separate run for the criterion.

Writes ``benchmarks/results/scheduler_budget_<sglang>[_<paths>][_vs_baseline][_breakdown].{json,md}`` (the name says
what was compared, see :func:`result_stem`). Medians over the full-batch steps of all rounds.
CPU figures: what the scheduler thread does on this machine, not a GPU's step time (``benchmarks/step_model.py``
turns them into a GPU prediction with one calibrated constant). Not a test: no timing gates anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_engine_step import _machine, delta  # noqa: E402  one harness: shared helpers
from bench_gpu_constrained import BENCH_SCHEMA  # noqa: E402  the GPU table's schema

SPECS = ("topk1", "topk4")
BATCHES = (1, 8, 32, 64)
PATHS = ("inline", "thread")
# ``thread-noforced``: the grammar thread with grammar-forced drafts off, i.e. the verify step before them;
# ``inline-forced``: the inline path with forced drafts switched on; ``stock``: SGLang without the plugin
# (``SGLANG_EAGLE_OVERLAP=0``: 0.5.16 takes every grammar decode batch out of the overlap); ``before``: the plugin of
# the git revision ``--before`` names, with that revision's defaults (its engine in a child process that imports that
# revision's package), so that a change is measured against the code it replaces in the same run
ALL_PATHS = ("before", "inline", "inline-forced", "thread-noforced", "thread", "stock")
VOCAB = 128256
PLUGIN_KEYS = ("steps", "advance_s", "tree_wait_s", "mask_s", "sched_s", "join_wait_s", "helper_gil_s", "handoff_s",
               "mask_timeouts")


# -- pure helpers (tests/benchmarks/test_bench_scheduler_budget.py) --------------------------------------------------
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2


def use_allocator(name: str, path: str = JEMALLOC) -> None:
    """Give every engine process started from here on (they inherit the environment) the host allocator ``name``.

    ``jemalloc`` (the default) with page decay off: freed memory stays mapped and is reused, as a GPU's caching
    allocator reuses device memory. With glibc's allocator every tensor above 32 MB is a fresh ``mmap``, page-faulted
    on first write and ``munmap``ed on free: freeing one ``256 x 128k`` float logits tensor costs the scheduler thread
    ~10 ms here, outside any tensor op, so the CPU engine's (a) grew with batch x tree x vocabulary (to ~50 ms at
    topk 4 bs 64) with work a GPU host never does. ``system`` keeps glibc's (the earlier results)."""
    if name == "system":
        return
    if not os.path.exists(path):
        raise SystemExit(f"--allocator jemalloc needs {path} (Debian: apt-get install libjemalloc2); or pass "
                         "--allocator system")
    os.environ["LD_PRELOAD"] = path
    os.environ["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def path_switches(path: str, before_forced: Optional[str] = None) -> Tuple[Optional[bool], Optional[bool]]:
    """The product plugin's switches for an engine of ``path``: ``(forced_drafts, grammar_thread)``, None leaving a
    switch unset (the plugin's default). They go through ``EngineConfig``: the CPU runtime sets what is not None for the
    scheduler and clears the rest, so ``before`` runs with the revision's own defaults -- the grammar thread included
    (a revision whose default is the thread must not be measured inline) -- unless ``before_forced`` (``--before-forced``
    on / off) sets its forced drafts."""
    if path == "before":
        return {"on": True, "off": False}.get(before_forced or ""), None
    return {"thread-noforced": False, "inline-forced": True}.get(path), path.startswith("thread")


def cell_summary(steps: Sequence[Sequence[float]], bs: int) -> Dict[str, Any]:
    """Medians over the step records ``[step_ms, grammar_ms, run_batch_ms, bs, grammar, forward_ms, device_ms,
    tensor_ops, probe_ms, grammar_probe_ms]`` (``step_times``) that held all ``bs`` requests: step, forward, device
    work (forward + the device share of the other tensor ops; records without it count the forward alone), the
    scheduler thread's CPU (step - device - the probe's own cost), its grammar-call time without the probe's own cost
    inside the grammar regions (``grammar_ms``; ``grammar_raw_ms`` with it, as records without the tenth field give
    it) and, with the device split, ``run_batch``'s CPU (run_batch - device - probe: nearly all of the probe's calls
    are in it)."""
    full = [s for s in steps if int(s[3]) == bs and len(s) >= 6]
    if not full:
        return {"n": 0}
    split = all(len(s) >= 9 for s in full)
    off = [s[6] + s[8] if split else s[5] for s in full]  # what is not the scheduler thread's own CPU work
    out = {
        "n": len(full),
        "step_ms": statistics.median(s[0] for s in full),
        "forward_ms": statistics.median(s[5] for s in full),
        "cpu_ms": statistics.median(s[0] - o for s, o in zip(full, off)),
        "grammar_ms": statistics.median(s[1] - (s[9] if len(s) >= 10 else 0.0) for s in full),
        "grammar_raw_ms": statistics.median(s[1] for s in full),
    }
    if split:
        out["device_ms"] = statistics.median(s[6] for s in full)
        out["tensor_ops"] = statistics.median(s[7] for s in full)
        out["probe_ms"] = statistics.median(s[8] for s in full)
        # SGLang's run_batch without its device work: what the GPU host's run_batch costs its CPU (the step model's
        # calibration quantity)
        out["run_cpu_ms"] = statistics.median(s[2] - o for s, o in zip(full, off))
    return out


def plugin_per_step(d: Dict[str, float]) -> Optional[Dict[str, float]]:
    """Plugin stats delta -> means per verify step in ms (None when it ran no step)."""
    n = d.get("steps") or 0
    if not n:
        return None
    out = {k[:-2] + "_ms": d.get(k, 0.0) / n * 1e3 for k in PLUGIN_KEYS if k.endswith("_s")}
    out["timeouts_per_step"] = d.get("mask_timeouts", 0) / n
    return out


def budget(unc: Dict[str, Any], con: Dict[str, Any], plugin: Optional[Dict[str, float]]) -> Dict[str, Optional[float]]:
    """(a), (b) and (b') of one cell (module docstring), and (b) as a mean over every grammar verify step from the
    plugin's own stats (``sched`` + ``helper_gil``: its scheduler-thread grammar time plus the grammar thread's GIL
    bound). The median is the typical step; the mean is what the steps cost in total, and on ``BENCH_SCHEMA`` it is
    dominated by the few steps that meet xgrammar's slow states (docs/troubleshooting.md, "Known upstream limits").
    None where a side has no steps."""
    a = unc.get("cpu_ms") if unc.get("n") else None
    b_mean = None if not plugin else plugin.get("sched_ms", 0.0) + plugin.get("helper_gil_ms", 0.0)
    if not con.get("n"):
        return {"a_ms": a, "b_ms": None, "b_cross_ms": None, "b_mean_ms": b_mean}
    gil = (plugin or {}).get("helper_gil_ms", 0.0)
    b = con["grammar_ms"] + gil
    return {"a_ms": a, "b_ms": b, "b_cross_ms": None if a is None else con["cpu_ms"] - a, "b_mean_ms": b_mean}


def markdown(result: Dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Scheduler-thread budget per decode step, SGLang {m['sglang']} on CPU",
        "",
        f"Command: `{result['command']}`",
        "",
        f"SGLang {m['sglang']}, xgrammar {m['xgrammar']}, torch {m['torch']}, Python {m['python']}, {m['cpus']} CPUs "
        f"(shared, noisy). Random model pair, vocab {VOCAB} (byte-level BPE built locally), EAGLE3, overlap on, "
        f"`BENCH_SCHEMA` with `constrained_json_disable_any_whitespace`, greedy, max_new_tokens "
        f"{result['max_new_tokens']}, {result['rounds']} rounds per kind per batch size per engine after a warm-up, "
        f"{result['repeats']} engine(s) per path, host allocator {result.get('allocator', 'system')}. Medians over "
        f"full-batch steps, except `(b) mean`.",
        "",
        "(a) = SGLang's own scheduler-thread ms per unconstrained step (step - device work - the probe's own cost: the "
        "model forward plus the device share of every other tensor op, when the records carry it; else step - "
        "forward). "
        "`device` = that device work per step. (b) = extra scheduler-thread "
        "ms per constrained step: grammar calls on the scheduler thread (without the step probe's own cost inside "
        "them: the torch calls of a grammar region pass through its mode too; `grammar calls ms` gives that cost in "
        "parentheses) + the grammar thread's GIL bound. `(b) mean` = "
        "the same from the plugin's stats, averaged over every grammar verify step (the slow xgrammar states of "
        "`BENCH_SCHEMA` are in the mean, not in the median). (b') = "
        "constrained (step - device) - (a): everything extra, no attribution (noisier). `join` = wait for the grammar "
        "thread; `gil` = its CPU time outside native fills; `work` = advance + tree wait + mask wherever it ran. "
        "`b new/old` is the issue's criterion (<= 1/3 at bs 64): the default path (`thread`, else `inline`) against "
        "`before` (the revision `--before` names) when it ran, else thread against inline.",
        "",
        "| EAGLE3 | bs | path | steps | step ms (unc / json) | device ms (unc / json) | (a) ms | (b) ms | (b) mean ms "
        "| (b') ms | grammar calls ms | join ms | gil ms | work ms | accept | b new/old |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Optional[float], fmt: str = "{:.2f}") -> str:
        return "–" if x is None else fmt.format(x)

    def probe_in(cell: Dict[str, Any]) -> str:
        raw, net = cell.get("grammar_raw_ms"), cell.get("grammar_ms")
        return "" if raw is None or net is None else f" ({raw - net:.2f})"

    for row in result["rows"]:
        for path in ALL_PATHS:
            c = row.get(path)
            if not c:
                continue
            u, j, b, p = c["unconstrained"], c["json"], c["budget"], c["plugin"] or {}
            work = None if not p else p["advance_ms"] + p["tree_wait_ms"] + p["mask_ms"]
            ratio = row.get("b_ratio") if path == row.get("b_ratio_path") else None
            lines.append(
                f"| {row['spec']} | {row['bs']} | {path} | {u.get('n', 0)}/{j.get('n', 0)} | "
                f"{f(u.get('step_ms'), '{:.1f}')} / {f(j.get('step_ms'), '{:.1f}')} | "
                f"{f(u.get('device_ms', u.get('forward_ms')), '{:.1f}')} / "
                f"{f(j.get('device_ms', j.get('forward_ms')), '{:.1f}')} | {f(b['a_ms'])} | "
                f"{f(b['b_ms'])} | {f(b.get('b_mean_ms'))} | {f(b['b_cross_ms'])} | {f(j.get('grammar_ms'))}"
                f"{probe_in(j)} | {f(p.get('join_wait_ms'))} | "
                f"{f(p.get('helper_gil_ms'))} | {f(work)} | {c['accept_length']:.2f} | "
                f"{f(ratio, '{:.2f}×') if ratio is not None else ''} |"
            )
    lines += ["", f"Greedy json outputs identical across paths: {result['identical']}.", ""]
    lines += breakdown_markdown(result.get("breakdown"))
    if result.get("problems"):
        lines += ["Problems seen:", ""] + [f"- {p}" for p in result["problems"]] + [""]
    return "\n".join(lines)


def breakdowns(runs: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    """``--breakdown``: per ``spec/path``, the step probe's ``breakdown_summary`` over all its engines' records (per
    batch size, per function: calls per grammar step, median and mean ms per call)."""
    from sglang_eo_dev.cpu_runtime.step_times import breakdown_summary

    records: Dict[str, List[Dict[str, Any]]] = {}
    for r in runs:
        records.setdefault(f"{r['spec']}/{r['path']}", []).extend(r.get("breakdown") or [])
    return {key: breakdown_summary(recs) for key, recs in records.items() if recs}


def breakdown_markdown(summary: Optional[Dict[str, Dict[str, Dict[str, List[float]]]]]) -> List[str]:
    """The ``--breakdown`` tables: per ``spec/path``, at its largest batch size, every timed function by its time per
    grammar step (calls x mean; a caller's time includes its callees')."""
    if not summary:
        return []
    lines = ["## Where (b) goes (`--breakdown`)", "",
             "Each plugin function on the scheduler thread timed whole, per call (a caller includes its callees; "
             "`StepTelemetry.write_stats` is the benchmark's stats file, outside (b)); the wrappers add a few "
             "microseconds per call, so this run's (b) above is not the criterion's. Per grammar step (an iteration "
             "that called `GrammarStep`); `ms per step` = calls per step x mean ms per call.", ""]
    for key, by_bs in summary.items():
        bs = max(by_bs, key=int)
        lines += [f"### {key}, bs {bs}", "",
                  "| function | calls per step | median ms per call | mean ms per call | ms per step |",
                  "|---|---|---|---|---|"]
        for name, (calls, med, mean) in sorted(by_bs[bs].items(), key=lambda kv: -kv[1][0] * kv[1][2]):
            lines.append(f"| `{name}` | {calls:.2f} | {med:.3f} | {mean:.3f} | {calls * mean:.3f} |")
        lines.append("")
    return lines


# -- engine runs ---------------------------------------------------------------------------------------------------
def _prompts(bs: int, rnd: int) -> List[str]:
    return [f"Request {rnd}-{i}: write the service record as JSON." for i in range(bs)]


def _params(kind: str, max_new_tokens: int) -> Dict[str, Any]:
    p: Dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    if kind == "unconstrained":
        p["ignore_eos"] = True
    else:
        p["json_schema"] = json.dumps(BENCH_SCHEMA)
    return p


def one_engine(spec: str, path: str, rep: int, args: argparse.Namespace, tmp: str,
               problems: List[str]) -> Dict[str, Any]:
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, start_engine
    from sglang_eo_dev.cpu_runtime.stats import read_stats
    from sglang_eo_dev.cpu_runtime.step_times import STEP_TIMES_ENV, read_step_times

    tag = f"{spec}-{path}-{rep}"
    step_file = os.path.join(tmp, f"steps-{tag}.json")
    plugin_file = os.path.join(tmp, f"plugin-{tag}.json")
    os.environ[STEP_TIMES_ENV] = step_file
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = plugin_file
    forced, threaded = path_switches(path, args.before_forced)
    stock = path == "stock"
    cfg = EngineConfig(pair="random", spec=spec, overlap=True, product_plugin=not stock, vocab_size=VOCAB,
                       forced_drafts=forced, grammar_thread=threaded,
                       max_running_requests=max(args.batches),
                       extra=(("constrained_json_disable_any_whitespace", True), ("disable_radix_cache", True)))
    t0 = time.monotonic()
    engine = start_engine(cfg, stats_file=os.path.join(tmp, f"runtime-{tag}.json"))
    out: Dict[str, Any] = {"spec": spec, "path": path, "rep": rep, "start_s": time.monotonic() - t0, "cells": {}}
    breakdown: List[Dict[str, Any]] = []
    try:
        for bs in args.batches:
            for kind in ("unconstrained", "json"):  # warm-up of this batch size (grammar compile, buffers)
                engine.generate(prompt=_prompts(bs, 999), sampling_params=_params(kind, args.max_new_tokens))
            cell: Dict[str, Any] = {"unconstrained": [], "json": [], "plugin": {}, "outputs": [], "tokens": 0,
                                    "verify": 0}
            p_tot: Dict[str, float] = {}
            for rnd in range(args.rounds):
                for kind in ("unconstrained", "json"):
                    before = read_step_times(step_file)
                    n0, k0 = len(before["steps"]), len(before["breakdown"])
                    p0 = read_stats(plugin_file)
                    outs = engine.generate(prompt=_prompts(bs, rnd), sampling_params=_params(kind, args.max_new_tokens))
                    after = read_step_times(step_file)
                    cell[kind] += after["steps"][n0:]
                    if kind == "json":
                        breakdown += after["breakdown"][k0:]  # --breakdown: measured json rounds only, no warm-up
                        d = delta(read_stats(plugin_file), p0, PLUGIN_KEYS)
                        p_tot = {k: p_tot.get(k, 0.0) + d[k] for k in PLUGIN_KEYS}
                        cell["outputs"] += [o["output_ids"] for o in outs]
                        cell["tokens"] += sum(o["meta_info"]["completion_tokens"] for o in outs)
                        cell["verify"] += sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outs)
            cell["plugin"] = p_tot
            out["cells"][str(bs)] = cell
        probe = read_step_times(step_file)
        # the probe's per-op dispatch cost (the CPU share of a tensor op) and its own per-call cost
        out["dispatch_us"], out["probe_overhead_us"] = probe.get("dispatch_us"), probe.get("probe_overhead_us")
        errors = probe.get("errors") or []
        # a ``before`` revision may lack functions of this checkout's breakdown list, and the plugin functions of
        # its region list that only this checkout has (the region list names both revisions' entry points): not a
        # problem of the run
        problems += [f"{tag}: {e}" for e in errors
                     if not (path == "before" and (e.startswith("breakdown")
                                                   or e.startswith("grammar region not timed: sglang_eagle_overlap.")))]
        out["breakdown"] = breakdown  # Breakdown flushes of the json rounds (--breakdown), summarised in main
        st = read_stats(plugin_file)
        if stock:
            if st.get("active"):
                problems.append(f"{tag}: the plugin ran in the stock engine")
        elif not st.get("active") or bool(st.get("grammar_thread")) != threaded:
            problems.append(f"{tag}: plugin active={st.get('active')!r} grammar_thread={st.get('grammar_thread')!r}")
    finally:
        engine.shutdown()
    return out


def engine_in_child(spec: str, rep: int, args: argparse.Namespace, tmp: str, package_dir: str,
                    problems: List[str]) -> Dict[str, Any]:
    """:func:`one_engine` of the ``before`` path in a fresh interpreter whose ``sglang_eagle_overlap`` is the one in
    ``package_dir`` (first on ``PYTHONPATH``; the venv's editable install comes after it), with that revision's
    defaults. The rest -- this benchmark, the dev runtime, SGLang -- is this checkout's and this venv's."""
    import subprocess

    out_file = os.path.join(tmp, f"child-{spec}-{rep}.json")
    job = {"spec": spec, "rep": rep, "tmp": tmp, "out": out_file, "batches": args.batches, "rounds": args.rounds,
           "max_new_tokens": args.max_new_tokens, "before_forced": args.before_forced}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_dir] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env, check=True)
    got = json.loads(Path(out_file).read_text())
    problems += got["problems"]
    return got["run"]


def child(job_json: str) -> int:
    """The child side of :func:`engine_in_child`: one ``before`` engine, its record written to the job's file."""
    import sglang_eagle_overlap

    job = json.loads(job_json)
    print(f"[budget] child: sglang_eagle_overlap from {Path(sglang_eagle_overlap.__file__).parent}", flush=True)
    args = argparse.Namespace(batches=job["batches"], rounds=job["rounds"], max_new_tokens=job["max_new_tokens"],
                              before_forced=job.get("before_forced"))
    problems: List[str] = []
    run = one_engine(job["spec"], "before", job["rep"], args, job["tmp"], problems)
    run["package"] = str(Path(sglang_eagle_overlap.__file__).parent)
    Path(job["out"]).write_text(json.dumps({"run": run, "problems": problems}))
    return 0


def aggregate(runs: Sequence[Dict[str, Any]], batches: Sequence[int]) -> List[Dict[str, Any]]:
    rows = []
    for spec in dict.fromkeys(r["spec"] for r in runs):
        for bs in batches:
            row: Dict[str, Any] = {"spec": spec, "bs": bs}
            for path in dict.fromkeys(r["path"] for r in runs):
                cells = [r["cells"][str(bs)] for r in runs if r["spec"] == spec and r["path"] == path
                         and str(bs) in r["cells"]]
                if not cells:
                    continue
                unc = cell_summary([s for c in cells for s in c["unconstrained"]], bs)
                con = cell_summary([s for c in cells for s in c["json"]], bs)
                tot = {k: sum(c["plugin"].get(k, 0.0) for c in cells) for k in PLUGIN_KEYS}
                plug = plugin_per_step(tot)
                verify = sum(c["verify"] for c in cells)
                row[path] = {"unconstrained": unc, "json": con, "plugin": plug, "budget": budget(unc, con, plug),
                             "accept_length": sum(c["tokens"] for c in cells) / verify if verify else 0.0}
            # the criterion: the default path (the grammar thread; ``inline`` in results without one) against
            # today's (``before``), else thread against inline
            if "before" in row:
                base, new = "before", ("thread" if "thread" in row else "inline")
            else:
                base, new = "inline", "thread"
            bi = (row.get(base) or {}).get("budget", {}).get("b_ms")
            bt = (row.get(new) or {}).get("budget", {}).get("b_ms")
            row["b_ratio"] = bt / bi if bi and bt is not None else None
            row["b_ratio_path"] = new
            rows.append(row)
    return rows


def identical_outputs(runs: Sequence[Dict[str, Any]]) -> bool:
    """Greedy json outputs per (spec, bs, round order) equal across every run of that spec."""
    by_spec: Dict[str, List[Any]] = {}
    for r in runs:
        outs = [r["cells"][k]["outputs"] for k in sorted(r["cells"], key=int)]
        by_spec.setdefault(r["spec"], []).append(outs)
    return all(all(o == runs_[0] for o in runs_) for runs_ in by_spec.values())


def render(path: Path) -> int:
    """Re-aggregate a saved result from its per-engine records (``runs``) with this version's summaries and rewrite
    its ``.json`` and ``.md``; the command, machine and output comparison stay those of the run."""
    result = json.loads(path.read_text())
    batches = list(dict.fromkeys(int(r["bs"]) for r in result["rows"]))
    result["rows"] = aggregate(result["runs"], batches)
    path.write_text(json.dumps(result, indent=1))
    path.with_name(path.name[: -len(".json")] + ".md").write_text(markdown(result))
    print(markdown(result))
    return 0


def result_stem(sglang: str, paths: Sequence[str], breakdown: bool) -> str:
    """The results file name (no suffix) of a run: ``scheduler_budget_<sglang>``, then the paths compared when they are
    not the default set, ``_vs_baseline`` when a ``before`` engine ran, ``_breakdown`` with ``--breakdown``. The name
    says what was measured; which revision ``before`` was is recorded inside the file (its ``before`` field), so a
    re-run against the same baseline replaces the earlier result instead of adding a file per revision."""
    stem = f"scheduler_budget_{sglang}"  # not Path.with_suffix: "0.5.16" has a dot
    if tuple(paths) != PATHS:
        compared = [p for p in paths if p != "before"]
        stem += "".join(f"_{p}" for p in compared) + ("_vs_baseline" if "before" in paths else "")
    if breakdown:
        stem += "_breakdown"
    return stem


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--paths", default=",".join(PATHS),
                    help=f"engines to alternate, from {', '.join(ALL_PATHS)} (results file named after them when not "
                         "the default)")
    ap.add_argument("--render", type=Path, default=None,
                    help="rebuild the rows and the markdown of a saved result (its .json, rewritten in place with the "
                         ".md next to it) instead of running engines")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also run the plugin of git revision REV (path `before`, first in each alternation) with its "
                         "own defaults; the criterion column then compares `inline` against it")
    ap.add_argument("--before-forced", choices=("on", "off"), default=None,
                    help="grammar-forced drafts in the `before` engine (default: the revision's own default); e.g. "
                         "`off` for the code the GPU table's inline column measured (that revision had forced drafts "
                         "off)")
    ap.add_argument("--allocator", choices=("jemalloc", "system"), default="jemalloc",
                    help="host allocator of the engines (default jemalloc: see use_allocator)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the plugin's scheduler-thread functions one by one in every engine (the step "
                         "probe's Breakdown) and report where (b) goes, per path, at the largest batch size; the "
                         "wrappers add a few microseconds per call, so the (b) of such a run is not the criterion's "
                         "(results file suffixed _breakdown)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also cProfile every engine's scheduler thread over its grammar decode steps (the step "
                         "probe's StepProfile: <pid>_bs<bs>.prof/.json in DIR, kept after the run); "
                         "benchmarks/profile_compare.py compares two engines' profiles. Not a timing run")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args.child)
    if args.render is None:
        use_allocator(args.allocator)
    if args.render is not None:
        return render(args.render)
    paths = [p for p in args.paths.split(",") if p]
    if args.before and "before" not in paths:
        paths.insert(0, "before")
    if "before" in paths and not args.before:
        ap.error("--paths before needs --before REV")
    if any(p not in ALL_PATHS for p in paths):
        ap.error(f"--paths: expected names from {ALL_PATHS}, got {paths}")
    args.batches = [int(b) for b in args.batches.split(",")]
    specs = [s for s in args.specs.split(",") if s]
    problems: List[str] = []
    runs = []
    if args.breakdown:
        from sglang_eo_dev.cpu_runtime.step_times import BREAKDOWN_ENV

        os.environ[BREAKDOWN_ENV] = "1"  # every engine process, the `before` child's included
    if args.profile:
        from sglang_eo_dev.cpu_runtime.step_times import PROFILE_ENV

        os.environ[PROFILE_ENV] = os.path.abspath(args.profile)
    with tempfile.TemporaryDirectory() as tmp:
        package_dir = ""
        if args.before:
            from sglang_eo_dev.helpers.scripts import package_at

            package_dir = str(package_at(args.before, Path(tmp) / "before"))
        for spec in specs:
            for rep in range(args.repeats):
                # ABBA: every other repeat runs the paths in reverse, so that an engine's place in the sequence (the
                # second engine of a pair ran slower here, SGLang's own time (a) included) weighs on every path alike
                for path in (paths if rep % 2 == 0 else paths[::-1]):
                    print(f"[budget] {spec} {path} #{rep} ...", flush=True)
                    if path == "before":
                        runs.append(engine_in_child(spec, rep, args, tmp, package_dir, problems))
                    else:
                        runs.append(one_engine(spec, path, rep, args, tmp, problems))
    result = {
        "command": " ".join(["flock /tmp/sglang-engine.lock",
                             f".venvs/{Path(sys.executable).parent.parent.name}/bin/python",
                             "benchmarks/bench_scheduler_budget.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": _machine(), "allocator": args.allocator, "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "repeats": args.repeats, "before": args.before, "before_forced": args.before_forced,
        "rows": aggregate(runs, args.batches),
        "identical": identical_outputs(runs),
        "problems": problems,
        "breakdown": breakdowns(runs) if args.breakdown else None,
        "runs": [{k: v for k, v in r.items() if k not in ("cells", "breakdown")} | {"cells": {
            bs: {k: c[k] for k in ("unconstrained", "json", "plugin", "tokens", "verify")}
            for bs, c in r["cells"].items()}} for r in runs],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(result["machine"]["sglang"], paths, args.breakdown)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
