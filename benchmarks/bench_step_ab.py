"""This checkout's verify step against a git revision's, step by step in one process.

The engine's criterion (``bench_scheduler_budget.py --before REV``) compares two engines, minutes apart, on a shared
2-core machine: a cut of a few per cent is inside its noise, and two processes of the same code differ by ~10 % here
(allocation, hash layout). This benchmark pairs the two versions inside ONE process, on the same objects: the 0.5.23
band's step outside the engine (:func:`bench_thread_handoff.band_loop`: real ``XGrammarGrammar`` objects, 128k
vocabulary, the ``nested`` JSON grammar, EAGLE topk 1, grammar thread on, 64 MB written before each step and between
its halves as the engine's forward would), and before each step it installs one version's code, A B B A.

How a version is installed: the revision's sources of :data:`MODULES` are compiled from ``git show REV:path`` and
every function -- module functions and the methods of their classes, dunder methods excepted -- is rebound to the
*installed* module's globals, so both versions run on the same classes and objects. That holds while the revision's
code reads and writes the same object layout (a method that sets an attribute the other version's class lacks fails
loudly); the step's tokens are checked: every run must be kept whole (``kept == offered``) in both versions.

Run (the lock keeps it away from engine runs)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_step_ab.py --before REV

Writes ``benchmarks/results/step_ab.{json,md}``: per batch size and repeat, the median scheduler-thread CPU time per
step of each version and their ratio, and the median ratio over the repeats. Not a test.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import types
from typing import Any, Dict, List, Tuple

# run as a script, benchmarks/ is on the path; bench_thread_handoff puts the checkout and dev/ there
from bench_thread_handoff import ROOT, paired_steps, save
MODULES = ("sglang_eagle_overlap.core.ledger", "sglang_eagle_overlap.core.mask", "sglang_eagle_overlap.core.native",
           "sglang_eagle_overlap.core.step", "sglang_eagle_overlap.core.tree_copy",
           "sglang_eagle_overlap.integration.requests", "sglang_eagle_overlap.adapters.v0_5_23.band")

Slot = Tuple[Any, str]  # (module or class, attribute name)


def _functions(namespace: Dict[str, Any], module_name: str) -> Dict[Tuple[str, ...], Any]:
    """Every function a module's namespace defines, by path: ``(name,)`` for module functions, ``(cls, name)`` for
    the methods of its classes (dunder methods excepted: dataclasses generate theirs from each version's fields)."""
    out: Dict[Tuple[str, ...], Any] = {}
    for name, value in namespace.items():
        if isinstance(value, types.FunctionType) and value.__module__ == module_name:
            out[(name,)] = value
        elif isinstance(value, type) and value.__module__ == module_name:
            for attr, fn in vars(value).items():
                raw = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
                if isinstance(raw, types.FunctionType) and raw.__module__ == module_name and not attr.startswith("__"):
                    out[(name, attr)] = fn
    return out


def _rebound(fn: Any, module: Any) -> Any:
    """``fn``'s code with ``module``'s globals (a static or class method stays one)."""
    wrap = type(fn) if isinstance(fn, (staticmethod, classmethod)) else None
    raw = fn.__func__ if wrap is not None else fn
    new = types.FunctionType(raw.__code__, vars(module), raw.__name__, raw.__defaults__, raw.__closure__)
    new.__kwdefaults__ = raw.__kwdefaults__
    new.__qualname__ = raw.__qualname__
    return wrap(new) if wrap is not None else new


def versions(rev: str) -> Tuple[List[Tuple[Slot, Any]], List[Tuple[Slot, Any]]]:
    """The installed version's functions and ``rev``'s, as ``((owner, name), function)`` lists over the same slots
    (a function only one version has is installed by that version only). A module's imports of another module's
    functions (``from ...requests import mask_requests``) are slots too, so each version calls its own. Refuses a
    revision whose native source differs from this checkout's: one process loads one native module, whose output
    the revision's Python would misread."""
    native_src = "sglang_eagle_overlap/native/grammar_batch.cc"
    if subprocess.run(["git", "diff", "--quiet", rev, "--", native_src], cwd=ROOT).returncode != 0:
        raise SystemExit(f"bench_step_ab: {native_src} differs between {rev} and this checkout; the two versions "
                         "cannot share one native module (compare from a checkout with the same native source)")
    mods: Dict[str, Tuple[Any, Dict[str, Any]]] = {}
    defs: Dict[Tuple[str, Tuple[str, ...]], Tuple[Any, Any]] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        path = name.replace(".", "/") + ".py"
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout
        old = types.ModuleType(name + "__rev")  # a registered module: dataclasses look their module up
        old.__file__ = str(ROOT / path)
        sys.modules[old.__name__] = old
        exec(compile(source, f"{rev}:{path}", "exec"), vars(old))  # noqa: S102 - the revision's own source
        mods[name] = (module, vars(old))
        mine, theirs = _functions(vars(module), name), _functions(vars(old), old.__name__)
        for key in set(mine) | set(theirs):
            defs[(name, key)] = (mine.get(key), _rebound(theirs[key], module) if key in theirs else None)
    this: List[Tuple[Slot, Any]] = []
    that: List[Tuple[Slot, Any]] = []

    def add(owner: Any, attr: str, pair: Tuple[Any, Any]) -> None:
        if pair[0] is not None:
            this.append(((owner, attr), pair[0]))
        if pair[1] is not None:
            that.append(((owner, attr), pair[1]))

    for (name, key), pair in sorted(defs.items()):
        module = mods[name][0]
        owner = module if len(key) == 1 else getattr(module, key[0], None)
        if owner is not None:  # else a class only the revision has: nothing of this checkout calls it
            add(owner, key[-1], pair)
    for name, (module, old_ns) in mods.items():  # imported functions of the other modules
        for attr in set(vars(module)) | set(old_ns):
            for value in (vars(module).get(attr), old_ns.get(attr)):
                if isinstance(value, types.FunctionType):
                    home = value.__module__.removesuffix("__rev")
                    if home != name and (home, (value.__name__,)) in defs:
                        add(module, attr, defs[(home, (value.__name__,))])
                        break
    return this, that


def install(version: List[Tuple[Slot, Any]]) -> None:
    for (owner, name), fn in version:
        setattr(owner, name, fn)


def run(bs: int, steps: int, warmup: int, this: List[Tuple[Slot, Any]], that: List[Tuple[Slot, Any]]
        ) -> Dict[str, Any]:
    """One batch size in this process: the median scheduler-thread CPU time per step of each version, the revision's
    on the B steps of :func:`bench_thread_handoff.paired_steps` (which also checks every run is kept whole)."""
    per = paired_steps(bs, steps, warmup, lambda second: install(that if second else this))
    a, b = statistics.median(per["b"]), statistics.median(per["a"])
    return {"bs": bs, "steps": len(per["a"]) + len(per["b"]), "rev_ms": a * 1e3, "this_ms": b * 1e3, "ratio": b / a}


def markdown(res: Dict[str, Any]) -> str:
    lines = ["# This checkout's verify step against a revision's, in one process", "",
             f"Command: `{res['command']}`", "",
             "SGLang {sglang}, xgrammar {xgrammar}, torch {torch}, Python {python}, {cpus} CPUs (shared, noisy)."
             .format(**res["machine"]) + f" Revision: `{res['before']}`; this checkout: "
             f"`{res['this']}`. The 0.5.23 band's step outside the engine (`bench_step_ab.py`'s docstring), caches "
             "evicted, versions alternated A B B A step by step; scheduler-thread CPU ms per step, medians over the "
             "steps after the warm-up; every run kept whole in both versions.", "",
             "| bs | repeat | revision ms | this ms | this / revision |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['bs']} | {r['repeat']} | {r['rev_ms']:.3f} | {r['this_ms']:.3f} | {r['ratio']:.2f}x |")
    lines += ["", "| bs | median of this / revision over the repeats |", "|---|---|"]
    for bs, ratio in res["median_ratio"].items():
        lines.append(f"| {bs} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the git revision to compare against")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--steps", type=int, default=70, help="steps per repeat (the plan's documents hold ~80)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_ab"))
    args = ap.parse_args(argv)
    this, that = versions(args.before)
    rows = []
    for bs in (int(x) for x in args.batches.split(",")):
        for k in range(args.repeats):
            rows.append({"repeat": k + 1, **run(bs, args.steps, args.warmup, this, that)})
            print(rows[-1], flush=True)
    median_ratio = {str(bs): statistics.median(r["ratio"] for r in rows if r["bs"] == bs)
                    for bs in dict.fromkeys(r["bs"] for r in rows)}
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    save(args.out, "benchmarks/bench_step_ab.py", argv,
         {"before": args.before, "this": head, "rows": rows, "median_ratio": median_ratio}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
