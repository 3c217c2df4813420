"""Compare the scheduler thread's plugin work per grammar decode step between two engines' profiles.

Input: the directory ``bench_scheduler_budget.py --profile DIR`` filled (the step probe's ``StepProfile``: one
``<pid>_bs<bs>.prof`` per engine process and batch size, with a ``.json`` naming the plugin file that engine
imported). Engines are grouped by that plugin file, so a ``--before REV`` engine and this checkout's come out as
two columns. For each batch size, per function of the product plugin (``sglang_eagle_overlap``): calls per step and
own time per step (cProfile's ``tottime``) on each side, and per builtin (C) call made from a plugin function
(``caller > builtin``) the same, sorted by the difference, then the totals::

    .venvs/sglang-0.5.23/bin/python benchmarks/profile_compare.py DIR [--bs 64] [--top 40]

Call counts are exact; times include cProfile's own per-call cost (a profile is not a timing run), which makes
frames that cost little but are called often look dearer than they are: a function's extra calls per step are the
robust figure, its time the ranking.
"""

from __future__ import annotations

import argparse
import json
import pstats
from pathlib import Path
from typing import Dict, List, Tuple

PLUGIN = "sglang_eagle_overlap"

Key = Tuple[str, str]  # (module path from the package down, function name)


def _key(file: str, name: str) -> Key | None:
    if PLUGIN not in file:
        return None
    return file.split(PLUGIN, 1)[1].lstrip("/"), name


def per_step(directory: Path, bs: int) -> Dict[str, Dict[Key, Tuple[float, float]]]:
    """Per plugin file (one engine revision), per plugin function: (calls per step, own ms per step), summed over its
    engines' profiles of batch size ``bs`` and divided by their steps."""
    acc: Dict[str, Dict[Key, List[float]]] = {}
    steps: Dict[str, int] = {}
    for meta_path in sorted(directory.glob(f"*_bs{bs}.json")):
        meta = json.loads(meta_path.read_text())
        side = meta["plugin"]
        steps[side] = steps.get(side, 0) + meta["steps"]
        stats = pstats.Stats(str(meta_path.with_suffix(".prof"))).stats  # type: ignore[attr-defined]
        funcs = acc.setdefault(side, {})
        for (file, _line, name), (_cc, calls, tottime, _ct, callers) in stats.items():
            key = _key(file, name)
            if key is not None:
                cell = funcs.setdefault(key, [0.0, 0.0])
                cell[0] += calls
                cell[1] += tottime * 1e3
            elif file == "~":  # a builtin (C function or method): its time goes to each plugin caller's row
                for (cfile, _cline, cname), edge in callers.items():
                    ckey = _key(cfile, cname)
                    if ckey is not None:
                        cell = funcs.setdefault((ckey[0], f"{ckey[1]} > {name}"), [0.0, 0.0])
                        cell[0] += edge[1]
                        cell[1] += edge[2] * 1e3
    return {side: {k: (c / steps[side], t / steps[side]) for k, (c, t) in funcs.items()} for side, funcs in acc.items()}


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    sides = per_step(args.directory, args.bs)
    if len(sides) != 2:
        print(f"expected two plugin revisions at bs {args.bs}, found {len(sides)}: {sorted(sides)}")
        return 1
    (name_a, a), (name_b, b) = sorted(sides.items())
    print(f"A = {name_a}\nB = {name_b}\nbs {args.bs}, per grammar decode step\n")
    keys = set(a) | set(b)
    zero = (0.0, 0.0)
    rows = sorted(keys, key=lambda k: abs(b.get(k, zero)[1] - a.get(k, zero)[1]), reverse=True)
    print(f"{'function':70s} {'calls A':>8s} {'calls B':>8s} {'ms A':>7s} {'ms B':>7s} {'ms B-A':>7s}")
    for k in rows[: args.top]:
        ca, ta = a.get(k, zero)
        cb, tb = b.get(k, zero)
        print(f"{k[0] + ':' + k[1]:70.70s} {ca:8.1f} {cb:8.1f} {ta:7.3f} {tb:7.3f} {tb - ta:+7.3f}")
    for label, side in (("A", a), ("B", b)):
        print(f"total {label}: {sum(c for c, _ in side.values()):.1f} calls, {sum(t for _, t in side.values()):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
