"""Constrained EAGLE3 decode-step time on a GPU: json_schema with the plugin vs unconstrained vs plugin off (issue #11).

What it measures, in ONE run, per EAGLE3 shape (default topk 1: 3 steps / 4 draft tokens, and topk 4: 3 steps /
8 draft tokens; others by ``--shape name=steps,topk,tokens``) and per batch size (default 1/8/32/64):

* ``json``: ``json_schema`` requests (``BENCH_SCHEMA``: 5 fields, nested object, arrays with lengths, patterns; its
  ``log`` array needs >= 64 items so no request can end before ``--max-new-tokens``) with the plugin on;
* ``unconstrained``: the same prompts without a schema (``ignore_eos``), same engine;
* ``json-off``: the same json_schema requests on an engine started with ``SGLANG_EAGLE_OVERLAP=0`` (stock SGLang).

The plugin-on engine and the plugin-off engine alternate (on, off per repeat); inside the plugin-on engine json and
unconstrained alternate per round. Step time per round: a batch of ``bs`` requests runs to ``max_new_tokens`` (wall
``T_N``), the same prompts run to one token (``T_1``: admission + prefill); ``ms/step = (T_N - T_1) / verify steps``
and ``ms/token = (T_N - T_1) / (output tokens per request - 1)``. With random (dummy) weights the accept length is
~1, so ms/step ~ ms/token: every step pays the full verify and the full tree mask, as in the notes' H200 table. The
radix cache is off so both batches prefill the same way. Reported: medians over rounds x repeats, the overhead of json
over unconstrained, the ratio plugin-off / plugin, and the plugin's own per-step phases from its stats file
(``SGLANG_EAGLE_OVERLAP_STATS_FILE``: advance, tree wait, mask, un-hidden, mask time-limit hits per request). Writing
that file costs the plugin engine a small file write per step; ``--no-plugin-stats`` turns it off.

Devices:

* ``cuda`` (default when a GPU is visible): SGLang with ``load_format="dummy"`` from ``benchmarks/configs/``
  (Llama-3.1-8B-shaped target, EAGLE3 draft, ``draft_vocab_size`` = vocab) and a 128k byte-level BPE tokenizer built
  locally (~7 s, cached), bf16, CUDA graphs, overlap scheduler; or a real pair with ``--model-path`` /
  ``--draft-model-path``. ``--attention-backend triton --sampling-backend pytorch`` avoid flashinfer (what
  ``scripts/gpu/run.sh`` passes on the offline host). When the default dummy configs run, the md also shows the
  calibrated TPOT model (``benchmarks/tpot_model.py``) next to every measured cell.
* ``cpu``: the real SGLang engine on CPU through the dev-only CPU runtime (``sglang_eo_dev.cpu_runtime``) with the tiny
  random pair: the same code path end to end, small and quick (CI runs it); CPU numbers are CPU mechanics, not GPU
  overlap.

Run::

    python benchmarks/bench_gpu_constrained.py                       # a GPU: 8B-shaped dummy model, full grid
    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/bench_gpu_constrained.py --device cpu

Writes ``benchmarks/results/gpu_constrained_<device>_<sglang>.{json,md,png}`` (``--out`` elsewhere). Not a test: no
timing gates anything.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from bench_engine_step import delta  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
SWITCH_ENV = "SGLANG_EAGLE_OVERLAP"

VARIANTS = ("json", "unconstrained", "json-off")  # table order
ENGINE_VARIANTS = {"on": ("json", "unconstrained"), "off": ("json-off",)}
PHASE_KEYS = ("steps", "advance_s", "tree_wait_s", "mask_s", "unhidden_s", "mask_timeouts")


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

# A 5-field nested schema with arrays, lengths and patterns (the shape the notes' H200 table used). ``log`` needs at
# least 64 items of >= 3 tokens, so every request runs to max_new_tokens (<= 160) whatever the model writes.
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


def verify_steps(outs: Sequence[Dict[str, Any]]) -> int:
    """Decode steps the batch took: the most verify steps of any request (completion tokens without speculation)."""
    return max(int(o["meta_info"].get("spec_verify_ct") or o["meta_info"]["completion_tokens"]) for o in outs)


def round_result(t_full: float, t_one: float, full: Sequence[Dict[str, Any]], one: Sequence[Dict[str, Any]],
                 max_new_tokens: int) -> Dict[str, Any]:
    """One measured round: ``full`` ran to ``max_new_tokens`` in ``t_full`` s, ``one`` (same prompts) to a single
    token in ``t_one`` s. The difference is the decode part; ``full_batch`` says whether every request ran to
    ``max_new_tokens`` (else the batch shrank before the end and ms/step mixes batch sizes)."""
    tokens = [int(o["meta_info"]["completion_tokens"]) for o in full]
    steps = verify_steps(full) - (verify_steps(one) if one and any(
        o["meta_info"].get("spec_verify_ct") for o in one) else 0)
    decode_s = t_full - t_one
    mean_tokens = statistics.mean(tokens)
    return {
        "ms_step": decode_s / steps * 1e3 if steps > 0 else None,
        "ms_token": decode_s / (mean_tokens - 1) * 1e3 if mean_tokens > 1 else None,
        "steps": steps,
        "tokens_min": min(tokens),
        "tokens_max": max(tokens),
        "accept_len": (sum(tokens) - len(tokens)) / (steps * len(tokens)) if steps > 0 else None,
        "full_batch": min(tokens) >= max_new_tokens,
        "t_full_s": t_full,
        "t_one_s": t_one,
    }


def phases_per_step(delta: Dict[str, float], requests: int) -> Optional[Dict[str, float]]:
    """Plugin stats delta over some batches -> ms per plugin verify step, and time-limit hits per request."""
    steps = delta.get("steps") or 0
    if steps <= 0:
        return None
    out = {k.replace("_s", "_ms"): delta[k] / steps * 1e3 for k in ("advance_s", "tree_wait_s", "mask_s",
                                                                    "unhidden_s")}
    out["steps"] = steps
    out["mask_timeouts_per_request"] = delta["mask_timeouts"] / requests if requests else 0.0
    return out


def _median(xs: Sequence[Optional[float]]) -> Optional[float]:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize_cell(rounds: Sequence[Dict[str, Any]], phases: Sequence[Dict[str, float]]) -> Dict[str, Any]:
    """Medians (and best) over the rounds of one (shape, bs, variant); phases summed over rounds, then per step."""
    steps = [r["ms_step"] for r in rounds if r["ms_step"] is not None]
    total = {k: sum(p[k] for p in phases) for k in PHASE_KEYS} if phases else None
    requests = sum(r.get("requests", 0) for r in rounds)
    return {
        "n": len(steps),
        "ms_step": _median(steps),
        "ms_step_best": min(steps) if steps else None,
        "ms_token": _median([r["ms_token"] for r in rounds]),
        "accept_len": _median([r["accept_len"] for r in rounds]),
        "full_batch": all(r["full_batch"] for r in rounds) if rounds else False,
        "phases": phases_per_step(total, requests) if total else None,
    }


def table_rows(cells: Dict[Tuple[str, int, str], Dict[str, Any]], shapes: Sequence[str],
               batch_sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """One row per (shape, bs): the three variants side by side, overhead json / unconstrained - 1, off / json."""
    rows = []
    for shape in shapes:
        for bs in batch_sizes:
            row: Dict[str, Any] = {"shape": shape, "bs": bs}
            for v in VARIANTS:
                row[v] = cells.get((shape, bs, v)) or {"n": 0, "ms_step": None}
            on, unc, off = (row[v].get("ms_step") for v in VARIANTS)
            row["overhead"] = on / unc - 1.0 if on and unc else None
            row["off_over_on"] = off / on if on and off else None
            rows.append(row)
    return rows


def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(result: Dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"# Constrained EAGLE3 decode step on {m['device_name']}: plugin vs unconstrained vs plugin off",
        "",
        f"MEASURED on {m['device_name']} ({m['cpus']} host CPUs), SGLang {m['sglang']}, xgrammar {m['xgrammar']}, "
        f"torch {m['torch']}, Python {m['python']}; model {result['model']}; max_new_tokens "
        f"{result['max_new_tokens']}, {result['rounds']} rounds x {result['repeats']} repeats, medians.",
        "",
        f"Command: `{result['command']}`",
        "",
        "ms/step = (batch to max_new_tokens - same batch to 1 token) / verify steps; ms/token per output token; "
        "`over unc.` = json with the plugin over unconstrained; `off/on` = json with the plugin off (stock SGLang) "
        "over json with the plugin; phases = the plugin's own stats per verify step (advance incl. waits / tree "
        "wait / mask / un-hidden, ms) and mask time-limit hits per request.",
        "",
    ]
    if m.get("device") == "cpu":
        lines += ["CPU mode: tiny models, the forward runs synchronously on the scheduler thread, so nothing can be "
                  "hidden; these rows exercise the benchmark end to end and are no GPU result (on a shared machine "
                  "they are also noisy: compare nothing across engines here).", ""]
    has_model = any(r.get("model_plugin_ms") is not None for r in result["rows"])
    head = ("| EAGLE3 | bs | unconstrained ms/step | json plugin ms/step | json plugin off ms/step | ms/token unc / "
            "json / off | over unc. | off/on | phases adv / tree / mask / unhidden ms | limit hits/req | accept |")
    if has_model:
        head += " TPOT model plugin ms (err) |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        on, unc, off = (r[v] for v in VARIANTS)
        ph = on.get("phases")
        phs = (f"{ph['advance_ms']:.2f} / {ph['tree_wait_ms']:.2f} / {ph['mask_ms']:.2f} / {ph['unhidden_ms']:.2f}"
               if ph else "–")
        hits = _f(ph["mask_timeouts_per_request"]) if ph else "–"
        flag = "" if all(r[v].get("full_batch", True) for v in VARIANTS if r[v].get("n")) else " (batch shrank)"
        line = (f"| {r['shape']} | {r['bs']}{flag} | {_f(unc.get('ms_step'))} | {_f(on.get('ms_step'))} | "
                f"{_f(off.get('ms_step'))} | {_f(unc.get('ms_token'))} / {_f(on.get('ms_token'))} / "
                f"{_f(off.get('ms_token'))} | {_f(r['overhead'], '{:+.1%}')} | {_f(r['off_over_on'], '{:.2f}x')} | "
                f"{phs} | {hits} | {_f(on.get('accept_len'))} |")
        if has_model:
            mp, err = r.get("model_plugin_ms"), r.get("model_err")
            line += f" {_f(mp)} ({_f(err, '{:+.1%}')}) |" if mp is not None else " – |"
        lines.append(line)
    if has_model:
        lines += ["", "TPOT model column: PREDICTED by `benchmarks/tpot_model.py` (calibrated on the notes' H200 "
                      "table); err = predicted / measured here - 1."]
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
              "json-off": ("json_schema, plugin off", "tab:red")}
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in result["rows"] if r["shape"] == shape]
        for v, (label, color) in styles.items():
            pts = [(r["bs"], r[v]["ms_step"]) for r in rows if r[v].get("ms_step") is not None]
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
    kw: Dict[str, Any] = dict(
        model_path=target,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        dtype=args.dtype,
        max_running_requests=max(args.batch_sizes),
        cuda_graph_max_bs=max(args.batch_sizes),
        mem_fraction_static=args.mem_fraction_static,
        disable_radix_cache=True,
        random_seed=0,
        grammar_backend="xgrammar",
        log_level="warning",
        **shape.engine_kwargs(),
    )
    if args.dummy:
        kw["load_format"] = "dummy"
    if args.attention_backend:
        kw["attention_backend"] = args.attention_backend
    if args.sampling_backend:
        kw["sampling_backend"] = args.sampling_backend
    if args.context_length:
        kw["context_length"] = args.context_length
    return kw


def start_engine(args: argparse.Namespace, shape: Shape, plugin: bool, stats_file: Optional[str]):
    """Start an in-process engine with the plugin on or off; the caller shuts it down. The switch and the stats file
    go through the environment (the scheduler subprocess reads them when it loads the plugin)."""
    if stats_file:  # also with the plugin off: a file written then would show the switch did not hold
        os.environ[STATS_ENV] = stats_file
        if os.path.exists(stats_file):
            os.remove(stats_file)
    else:
        os.environ.pop(STATS_ENV, None)
    if args.device == "cpu":
        from sglang_eo_dev.cpu_runtime.engine import EngineConfig
        from sglang_eo_dev.cpu_runtime.engine import start_engine as start_cpu

        spec = shape.name if shape.name in SHAPES else "topk1"  # the exact shape goes in through `extra`
        cfg = EngineConfig(pair="random", spec=spec, overlap=True, product_plugin=plugin,
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


def _prompts(bs: int, rnd: int) -> List[str]:
    return [f"Request {rnd}-{i}: write the service record as JSON." for i in range(bs)]


def _params(variant: str, max_new_tokens: int) -> Dict[str, Any]:
    p: Dict[str, Any] = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    if variant == "unconstrained":
        p["ignore_eos"] = True
    else:
        p["json_schema"] = json.dumps(BENCH_SCHEMA)
    return p


def measure_round(engine, variant: str, bs: int, rnd: int, max_new_tokens: int,
                  stats_file: Optional[str]) -> Tuple[Dict[str, Any], Optional[Dict[str, float]]]:
    prompts = _prompts(bs, rnd)
    before = read_stats(stats_file) if variant == "json" else {}
    t0 = time.perf_counter()
    full = engine.generate(prompt=prompts, sampling_params=_params(variant, max_new_tokens))
    t_full = time.perf_counter() - t0
    after = read_stats(stats_file) if variant == "json" else {}
    t0 = time.perf_counter()
    one = engine.generate(prompt=prompts, sampling_params=_params(variant, 1))
    t_one = time.perf_counter() - t0
    r = round_result(t_full, t_one, full, one, max_new_tokens)
    r["requests"] = bs
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


def _attach_model(rows: List[Dict[str, Any]]) -> None:
    """The calibrated TPOT model's plugin prediction next to each measured cell (default dummy 8B configs only)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import tpot_model
    finally:
        sys.path.pop(0)
    for r in rows:
        if r["shape"] not in tpot_model.DRAFT_NODES or r["json"].get("ms_step") is None:
            continue
        pred = tpot_model.predict(r["bs"], r["shape"]).plugin_ms
        r["model_plugin_ms"] = pred
        r["model_err"] = pred / r["json"]["ms_step"] - 1.0


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--shapes", default="topk1,topk4", help="comma-separated shape names")
    ap.add_argument("--shape", action="append", default=[], help="extra shape: name=steps,topk,tokens")
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,32,64 (cuda) / 1,4 (cpu)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 160 (cuda) / 24 (cpu)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per cell per engine; default 3 (cuda) / 1 (cpu)")
    ap.add_argument("--repeats", type=int, default=1, help="engine pairs (plugin on, off) per shape")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of json,unconstrained,json-off")
    ap.add_argument("--model-path", default=None, help="a real target model (default: the dummy 8B config)")
    ap.add_argument("--draft-model-path", default=None, help="its EAGLE3 draft (with --model-path)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--sampling-backend", default=None)
    ap.add_argument("--mem-fraction-static", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--no-plugin-stats", action="store_true", help="do not write the plugin's per-step stats file")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    args.device = _default_device() if args.device == "auto" else args.device
    gpu = args.device == "cuda"
    args.batch_sizes = parse_ints(args.batch_sizes or ("1,8,32,64" if gpu else "1,4"))
    args.max_new_tokens = args.max_new_tokens or (160 if gpu else 24)
    args.rounds = args.rounds or (3 if gpu else 1)
    args.shape_list = parse_shapes(args.shapes, args.shape)
    args.variant_list = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        ap.error(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    if bool(args.model_path) != bool(args.draft_model_path):
        ap.error("--model-path and --draft-model-path go together")
    if args.model_path and not gpu:
        ap.error("--model-path needs --device cuda (the CPU mode runs the tiny local pair)")
    args.dummy = gpu and not args.model_path
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.dummy:
        t = time.monotonic()
        target, draft = dummy_model_dirs(CONFIGS / "llama-3.1-8b", CONFIGS / "llama-3.1-8b-eagle3")
        args.model_path, args.draft_model_path = str(target), str(draft)
        print(f"dummy model dirs ready in {time.monotonic() - t:.0f} s: {target}, {draft}", flush=True)
    machine = _machine(args.device)
    problems: List[str] = []
    rounds: Dict[Tuple[str, int, str], List[Dict[str, Any]]] = {}
    phases: Dict[Tuple[str, int, str], List[Dict[str, float]]] = {}
    engines: List[Dict[str, Any]] = []  # per engine: was the plugin active (read from its stats file)
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="bench-gpu-constrained-")
    try:
        for shape in args.shape_list:
            for rep in range(args.repeats):
                for kind in ("on", "off"):
                    variants = [v for v in ENGINE_VARIANTS[kind] if v in args.variant_list]
                    if not variants:
                        continue
                    stats = (None if args.no_plugin_stats else
                             os.path.join(tmp, f"stats-{shape.name}-{kind}-{rep}.json"))
                    ts = time.monotonic()
                    engine = start_engine(args, shape, plugin=(kind == "on"), stats_file=stats)
                    print(f"[{time.monotonic() - t0:.0f}s] {shape.name} plugin {kind} #{rep}: engine up in "
                          f"{time.monotonic() - ts:.0f} s", flush=True)
                    try:
                        for v in variants:  # warm-up: grammar compile, first batches at each size
                            measure_round(engine, v, max(args.batch_sizes), -1, min(8, args.max_new_tokens), None)
                        for bs in args.batch_sizes:
                            for rnd in range(args.rounds):
                                for v in variants:
                                    r, ph = measure_round(engine, v, bs, rep * args.rounds + rnd,
                                                          args.max_new_tokens, stats)
                                    rounds.setdefault((shape.name, bs, v), []).append(r)
                                    if ph:
                                        phases.setdefault((shape.name, bs, v), []).append(ph)
                                    if not r["full_batch"]:
                                        problems.append(f"{shape.name} bs{bs} {v}: outputs of {r['tokens_min']}-"
                                                        f"{r['tokens_max']} tokens, not all {args.max_new_tokens}")
                                    print(f"[{time.monotonic() - t0:.0f}s] {shape.name} bs {bs} {v} round {rnd}: "
                                          f"{_f(r['ms_step'])} ms/step, {_f(r['ms_token'])} ms/token, "
                                          f"accept {_f(r['accept_len'])}", flush=True)
                        if stats and (kind == "off" or "json" in variants):  # the file is written per grammar step
                            active = bool(read_stats(stats).get("active"))
                            engines.append({"shape": shape.name, "plugin": kind, "rep": rep, "active": active})
                            if active != (kind == "on"):
                                problems.append(f"{shape.name} plugin {kind} #{rep}: plugin active={active} in "
                                                f"the engine started with {SWITCH_ENV}={int(kind == 'on')}")
                    finally:
                        engine.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cells = {k: summarize_cell(v, phases.get(k, [])) for k, v in rounds.items()}
    rows = table_rows(cells, [s.name for s in args.shape_list], args.batch_sizes)
    if args.dummy:
        _attach_model(rows)
    argv_list = list(argv if argv is not None else sys.argv[1:])
    result = {
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_gpu_constrained.py", *argv_list]),
        "machine": machine,
        "model": ("8B-shaped dummy (benchmarks/configs, load_format=dummy)" if args.dummy else
                  (f"{args.model_path} + {args.draft_model_path}" if args.device == "cuda" else
                   "tiny random pair (CPU runtime)")),
        "shapes": [dataclasses.asdict(s) for s in args.shape_list],
        "batch_sizes": args.batch_sizes,
        "max_new_tokens": args.max_new_tokens,
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_constrained_{args.device}_{machine['sglang']}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(markdown(result))
    plotted = plot(result, out / f"{name}.png")
    print(markdown(result))
    print(f"wrote {out / name}.json, .md{', .png' if plotted else ''} in {result['wall_s']:.0f} s", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
