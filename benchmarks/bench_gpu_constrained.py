"""Constrained EAGLE3 decode-step time on a GPU: json_schema with the plugin vs unconstrained vs plugin off.

What it measures, in ONE run, per EAGLE3 shape (default topk 1: 3 steps / 4 draft tokens, and topk 4: 3 steps /
8 draft tokens; others by ``--shape name=steps,topk,tokens``) and per batch size (default 1/8/32/64):

* ``json``: ``json_schema`` requests (the workload's schema) with the plugin on;
* ``unconstrained``: the same prompts without a schema (``ignore_eos``), same engine;
* ``json-off``: the same json_schema requests on an engine started with ``SGLANG_EAGLE_OVERLAP=0`` (stock SGLang).

**Time is ms per decode step as the scheduler measured it**: the step probe of the dev package
(``sglang_eo_dev.cpu_runtime.step_times``, the one ``bench_engine_step.py`` and the demo read) records, inside the
scheduler process, the interval between two speculative decode-batch launches (one scheduler-loop iteration; the step
period in the overlapped steady state) with the batch size and whether the batch held a grammar request. On a GPU host
the probe is loaded by its own SGLang plugin entry point, declared in a temporary distribution this script writes and
puts on the engine processes' path (nothing is installed). A cell is the median over the decode steps that held all
``bs`` requests, pooled over its rounds; ``best`` is the best round's median. ms/token = ms/step / accept length.

Order: per shape the plugin-on engine (json + unconstrained), then the plugin-off engine (json-off) (``--repeats``
pairs); inside an engine, per batch size: one warm-up round of every variant at that batch size (grammar compile,
first batches of that size; not recorded), then ``--rounds`` rounds alternating the variants. The radix cache is off.
Also reported: the plugin's own per-step phases from its stats file (``SGLANG_EAGLE_OVERLAP_STATS_FILE``: advance,
tree wait, mask, un-hidden, mask time-limit hits per request; one small file write per plugin step,
``--no-plugin-stats`` turns it off) and the probe's grammar ms per step.

**Workload** (``--workload``, default ``dummy-8b-json``: the setup of the measured H200 table in
``../shared/notes/gpu-runtime.md`` and docs/benchmarks.md): Llama-3.1-8B-shaped target + EAGLE3 draft from
``benchmarks/configs/`` with ``load_format="dummy"`` (random weights: accept length ~1, so every step pays the full
verify and the full tree mask), a locally built 128k byte-level BPE tokenizer (~7 s, cached), bf16, CUDA graphs
(decode graphs up to the largest batch size), overlap scheduler, xgrammar with
``constrained_json_disable_any_whitespace=True`` (as the table and the CUDA tests), 160-token outputs, and
``BENCH_SCHEMA``: 5 fields, a nested object, arrays with lengths, patterns. What may differ from the table: the table's
schema text was not recorded (the notes say "a 5-field nested schema with arrays, lengths and a pattern", which
``BENCH_SCHEMA`` is; its ``log`` array needs >= 64 items so no request can end before 160 tokens); the table gives
the best of 2 runs and does not record how it timed a step, this script's cell is the median of scheduler-timed steps
(``best`` is shown too); the step probe adds two clock reads per grammar region and one small file write per step to
the scheduler thread.
Another workload (a real model pair, another schema) is one more entry in ``WORKLOADS``; ``scripts/gpu/run.sh
bench-workload OUT NAME`` runs it.

Devices:

* ``cuda`` (default when a GPU is visible): SGLang on the GPU with the workload above, or a real pair with
  ``--model-path`` / ``--draft-model-path``; engine arguments from ``benchmarks/gpu_engine_args.py`` (checked against
  the installed ``ServerArgs`` by ``tests/test_gpu_engine_args.py``). ``--attention-backend triton --sampling-backend
  pytorch`` avoid flashinfer (what ``scripts/gpu/run.sh`` passes on the offline host).
* ``cpu``: the real SGLang engine on CPU through the dev-only CPU runtime (``sglang_eo_dev.cpu_runtime``) with the tiny
  random pair: the same code path end to end, small and quick (CI runs it); CPU numbers are CPU mechanics, not GPU
  overlap.

Run::

    python benchmarks/bench_gpu_constrained.py --shapes topk1 --out OUT    # a GPU: one shape, ~5-7 min
    scripts/gpu/run.sh bench-topk1 OUT                                     # the same on the offline CUDA host
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_gpu_constrained.py --device cpu
    python benchmarks/bench_gpu_constrained.py --merge OUT1/gpu_constrained_*.json OUT2/gpu_constrained_*.json

Writes ``gpu_constrained_<device>_<sglang>[_<workload>][_<shapes>].{json,md,png}`` under ``--out`` (default
``benchmarks/results``), the json and md again after every engine (a run cut short keeps what it measured).
``--merge`` joins the rows of several such json files (each with its own in-run ratios) into one table. Not a test:
no timing gates anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_engine_step import _machine as _host_machine  # noqa: E402  one harness: shared helpers
from bench_engine_step import delta, full_batch_steps, summarize_steps  # noqa: E402
from gpu_engine_args import gpu_engine_kwargs as build_gpu_engine_kwargs  # noqa: E402  one place for engine args

CONFIGS = ROOT / "benchmarks" / "configs"
STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
SWITCH_ENV = "SGLANG_EAGLE_OVERLAP"
STEP_TIMES_ENV = "SGLANG_EO_STEP_TIMES_FILE"  # the dev step probe's file (sglang_eo_dev.cpu_runtime.step_times)

VARIANTS = ("json", "unconstrained", "json-off", "json-inline")  # table order
DEFAULT_VARIANTS = ("json", "unconstrained", "json-off")
# engine kind -> its variants; "inline" is the plugin with its grammar thread off (SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=0:
# the grammar work inline on the scheduler thread, the path before the grammar thread became the default), so both
# paths can be compared in one run (--variants ...,json-inline)
ENGINE_VARIANTS = {"on": ("json", "unconstrained"), "off": ("json-off",), "inline": ("json-inline",)}
ENGINE_ENV = {"on": {}, "off": {}, "inline": {"SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD": "0"}}
JSON_VARIANTS = ("json", "json-inline")  # plugin on: its stats file is read around these rounds
# the plugin's stats file: per-step phases, mask time-limit hits, and the scheduler thread's share (sched: what the
# grammar calls cost it; join_wait: the part spent waiting for the grammar thread; helper_gil: the grammar thread's
# CPU time outside its GIL-free call; handoff: the grammar thread's wake-up latency after the hand-off); older result
# files lack the last four (read as 0)
PHASE_KEYS = ("steps", "advance_s", "tree_wait_s", "mask_s", "unhidden_s", "mask_timeouts", "sched_s", "join_wait_s",
              "helper_gil_s", "handoff_s")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An EAGLE3 draft-tree shape (SGLang's ``speculative_*`` arguments)."""

    name: str
    steps: int
    topk: int
    draft_tokens: int

    def engine_kwargs(self) -> Dict[str, int]:
        return {"speculative_num_steps": self.steps, "speculative_eagle_topk": self.topk,
                "speculative_num_draft_tokens": self.draft_tokens}


SHAPES = {"topk1": Shape("topk1", 3, 1, 4), "topk4": Shape("topk4", 3, 4, 8)}

# A 5-field nested schema with arrays, lengths and patterns: what the notes' H200 table describes (its exact text was
# not recorded). ``log`` needs at least 64 items of >= 3 tokens, so every request runs to max_new_tokens (<= 160)
# whatever the model writes.
BENCH_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 4, "maxLength": 40},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2, "maxItems": 8},
        "log": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"t": {"type": "integer", "minimum": 0, "maximum": 999},
                               "m": {"type": "string", "minLength": 1, "maxLength": 12}},
                "required": ["t", "m"],
                "additionalProperties": False,
            },
            "minItems": 64,
        },
    },
    "required": ["id", "name", "address", "tags", "log"],
    "additionalProperties": False,
}




@dataclasses.dataclass(frozen=True)
class Workload:
    """What the engines run and the requests ask for. ``target_config`` / ``draft_config``: directories under
    ``benchmarks/configs/`` whose ``config.json`` is loaded with random weights (``load_format="dummy"``) and a local
    tokenizer of the config's vocabulary; ``model_path`` / ``draft_model_path`` (a real pair, e.g. a local checkpoint
    on the GPU host) replace them, and ``--model-path`` / ``--draft-model-path`` replace both. ``max_new_tokens`` is
    the GPU default (CPU mode: 24); ``schema`` must keep every request running to it (or the md flags the cell)."""

    name: str
    what: str
    target_config: str
    draft_config: str
    schema: Dict[str, Any]
    max_new_tokens: int = 160
    prompt: str = "Request {rnd}-{i}: write the service record as JSON."
    model_path: Optional[str] = None
    draft_model_path: Optional[str] = None


# A second workload (a real model pair, another schema) is one more entry here; run it with
# `scripts/gpu/run.sh bench-workload OUT NAME [SHAPE]` (or `--workload NAME`).
WORKLOADS: Dict[str, Workload] = {
    "dummy-8b-json": Workload("dummy-8b-json", "the measured H200 table: Llama-3.1-8B-shaped dummy + EAGLE3 draft, "
                              "BENCH_SCHEMA, 160-token outputs", "llama-3.1-8b", "llama-3.1-8b-eagle3", BENCH_SCHEMA),
}
DEFAULT_WORKLOAD = "dummy-8b-json"


# -- pure helpers (tests/benchmarks/test_bench_gpu_constrained.py) -------------------------------------------------
def parse_shapes(names: str, extra: Sequence[str] = ()) -> List[Shape]:
    """``--shapes topk1,topk4`` plus ``--shape name=steps,topk,tokens`` definitions, in that order."""
    defined = dict(SHAPES)
    for spec in extra:
        name, sep, nums = spec.partition("=")
        parts = nums.split(",")
        if not sep or not name or len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--shape expects name=steps,topk,tokens (e.g. topk8=5,8,64), got {spec!r}")
        steps, topk, tokens = (int(p) for p in parts)
        if topk == 1 and tokens != steps + 1:
            raise ValueError(f"--shape {spec!r}: with topk 1 SGLang needs tokens = steps + 1 = {steps + 1}")
        defined[name] = Shape(name, steps, topk, tokens)
    listed = [n for n in names.split(",") if n] if names else []
    unknown = [n for n in listed if n not in defined]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; known: {sorted(defined)} (define one with --shape)")
    out = [defined[n] for n in listed]
    out += [defined[s.partition("=")[0]] for s in extra if defined[s.partition("=")[0]] not in out]
    return out


def parse_ints(text: str) -> List[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return vals


def round_result(records: Sequence[Sequence[float]], outs: Sequence[Dict[str, Any]], bs: int, grammar: bool,
                 max_new_tokens: int) -> Dict[str, Any]:
    """One measured round: ``records`` are the step probe's records written while the round ran (``[step_ms,
    grammar_ms, run_batch_ms, bs, grammar]``); the round's steps are those whose batch held all ``bs`` requests and
    was (``grammar``) or was not a grammar batch. ``outs`` are the round's outputs: accept length = (output tokens -
    the prefill's one) / verify steps; ``full_batch`` says whether every request ran to ``max_new_tokens``."""
    steps = [list(r) for r in full_batch_steps(records, bs) if len(r) > 4 and bool(r[4]) == grammar]
    tokens = [int(o["meta_info"]["completion_tokens"]) for o in outs]
    verify = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs]
    return {
        "ms_step": statistics.median(s[0] for s in steps) if steps else None,
        "n_steps": len(steps),
        "steps": steps,
        "tokens_min": min(tokens),
        "tokens_max": max(tokens),
        "accept_len": (sum(tokens) - len(tokens)) / sum(verify) if sum(verify) > 0 else None,
        "full_batch": min(tokens) >= max_new_tokens,
        "requests": len(outs),
    }


def phases_per_step(delta: Dict[str, float], requests: int) -> Optional[Dict[str, float]]:
    """Plugin stats delta over some batches -> ms per plugin verify step, and time-limit hits per request."""
    steps = delta.get("steps") or 0
    if steps <= 0:
        return None
    out = {k[:-2] + "_ms": (delta.get(k) or 0.0) / steps * 1e3 for k in PHASE_KEYS if k.endswith("_s")}
    out["steps"] = steps
    out["mask_timeouts_per_request"] = delta["mask_timeouts"] / requests if requests else 0.0
    return out


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize_cell(rounds: Sequence[Dict[str, Any]], phases: Sequence[Dict[str, float]]) -> Dict[str, Any]:
    """One (shape, bs, variant): the median (p10-p90) and the mean of the scheduler-timed steps pooled over its rounds,
    the best round's median, the probe's grammar ms per step, ms/token = mean ms/step / accept length (the mean is what
    a request pays: a few slow steps move it and not the median); phases summed over rounds, then per plugin step."""
    su = summarize_steps([s for r in rounds for s in r["steps"]])
    accept = _median([r["accept_len"] for r in rounds])
    per_round = [r["ms_step"] for r in rounds if r["ms_step"] is not None]
    total = {k: sum(p.get(k) or 0 for p in phases) for k in PHASE_KEYS} if phases else None
    requests = sum(r.get("requests", 0) for r in rounds)
    ms_step, mean = su.get("step_ms"), su.get("step_ms_mean")
    return {
        "n": len(per_round),
        "n_steps": su["n"],
        "ms_step": ms_step,
        "ms_step_p10": su.get("step_ms_p10"),
        "ms_step_p90": su.get("step_ms_p90"),
        "ms_step_best": min(per_round) if per_round else None,
        "ms_step_mean": mean,
        "grammar_ms": su.get("grammar_ms"),
        "ms_token": mean / accept if mean is not None and accept else None,
        "accept_len": accept,
        "full_batch": all(r["full_batch"] for r in rounds) if rounds else False,
        "phases": phases_per_step(total, requests) if total else None,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _over(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a`` over ``b`` minus one (an overhead), None when either is missing."""
    r = _ratio(a, b)
    return None if r is None else r - 1.0


def table_rows(cells: Dict[Tuple[str, int, str], Dict[str, Any]], shapes: Sequence[str],
               batch_sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per (shape, bs): the three variants side by side, overhead json / unconstrained - 1, off / json."""
    rows = []
    for shape in shapes:
        for bs in batch_sizes:
            row: Dict[str, Any] = {"shape": shape, "bs": bs}
            for v in VARIANTS:
                row[v] = cells.get((shape, bs, v)) or {"n": 0, "ms_step": None}
            for suffix, key in (("", "ms_step"), ("_mean", "ms_step_mean")):
                on, unc, off, inline = (row[v].get(key) for v in VARIANTS)
                row["overhead" + suffix] = _over(on, unc)
                row["inline_overhead" + suffix] = _over(inline, unc)
            row["off_over_on"] = _ratio(row["json-off"].get("ms_step"), row["json"].get("ms_step"))
            row["inline_over_on"] = _ratio(row["json-inline"].get("ms_step"), row["json"].get("ms_step"))
            rows.append(row)
    return rows


def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(result: Dict[str, Any]) -> str:
    m = result["machine"]
    commands = result.get("commands") or [result["command"]]
    lines = [
        f"# Constrained EAGLE3 decode step on {m['device_name']}: plugin vs unconstrained vs plugin off",
        "",
        f"MEASURED on {m['device_name']} ({m['cpus']} host CPUs), SGLang {m['sglang']}, xgrammar {m['xgrammar']}, "
        f"torch {m['torch']}, Python {m['python']}; workload {result.get('workload', DEFAULT_WORKLOAD)}: model "
        f"{result['model']}; max_new_tokens {result['max_new_tokens']}, {result['rounds']} rounds x "
        f"{result['repeats']} repeats after a warm-up round per batch size.",
        "",
        "Command" + ("s" if len(commands) > 1 else "") + ": " + "; ".join(f"`{c}`" for c in commands),
        "",
        "ms/step = median (p10-p90) of the decode steps the scheduler timed (step probe: one scheduler-loop iteration "
        "between two speculative decode launches) whose batch held all `bs` requests, pooled over the rounds; "
        "`best` = the best round's median; `mean` = the mean of the same steps (what a request pays: slow grammar steps "
        "move it, not the median); ms/token = mean ms/step / accept length; `over unc.` = json with the plugin "
        "over unconstrained; `off/on` = json with the plugin off (stock SGLang) over json with the plugin, both "
        "from the same run; `grammar` = the probe's grammar ms per step (SGLang's grammar entry points and the "
        "plugin's mask step), json / json off; phases = the plugin's own stats per verify step (advance incl. "
        "waits / tree wait / mask / un-hidden / the grammar thread's hand-off latency / the join's wait, ms) and mask "
        "time-limit hits per request.",
        "",
    ]
    inline_run = any(r.get("json-inline", {}).get("n") for r in result["rows"])
    if inline_run:
        lines += ["`json inline` = the plugin with its grammar thread off, in its own engine (SGLANG_EAGLE_OVERLAP_"
                  "GRAMMAR_THREAD=0: the grammar work inline on the scheduler thread); `inline/json` = its ms/step "
                  "over json's (the default path, the grammar thread).", ""]
    if m.get("device") == "cpu":
        lines += ["CPU mode: tiny models, the forward runs synchronously on the scheduler thread, so nothing can be "
                  "hidden; these rows exercise the benchmark end to end and are no GPU result (on a shared machine "
                  "they are also noisy: compare nothing across engines here).", ""]
    head = ("| EAGLE3 | bs | unconstrained ms/step | json plugin ms/step | json plugin off ms/step | best unc / json / "
            "off | mean unc / json / off | ms/token unc / json / off | over unc. median / mean | off/on | grammar ms json / off | phases adv / tree / "
            "mask / unhidden / hand-off / join ms | limit hits/req | accept | steps unc / json / off |")
    if inline_run:
        head += " json inline ms/step | json inline mean | inline over unc. median / mean | inline/json | accept inline |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]

    def _step(c: Dict[str, Any]) -> str:
        if c.get("ms_step") is None:
            return "–"
        if c.get("ms_step_p10") is None:
            return _f(c["ms_step"])
        return f"{c['ms_step']:.2f} ({c['ms_step_p10']:.2f}-{c['ms_step_p90']:.2f})"

    for r in result["rows"]:
        on, unc, off = (r[v] for v in VARIANTS[:3])
        inl = r.get("json-inline") or {}
        ph = on.get("phases")
        phs = (f"{ph['advance_ms']:.2f} / {ph['tree_wait_ms']:.2f} / {ph['mask_ms']:.2f} / {ph['unhidden_ms']:.2f} / "
               f"{ph.get('handoff_ms', 0.0):.2f} / {ph.get('join_wait_ms', 0.0):.2f}" if ph else "–")
        hits = _f(ph["mask_timeouts_per_request"]) if ph else "–"
        flag = "" if all(r[v].get("full_batch", True) for v in VARIANTS if r.get(v, {}).get("n")) else " (batch shrank)"
        line = (f"| {r['shape']} | {r['bs']}{flag} | {_step(unc)} | {_step(on)} | {_step(off)} | "
                f"{_f(unc.get('ms_step_best'))} / {_f(on.get('ms_step_best'))} / {_f(off.get('ms_step_best'))} | "
                f"{_f(unc.get('ms_step_mean'))} / {_f(on.get('ms_step_mean'))} / {_f(off.get('ms_step_mean'))} | "
                f"{_f(unc.get('ms_token'))} / {_f(on.get('ms_token'))} / {_f(off.get('ms_token'))} | "
                f"{_f(r['overhead'], '{:+.1%}')} / {_f(r.get('overhead_mean'), '{:+.1%}')} | "
                f"{_f(r['off_over_on'], '{:.2f}x')} | "
                f"{_f(on.get('grammar_ms'))} / {_f(off.get('grammar_ms'))} | {phs} | {hits} | "
                f"{_f(on.get('accept_len'))} | {unc.get('n_steps', 0)} / {on.get('n_steps', 0)} / "
                f"{off.get('n_steps', 0)} |")
        if inline_run:
            line += (f" {_step(inl)} | {_f(inl.get('ms_step_mean'))} | {_f(r.get('inline_overhead'), '{:+.1%}')} / "
                     f"{_f(r.get('inline_overhead_mean'), '{:+.1%}')} | "
                     f"{_f(r.get('inline_over_on'), '{:.2f}x')} | {_f(inl.get('accept_len'))} |")
        lines.append(line)
    if result.get("problems"):
        lines += ["", "Problems seen:", ""] + [f"- {p}" for p in result["problems"]]
    lines.append("")
    return "\n".join(lines)


def plot(result: Dict[str, Any], path: Path) -> bool:
    """ms/step vs batch size, one panel per shape; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4), squeeze=False)
    styles = {"json": ("json_schema, plugin", "tab:green"), "unconstrained": ("unconstrained", "tab:blue"),
              "json-off": ("json_schema, plugin off", "tab:red"),
              "json-inline": ("json_schema, plugin with the grammar inline", "tab:orange")}
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        for v, (label, color) in styles.items():
            pts = [(r["bs"], r[v]["ms_step"]) for r in rows if (r.get(v) or {}).get("ms_step") is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label, color=color)
        sizes = sorted({r["bs"] for r in rows})
        ax.set_xscale("log", base=2)  # 1 / 8 / 32 / 64 evenly readable
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_title(f"EAGLE3 {shape}")
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per decode step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['machine']['device_name']}, SGLang {result['machine']['sglang']} ({result['model']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- models and engines --------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get("SGLANG_EO_BENCH_CACHE") or ROOT / ".cache" / "gpu-bench")


def build_tokenizer_dir(vocab_size: int) -> Path:
    """The dev package's locally trained byte-level BPE tokenizer, built in a subprocess: its builder installs the
    CPU venvs' torchvision import shim, which must not touch this (GPU) process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "dev"), env.get("PYTHONPATH", "")])
    code = ("from sglang_eo_dev.cpu_runtime.models import build_tokenizer; "
            f"print(build_tokenizer({int(vocab_size)}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def dummy_model_dirs(target_cfg: Path, draft_cfg: Path) -> Tuple[Path, Path]:
    """Model directories for ``load_format="dummy"``: the shipped ``config.json`` files plus the local tokenizer, with
    the token ids (eos / pad; no bos) set to that tokenizer's. Cached under :func:`cache_dir`."""
    target = json.loads((target_cfg / "config.json").read_text())
    draft = json.loads((draft_cfg / "config.json").read_text())
    tok_dir = build_tokenizer_dir(int(target["vocab_size"]))
    special = json.loads((tok_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    ids = {t["content"]: t["id"] for t in special}
    eos, pad = ids["<|endoftext|>"], ids["<|pad|>"]
    out = cache_dir()
    dirs = []
    for name, cfg in (("target", target), ("draft", draft)):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        cfg = dict(cfg, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)  # the tokenizer has no BOS
        for f in tok_dir.iterdir():
            if f.is_file() and not f.name.startswith(".") and f.name != "config.json":
                shutil.copy(f, d / f.name)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}))
        dirs.append(d)
    return dirs[0], dirs[1]


def gpu_engine_kwargs(args: argparse.Namespace, shape: Shape, target: str, draft: str) -> Dict[str, Any]:
    """This run's GPU engine arguments (built by ``benchmarks/gpu_engine_args.py``, the CUDA tests' builder too)."""
    return build_gpu_engine_kwargs(
        model_path=target,
        max_bs=max(args.batch_sizes),
        draft_model_path=draft,
        spec=shape.engine_kwargs(),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        sampling_backend=args.sampling_backend,
        mem_fraction_static=args.mem_fraction_static,
        context_length=args.context_length,
        dummy_weights=args.dummy,
        disable_radix_cache=True,
    )


def install_step_probe(tmp: str) -> None:
    """Make the dev step probe load in every engine process of this run: a folder holding a distribution that
    declares the probe's SGLang plugin entry point and a link to the dev package goes first on ``sys.path`` (spawned
    processes inherit it) and ``PYTHONPATH``. The ``dev/`` folder itself is never put on the path (its CPU
    ``sgl_kernel`` stand-in would shadow the real kernels on a GPU), so the writer is loaded from its file. On CPU the
    CPU runtime installs the same probe as well; the second install is a no-op."""
    path = ROOT / "dev" / "sglang_eo_dev" / "cpu_runtime" / "step_times.py"
    spec = importlib.util.spec_from_file_location("_bench_step_probe_writer", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    probe = writer.write_probe_distribution(os.path.join(tmp, "step-probe"))
    sys.path.insert(0, probe)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != probe]
    os.environ["PYTHONPATH"] = os.pathsep.join([probe, *paths])


def start_engine(args: argparse.Namespace, shape: Shape, plugin: bool, stats_file: Optional[str], step_file: str,
                 env: Optional[Dict[str, str]] = None):
    """Start an in-process engine with the plugin on or off; the caller shuts it down. The switch, the plugin's stats
    file, the step probe's file and ``env`` (plugin settings of this engine; those of the other engine kinds are
    cleared) go through the environment (the scheduler subprocess reads them at start)."""
    for kind_env in ENGINE_ENV.values():
        for key in kind_env:
            os.environ.pop(key, None)
    os.environ.update(env or {})
    if stats_file:  # also with the plugin off: a file written then would show the switch did not hold
        os.environ[STATS_ENV] = stats_file
        if os.path.exists(stats_file):
            os.remove(stats_file)
    else:
        os.environ.pop(STATS_ENV, None)
    os.environ[STEP_TIMES_ENV] = step_file
    if args.device == "cpu":
        from sglang_eo_dev.cpu_runtime.engine import EngineConfig
        from sglang_eo_dev.cpu_runtime.engine import start_engine as start_cpu

        spec = shape.name if shape.name in SHAPES else "topk1"  # the exact shape goes in through `extra`
        thread = (env or {}).get("SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD")  # the CPU runtime sets the switch itself
        cfg = EngineConfig(pair="random", spec=spec, overlap=True, product_plugin=plugin,
                           grammar_thread=None if thread is None else thread == "1",
                           max_running_requests=max(args.batch_sizes),
                           extra=(("disable_radix_cache", True), *shape.engine_kwargs().items()))
        return start_cpu(cfg)
    os.environ[SWITCH_ENV] = "1" if plugin else "0"
    import sglang

    return sglang.Engine(**gpu_engine_kwargs(args, shape, args.model_path, args.draft_model_path))


def read_stats(path: Optional[str]) -> Dict[str, Any]:
    if not path:
        return {}
    for _ in range(5):  # the plugin replaces the file atomically; a missing file means no step yet
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError:
            time.sleep(0.01)
    return {}


def _prompts(workload: Workload, bs: int, rnd: int) -> List[str]:
    return [workload.prompt.format(rnd=rnd, i=i) for i in range(bs)]


def _params(workload: Workload, variant: str, max_new_tokens: int) -> Dict[str, Any]:
    p: Dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    if variant == "unconstrained":
        p["ignore_eos"] = True
    else:
        p["json_schema"] = json.dumps(workload.schema)
    return p


def measure_round(engine, workload: Workload, variant: str, bs: int, rnd: int, max_new_tokens: int,
                  step_file: str, stats_file: Optional[str]) -> Tuple[Dict[str, Any], Optional[Dict[str, float]]]:
    """One batch of ``bs`` requests to ``max_new_tokens``; its steps are the probe records written meanwhile."""
    from sglang_eo_dev.cpu_runtime.step_times import read_step_times

    n0 = len(read_step_times(step_file)["steps"])
    before = read_stats(stats_file) if variant in JSON_VARIANTS else {}
    outs = engine.generate(prompt=_prompts(workload, bs, rnd), sampling_params=_params(workload, variant,
                                                                                        max_new_tokens))
    after = read_stats(stats_file) if variant in JSON_VARIANTS else {}
    records = read_step_times(step_file)["steps"][n0:]
    r = round_result(records, outs, bs, grammar=(variant != "unconstrained"), max_new_tokens=max_new_tokens)
    phases = delta(after, before, PHASE_KEYS) if after else None
    return r, phases


def _machine(device: str) -> Dict[str, Any]:
    m = _host_machine()
    name = m["processor"] or m["machine"]
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    return {**m, "device": device, "device_name": name}


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD, help=f"one of {sorted(WORKLOADS)}")
    ap.add_argument("--shapes", default="topk1,topk4", help="comma-separated shape names")
    ap.add_argument("--shape", action="append", default=[], help="extra shape: name=steps,topk,tokens")
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,32,64 (cuda) / 1,4 (cpu)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's (160) on cuda / 24 (cpu)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="warm-up round length; default 32 (cuda) / 4 (cpu)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per cell per engine; default 2 (cuda) / 1 (cpu)")
    ap.add_argument("--repeats", type=int, default=1, help="engine pairs (plugin on, off) per shape")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"subset of {','.join(VARIANTS)} (json-inline: a third engine, the plugin with its grammar work inline)")
    ap.add_argument("--model-path", default=None, help="a real target model (default: the workload's dummy config)")
    ap.add_argument("--draft-model-path", default=None, help="its EAGLE3 draft (with --model-path)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--sampling-backend", default=None)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--no-plugin-stats", action="store_true", help="do not write the plugin's per-step stats file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="join the rows of result json files of earlier runs into one table under --out; no engine")
    args = ap.parse_args(argv)
    if args.merge:
        return args
    if args.workload not in WORKLOADS:
        ap.error(f"--workload: unknown {args.workload!r}; known: {sorted(WORKLOADS)} (add one to WORKLOADS)")
    args.workload_def = WORKLOADS[args.workload]
    args.device = _default_device() if args.device == "auto" else args.device
    gpu = args.device == "cuda"
    args.batch_sizes = parse_ints(args.batch_sizes or ("1,8,32,64" if gpu else "1,4"))
    args.max_new_tokens = args.max_new_tokens or (args.workload_def.max_new_tokens if gpu else 24)
    args.warmup_tokens = min(args.warmup_tokens or (32 if gpu else 4), args.max_new_tokens)
    args.rounds = args.rounds or (2 if gpu else 1)
    args.shape_list = parse_shapes(args.shapes, args.shape)
    args.variant_list = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    if bool(args.model_path) != bool(args.draft_model_path):
        ap.error("--model-path and --draft-model-path go together")
    if gpu and not args.model_path and args.workload_def.model_path:
        args.model_path, args.draft_model_path = args.workload_def.model_path, args.workload_def.draft_model_path
    if args.model_path and not gpu:
        ap.error("--model-path needs --device cuda (the CPU mode runs the tiny local pair)")
    args.dummy = gpu and not args.model_path
    return args


def result_name(device: str, sglang: str, workload: str, shapes: Sequence[str]) -> str:
    """``gpu_constrained_<device>_<sglang>``, plus the workload when not the default and the shapes when not the
    default pair, so runs of one shape each can share an output folder."""
    name = f"gpu_constrained_{device}_{sglang}"
    if workload != DEFAULT_WORKLOAD:
        name += f"_{workload}"
    if list(shapes) != ["topk1", "topk4"]:
        name += "_" + "-".join(shapes)
    return name


def merge_results(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One result from several runs (e.g. one device call per shape, or the stock column in a call of its own):
    engines, problems and commands concatenated. When every run kept its raw rounds, the rows are rebuilt from them,
    one row per (shape, bs): the variants of one cell measured in different runs stand side by side (their ratios
    then span the runs) and rounds of the same variant are pooled. Without raw rounds the rows are concatenated and
    each keeps the ratios of its own run. Differences in machine, workload or SGLang version are listed as problems
    (such rows should not share a table)."""
    if not results:
        raise ValueError("nothing to merge")
    first = results[0]
    merged = {k: first.get(k) for k in ("machine", "model", "workload", "max_new_tokens", "rounds", "repeats")}
    merged.update(rows=[], engines=[], problems=[], commands=[], raw=[], wall_s=0.0,
                  shapes=[], batch_sizes=sorted({b for r in results for b in r.get("batch_sizes", [])}))
    for r in results:
        for key in ("device_name", "sglang"):
            if r["machine"].get(key) != first["machine"].get(key):
                merged["problems"].append(f"merged runs differ in {key}: {r['machine'].get(key)!r} vs "
                                          f"{first['machine'].get(key)!r}")
        for key in ("workload", "model", "max_new_tokens"):
            if r.get(key) != first.get(key):
                merged["problems"].append(f"merged runs differ in {key}: {r.get(key)!r} vs {first.get(key)!r}")
        merged["engines"] += r.get("engines", [])
        merged["problems"] += r.get("problems", [])
        merged["commands"] += r.get("commands") or [r["command"]]
        merged["raw"] += r.get("raw", [])
        merged["shapes"] += [s for s in r.get("shapes", []) if s not in merged["shapes"]]
        merged["wall_s"] += r.get("wall_s", 0.0)
    merged["command"] = merged["commands"][0]
    if all(r.get("raw") for r in results):
        return resummarize(merged)
    merged["rows"] = [row for r in results for row in r["rows"]]
    return merged


def resummarize(result: Dict[str, Any]) -> Dict[str, Any]:
    """``result`` with its rows rebuilt from its raw rounds by this version's :func:`summarize_cell` (a file written by
    an older version gets the newer columns; the ratios stay those of its own run), the rounds and phases of raw cells
    of one (shape, bs, variant) pooled (:func:`merge_results`' raw holds one per run). A result without raw rounds is
    returned as it is."""
    raw = result.get("raw")
    if not raw:
        return result
    rounds: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    phases: Dict[Tuple[str, int, str], List[Dict[str, float]]] = {}
    for cell in raw:
        key = (cell["shape"], cell["bs"], cell["variant"])
        rounds.setdefault(key, []).extend(cell["rounds"])
        phases.setdefault(key, []).extend(cell.get("phases") or [])
    cells = {k: summarize_cell(v, phases[k]) for k, v in rounds.items()}
    shapes = [s["name"] if isinstance(s, dict) else s for s in result.get("shapes", [])]
    return {**result, "rows": table_rows(cells, shapes or sorted({k[0] for k in cells}), result["batch_sizes"])}


def write_outputs(result: Dict[str, Any], out: Path, name: str, final: bool) -> None:
    """The json and md (and, when ``final``, the png) of ``result`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))
    if final:
        plotted = plot(result, out / f"{name}.png")
        print(markdown(result))
        print(f"wrote {out / name}.json, .md{', .png' if plotted else ''} in {result.get('wall_s', 0):.0f} s",
              flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    argv_list = list(argv if argv is not None else sys.argv[1:])
    command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_gpu_constrained.py", *argv_list])
    if args.merge:
        merged = merge_results([resummarize(json.loads(Path(f).read_text())) for f in args.merge])
        m = merged["machine"]
        write_outputs(merged, Path(args.out), f"gpu_constrained_{m['device']}_{m['sglang']}_merged", final=True)
        return 1 if merged["problems"] else 0
    workload: Workload = args.workload_def
    if args.dummy:
        t = time.monotonic()
        target, draft = dummy_model_dirs(CONFIGS / workload.target_config, CONFIGS / workload.draft_config)
        args.model_path, args.draft_model_path = str(target), str(draft)
        print(f"dummy model dirs ready in {time.monotonic() - t:.0f} s: {target}, {draft}", flush=True)
    machine = _machine(args.device)
    problems: List[str] = []
    rounds: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    phases: Dict[Tuple[str, int, str], List[Dict[str, float]]] = {}
    engines: List[Dict[str, Any]] = []  # per engine: was the plugin active (read from its stats file)
    t0 = time.monotonic()
    name = result_name(args.device, machine["sglang"], args.workload, [s.name for s in args.shape_list])
    model = (f"{workload.target_config} + {workload.draft_config} (benchmarks/configs, load_format=dummy)"
             if args.dummy else (f"{args.model_path} + {args.draft_model_path}" if args.device == "cuda" else
                                 "tiny random pair (CPU runtime)"))

    def result() -> Dict[str, Any]:
        cells = {k: summarize_cell(v, phases.get(k, [])) for k, v in rounds.items()}
        rows = table_rows(cells, [s.name for s in args.shape_list], args.batch_sizes)
        return {
            "command": command,
            "machine": machine,
            "workload": args.workload,
            "model": model,
            "shapes": [dataclasses.asdict(s) for s in args.shape_list],
            "batch_sizes": args.batch_sizes,
            "max_new_tokens": args.max_new_tokens,
            "warmup_tokens": args.warmup_tokens,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "plugin_stats": not args.no_plugin_stats,
            "wall_s": time.monotonic() - t0,
            "rows": rows,
            "engines": engines,
            "raw": [{"shape": k[0], "bs": k[1], "variant": k[2], "rounds": v, "phases": phases.get(k, [])}
                    for k, v in rounds.items()],
            "problems": problems,
        }

    tmp = tempfile.mkdtemp(prefix="bench-gpu-constrained-")
    try:
        install_step_probe(tmp)
        from sglang_eo_dev.cpu_runtime.step_times import read_step_times

        for shape in args.shape_list:
            for rep in range(args.repeats):
                for kind in ("on", "off", "inline"):
                    variants = [v for v in ENGINE_VARIANTS[kind] if v in args.variant_list]
                    if not variants:
                        continue
                    tag = f"{shape.name}-{kind}-{rep}"
                    stats = None if args.no_plugin_stats else os.path.join(tmp, f"stats-{tag}.json")
                    step_file = os.path.join(tmp, f"steps-{tag}.jsonl")
                    ts = time.monotonic()
                    plugin_on = kind != "off"
                    engine = start_engine(args, shape, plugin=plugin_on, stats_file=stats, step_file=step_file,
                                          env=ENGINE_ENV[kind])
                    start_s = time.monotonic() - ts
                    print(f"[{time.monotonic() - t0:.0f}s] {shape.name} plugin {kind} #{rep}: engine up in "
                          f"{start_s:.0f} s", flush=True)
                    try:
                        for bs in args.batch_sizes:
                            for v in variants:  # warm-up at this batch size: grammar compile, first batches
                                measure_round(engine, workload, v, bs, -1, args.warmup_tokens, step_file, None)
                            for rnd in range(args.rounds):
                                for v in variants:
                                    r, ph = measure_round(engine, workload, v, bs, rep * args.rounds + rnd,
                                                          args.max_new_tokens, step_file, stats)
                                    rounds.setdefault((shape.name, bs, v), []).append(r)
                                    if ph:
                                        phases.setdefault((shape.name, bs, v), []).append(ph)
                                    if not r["full_batch"]:
                                        problems.append(f"{shape.name} bs{bs} {v}: outputs of {r['tokens_min']}-"
                                                        f"{r['tokens_max']} tokens, not all {args.max_new_tokens}")
                                    if not r["n_steps"]:
                                        problems.append(f"{shape.name} bs{bs} {v} round {rnd}: the scheduler timed "
                                                        "no full-batch decode step (step probe not loaded? "
                                                        "SGLANG_PLUGINS must allow eo_step_times)")
                                    print(f"[{time.monotonic() - t0:.0f}s] {shape.name} bs {bs} {v} round {rnd}: "
                                          f"{_f(r['ms_step'])} ms/step over {r['n_steps']} steps, accept "
                                          f"{_f(r['accept_len'])}", flush=True)
                        problems.extend(f"{tag}: step probe: {e}" for e in read_step_times(step_file)["errors"])
                        if stats and (not plugin_on or set(JSON_VARIANTS) & set(variants)):  # written per grammar step
                            active = bool(read_stats(stats).get("active"))
                            engines.append({"shape": shape.name, "plugin": kind, "rep": rep, "active": active,
                                            "start_s": start_s, "engine_s": time.monotonic() - ts})
                            if active != plugin_on:
                                problems.append(f"{shape.name} plugin {kind} #{rep}: plugin active={active} in "
                                                f"the engine started with {SWITCH_ENV}={int(plugin_on)}")
                    finally:
                        engine.shutdown()
                    write_outputs(result(), Path(args.out), name, final=False)  # a run cut short keeps this much
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    final = result()
    write_outputs(final, Path(args.out), name, final=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
