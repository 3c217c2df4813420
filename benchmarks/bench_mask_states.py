"""Which grammar states make xgrammar's ``fill_next_token_bitmask`` slow on ``BENCH_SCHEMA`` with a 128k vocabulary.

What it measures: engine-free, xgrammar alone. ``BENCH_SCHEMA`` (imported from ``benchmarks/bench_gpu_constrained.py``,
as ``bench_scheduler_budget.py`` does) is compiled as SGLang compiles it with
``constrained_json_disable_any_whitespace=True``: ``GrammarCompiler.compile_json_schema(schema, any_whitespace=False)``
against ``TokenizerInfo.from_huggingface(tokenizer, vocab_size=128256)``, the tokenizer being the dev 128k byte-level
BPE (``sglang_eo_dev.cpu_runtime.models.build_tokenizer(128256)``, Llama-3 sized). A fixed valid instance of the schema
(``log`` of 64+ ``{"t", "m"}`` items, ``m`` strings of every length 1..12) is serialised the way that grammar
requires and tokenised (no special tokens); a ``GrammarMatcher`` walks it token by token (every token must be in the
mask and accepted; the stop token must be allowed and terminate at the end), and ``fill_next_token_bitmask`` is timed
at every position (one bitmask row, CPU):

* ``first``: the first walk of a freshly compiled grammar (a fresh matcher), i.e. the first call at each state;
* ``second``: in that same walk, an immediate second call at the same state (shows any per-state cache);
* ``median``: the median over ``--repeats`` further walks, each with a fresh matcher.

Each position is labelled with its grammar state (e.g. ``log.m string, 4 chars in (8 left)``) and the last 20
characters of text before it. The walk is repeated for schema variants that drop one feature at a time (``m``
maxLength / minLength, ``t`` minimum/maximum, ``tags`` item maxLength, the ``id`` / ``zip`` patterns, ``log``
minItems, ...) to attribute the slow states to a schema feature.

Note on the text: with ``any_whitespace=False`` and no ``separators`` xgrammar's JSON grammar uses ``", "`` and
``": "`` (json.dumps' defaults), so that is how the instance is written; a fully compact ``{"id":...}`` is rejected at
the first ``":"``.

Two more modes measure the plugin's ``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN`` switch (``core/schema.py``: a
string schema bounded only by ``maxLength`` / ``minLength`` compiled as ``^[^\x00-\x1f"\\]{min,max}$``):

* ``--rewrite``: switch off (the schema as sent) against on (the plugin's rewrite, ``rewrite_max_length_strings`` with
  the installed xgrammar's bound from ``settings.MAX_LENGTH_PATTERN_BOUNDS``, or ``--bound`` where none is listed), on
  ``BENCH_SCHEMA`` and on ``benchmarks/schemas.py``'s ``TOOL_CALL_SCHEMA`` and ``EXTRACTION_SCHEMA``, each walked
  over its valid instance as above: compile time, and mean / p99 / max fill ms per position and fills over 5 ms (per
  position: the median of ``--repeats`` walks). The same instances walked by llguidance (the installed one, as
  SGLang's ``--grammar-backend llguidance`` compiles the schema as sent: ``LLMatcher.grammar_from_json_schema`` with
  the same separators, no flexible whitespace; each fill one ``unsafe_compute_mask_ptr`` row, compile = the JSON
  compiler plus the matcher's construction) give the ``llguidance`` rows. Writes
  ``mask_rewrite_<xgrammar version>.{md,json}``.
* ``--bound-sweep``: one object with one string of ``maxLength: N`` against the pattern ``{0,N}``, for each N of
  ``--lengths``, walked over a string of exactly N characters: where the pattern stops being fast (the bound).
  Writes ``mask_bound_<xgrammar version>.{md,json}``.

Run (CPU only, a few minutes; the lock keeps the timings away from engine runs on shared machines)::

    flock /tmp/sglang-engine.lock nice -n 5 .venvs/sglang-0.5.16/bin/python benchmarks/bench_mask_states.py
    flock /tmp/sglang-engine.lock nice -n 5 .venvs/sglang-0.5.23/bin/python benchmarks/bench_mask_states.py
    python benchmarks/bench_mask_states.py --quick            # baseline + two variants, fewer repeats
    flock /tmp/sglang-engine.lock nice -n 5 .venvs/sglang-0.5.23/bin/python benchmarks/bench_mask_states.py --rewrite
    flock /tmp/sglang-engine.lock nice -n 5 .venvs/sglang-0.5.23/bin/python benchmarks/bench_mask_states.py \
        --bound-sweep

Writes ``mask_states_<xgrammar version>.{md,json}`` under ``--out`` (default ``benchmarks/results``). Not a test: no
timing gates anything.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import random
import re
import shlex
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_engine_step import _machine  # noqa: E402  one harness: the machine record of every benchmark
from bench_gpu_constrained import BENCH_SCHEMA  # noqa: E402  the GPU table's schema
VOCAB_SIZE = 128256
SLOW_BINS_MS = (1.0, 5.0, 20.0)
CONTEXT_CHARS = 20

# m strings of every length 1..12 (word-like, so the tokenizer uses multi-character tokens as a model would).
M_POOL: Dict[int, Tuple[str, ...]] = {
    1: ("a", "x", "k"),
    2: ("ok", "go", "up"),
    3: ("ack", "end", "err"),
    4: ("done", "sync", "idle"),
    5: ("retry", "flush", "start"),
    6: ("paused", "closed", "reboot"),
    7: ("timeout", "flushed", "stopped"),
    8: ("rollback", "shutdown", "finished"),
    9: ("reconnect", "cache hit", "user left"),
    10: ("disk full!", "queue idle", "batch done"),
    11: ("user logout", "cache miss7", "job retried"),
    12: ("cache miss 7", "sync started", "all clear ok"),
}


# --- schema and its variants ---------------------------------------------------------------------------------------


def _props(schema: Dict[str, Any], *path: str) -> Dict[str, Any]:
    """The sub-schema at ``path`` (object property names; ``items`` steps into an array's item schema)."""
    node = schema
    for key in path:
        node = node["items"] if key == "items" else node["properties"][key]
    return node


def _drop(*edits: Tuple[Tuple[str, ...], Sequence[str]]) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    def apply(base: Dict[str, Any]) -> Dict[str, Any]:
        schema = copy.deepcopy(base)
        for path, keys in edits:
            node = _props(schema, *path)
            for key in keys:
                if key not in node:
                    raise KeyError(f"{'/'.join(path)} has no {key!r} to drop")
                del node[key]
        return schema
    return apply


def _set(path: Tuple[str, ...], drop: Sequence[str], **values: Any) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    def apply(base: Dict[str, Any]) -> Dict[str, Any]:
        schema = _drop((path, drop))(base) if drop else copy.deepcopy(base)
        _props(schema, *path).update(values)
        return schema
    return apply


M = ("log", "items", "m")
STRINGS_WITH_MAX = (("name",), ("address", "city"), ("tags", "items"), M)

# name -> (what changes, how). Every variant only loosens or re-expresses the schema, so the instance stays valid.
VARIANTS: Dict[str, Tuple[str, Callable[[Dict[str, Any]], Dict[str, Any]]]] = {
    "baseline": ("BENCH_SCHEMA as is", copy.deepcopy),
    "m_no_maxLength": ("log[].m without maxLength 12", _drop((M, ["maxLength"]))),
    "m_no_minLength": ("log[].m without minLength 1", _drop((M, ["minLength"]))),
    "m_no_lengths": ("log[].m without minLength and maxLength", _drop((M, ["minLength", "maxLength"]))),
    "m_maxLength_64": ("log[].m maxLength 64 instead of 12", _set(M, [], maxLength=64)),
    "m_pattern": ("log[].m as pattern ^[^\\x00-\\x1f\"\\\\]{1,12}$ (the README workaround) instead of lengths",
                  _set(M, ["minLength", "maxLength"], pattern='^[^\\x00-\\x1f"\\\\]{1,12}$')),
    "t_no_range": ("log[].t without minimum/maximum", _drop((("log", "items", "t"), ["minimum", "maximum"]))),
    "tags_item_no_maxLength": ("tags[] items without maxLength 16", _drop((("tags", "items"), ["maxLength"]))),
    "no_patterns": ("id and address.zip without pattern", _drop((("id",), ["pattern"]),
                                                                 (("address", "zip"), ["pattern"]))),
    "log_no_minItems": ("log without minItems 64", _drop((("log",), ["minItems"]))),
    "other_strings_no_maxLength": ("name, city, tags[] without maxLength (m keeps its lengths)",
                                   _drop((("name",), ["minLength", "maxLength"]), (("address", "city"), ["maxLength"]),
                                         (("tags", "items"), ["maxLength"]))),
    "no_string_lengths": ("no minLength/maxLength on any string", _drop(
        (("name",), ["minLength", "maxLength"]), (("address", "city"), ["maxLength"]),
        (("tags", "items"), ["maxLength"]), (M, ["minLength", "maxLength"]))),
}
QUICK_VARIANTS = ("baseline", "m_no_maxLength", "t_no_range")


# --- the instance --------------------------------------------------------------------------------------------------


def make_instance(n_items: int = 72, seed: int = 0) -> Dict[str, Any]:
    """A valid BENCH_SCHEMA document: ``n_items`` log items, t in 0..999 (edges included), m of every length 1..12."""
    if n_items < 64:
        raise ValueError("BENCH_SCHEMA's log needs minItems 64")
    rng = random.Random(seed)
    ts = [0, 7, 10, 99, 100, 999] + [rng.randint(0, 999) for _ in range(n_items)]
    lengths = [1 + i % 12 for i in range(n_items)]
    rng.shuffle(lengths)
    log = [{"t": ts[i], "m": rng.choice(M_POOL[lengths[i]])} for i in range(n_items)]
    # name / city / first tag run close to their maxLength (40 / 24 / 16), so their last characters are walked too.
    return {"id": "ABC-1234", "name": "Alexandra Montgomery-Whitfield 3rd Ward",
            "address": {"city": "Port Saint Lucie Harbor", "zip": "12345"},
            "tags": ["maintenance-due", "beta"], "log": log}


def serialise(doc: Dict[str, Any]) -> str:
    """The text the any_whitespace=False grammar admits: xgrammar's default separators ``", "`` / ``": "``."""
    return json.dumps(doc, separators=(", ", ": "), ensure_ascii=False)


_STRING_FIELD = re.compile(r'"(id|name|city|zip|m)": "([^"\\]*)$')
_TAG_ITEM = re.compile(r'"tags": \[(?:"[^"\\]*", )*"([^"\\]*)$')
_INT_FIELD = re.compile(r'"(t)": (\d*)$')
_MAX_LENGTH = {"name": 40, "city": 24, "m": 12, "tags": 16}


def state_at(prefix: str) -> Tuple[str, Optional[int]]:
    """The grammar state after the text ``prefix`` of the instance (string/number field and how far into it), and the
    characters a maxLength string (BENCH_SCHEMA's limits) may still take there (None outside one)."""
    found = _STRING_FIELD.search(prefix)
    if found:
        key, chars = found.group(1), len(found.group(2))
        field = {"m": "log.m", "city": "address.city", "zip": "address.zip"}.get(key, key)
        left = _MAX_LENGTH[key] - chars if key in _MAX_LENGTH else None
        return f"{field} string, {chars} chars in" + ("" if left is None else f" ({left} left)"), left
    found = _TAG_ITEM.search(prefix)
    if found:
        chars = len(found.group(1))
        left = _MAX_LENGTH["tags"] - chars
        return f"tags item string, {chars} chars in ({left} left)", left
    found = _INT_FIELD.search(prefix)
    if found:
        return f"log.t integer, {len(found.group(2))} digits in", None
    return "structure (keys, separators, brackets)", None


# --- timing --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Walk:
    first_ms: List[float]
    second_ms: List[float]


def walk(xgr: Any, compiled: Any, ids: Sequence[int], stop_id: int, vocab_size: int, same_state_repeat: bool,
         check: bool) -> Walk:
    """One fresh matcher over ``ids``: fill (timed) then accept, at every position, plus the final (stop) position."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    first: List[float] = []
    second: List[float] = []
    clock = time.perf_counter_ns
    for i, token in enumerate(list(ids) + [stop_id]):
        t0 = clock()
        matcher.fill_next_token_bitmask(bitmask)
        t1 = clock()
        first.append((t1 - t0) / 1e6)
        if same_state_repeat:
            t0 = clock()
            matcher.fill_next_token_bitmask(bitmask)
            second.append((clock() - t0) / 1e6)
        if check and not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            raise AssertionError(f"position {i}: token {token} is not in the mask")
        if not matcher.accept_token(token):
            raise AssertionError(f"position {i}: token {token} rejected")
    if check and not matcher.is_terminated():
        raise AssertionError("the matcher did not terminate after the stop token")
    return Walk(first, second)


def summarize(ms: Sequence[float], n_output_tokens: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {f"n_gt_{b:g}ms": sum(1 for x in ms if x > b) for b in SLOW_BINS_MS}
    ranked = sorted(ms)
    out.update({
        "total_ms": round(sum(ms), 3),
        "ms_per_token": round(sum(ms) / n_output_tokens, 4),
        "median_ms": round(statistics.median(ms), 4),
        "p99_ms": round(ranked[max(0, -(-99 * len(ranked) // 100) - 1)], 4),
        "max_ms": round(max(ms), 3),
    })
    return out


def vocab_lengths(decoded_vocab: Sequence[bytes], special_ids: Sequence[int]) -> Dict[str, Any]:
    """Token lengths in characters (what maxLength counts; a partial UTF-8 sequence counts one per byte): how many
    string-safe tokens (not special; no quote, backslash, CR, LF) are longer than N characters, N = 0..16."""
    special = set(special_ids)
    safe = [t.decode("utf-8", errors="replace") for i, t in enumerate(decoded_vocab)
            if t and i not in special and not any(c in t for c in b'"\\\r\n')]
    chars = [len(t) for t in safe]
    return {
        "max_bytes_any": max(len(t) for t in decoded_vocab),
        "max_chars_string_safe": max(chars),
        "string_safe_longer_than": {n: sum(1 for x in chars if x > n) for n in range(17)},
    }


def run_variant(xgr: Any, info: Any, schema: Dict[str, Any], ids: Sequence[int], stop_id: int, repeats: int
                ) -> Dict[str, Any]:
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    cold = walk(xgr, compiled, ids, stop_id, info.vocab_size, same_state_repeat=True, check=True)
    reps = [walk(xgr, compiled, ids, stop_id, info.vocab_size, same_state_repeat=False, check=False).first_ms
            for _ in range(repeats)]
    median = [statistics.median(col) for col in zip(*reps)] if reps else list(cold.first_ms)
    n_out = len(ids) + 1
    return {
        "compile_s": round(compile_s, 3),
        "first_ms": [round(x, 4) for x in cold.first_ms],
        "second_ms": [round(x, 4) for x in cold.second_ms],
        "median_ms": [round(x, 4) for x in median],
        "summary": {"first": summarize(cold.first_ms, n_out), "second": summarize(cold.second_ms, n_out),
                    "median": summarize(median, n_out)},
        "wall_s": round(time.perf_counter() - t0, 2),
    }


# --- report --------------------------------------------------------------------------------------------------------


def by_state(labels: Sequence[str], ms: Sequence[float]) -> List[Dict[str, Any]]:
    groups: Dict[str, List[float]] = {}
    for label, x in zip(labels, ms):
        groups.setdefault(label, []).append(x)
    rows = [{"state": k, "n": len(v), "median_ms": round(statistics.median(v), 3), "max_ms": round(max(v), 3),
             "total_ms": round(sum(v), 2)} for k, v in groups.items()]
    return sorted(rows, key=lambda r: -r["median_ms"])


def _fmt(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def write_md(result: Dict[str, Any], path: Path, top: int) -> None:
    meta, pos, variants = result["meta"], result["positions"], result["variants"]
    lines = [
        f"# fill_next_token_bitmask per grammar state: BENCH_SCHEMA, {meta['vocab_size']}-token vocabulary, "
        f"xgrammar {meta['xgrammar']}",
        "",
        f"`{meta['command']}`  ",
        f"Machine: {meta['machine']['cpus']} CPUs ({meta['machine']['machine']}), python {meta['machine']['python']}, "
        f"sglang {meta['sglang']}, transformers {meta['transformers']}. Tokenizer: {meta['tokenizer']}.  ",
        f"Instance: {meta['n_log_items']} log items, {meta['n_tokens']} tokens + the stop position = "
        f"{meta['n_tokens'] + 1} mask fills per walk; `first` = first walk (first call per state), `second` = an "
        f"immediate second call at the same state, `median` = median of {meta['repeats']} further walks (fresh "
        "matcher each). One bitmask row, CPU, one thread. ms per token = total fill time of a walk / positions.",
        "",
        "## Variants",
        "",
        "| variant | change | compile s | ms/token first | ms/token median | >1 ms | >5 ms | >20 ms | max ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in variants.items():
        s, f = v["summary"]["median"], v["summary"]["first"]
        lines.append(f"| {name} | {v['description']} | {v['compile_s']:.2f} | {f['ms_per_token']:.3f} | "
                     f"{s['ms_per_token']:.3f} | {s['n_gt_1ms']} | {s['n_gt_5ms']} | {s['n_gt_20ms']} | "
                     f"{_fmt(s['max_ms'])} |")
    lines += ["", "Counts (>1/>5/>20 ms) and max use the per-position median.", ""]
    base = variants.get("baseline")
    if base:
        labels = [p["state"] for p in pos]
        lines += ["## Baseline: slowest positions", "",
                  "| pos | state | last chars before it | next token | first ms | second ms | median ms |",
                  "|---:|---|---|---|---:|---:|---:|"]
        order = sorted(range(len(pos)), key=lambda i: -base["median_ms"][i])[:top]
        for i in order:
            p = pos[i]
            lines.append(f"| {i} | {p['state']} | `{p['context']}` | `{p['token']}` | {_fmt(base['first_ms'][i])} | "
                         f"{_fmt(base['second_ms'][i])} | {_fmt(base['median_ms'][i])} |")
        lines += ["", "## Characters left in a maxLength string (name, address.city, tags[], log[].m) -> median ms",
                  "", "Columns: characters the string may still take before the fill; cells: median over those "
                  "positions of the per-position median (positions).", "",
                  "| variant | strings | " + " | ".join(f"{n} left" for n in range(13)) + " | >12 left |",
                  "|---|---|" + "---:|" * 14]
        groups: Tuple[Tuple[str, Callable[[str], bool]], ...] = (
            ("log[].m", lambda st: st.startswith("log.m")), ("name/city/tags[]", lambda st: not st.startswith("log.m")))
        for name, v in variants.items():
            for group, member in groups:
                cells = []
                for lo, hi in [(n, n) for n in range(13)] + [(13, 10 ** 6)]:
                    xs = [v["median_ms"][i] for i, p in enumerate(pos)
                          if p["left"] is not None and lo <= p["left"] <= hi and member(p["state"])]
                    cells.append(f"{_fmt(statistics.median(xs))} ({len(xs)})" if xs else "")
                lines.append(f"| {name} | {group} | " + " | ".join(cells) + " |")
        lines += ["", "(`left` is computed from BENCH_SCHEMA's limits; in a variant without that limit the same "
                  "positions are just string positions.)"]
        lines += ["", "## Baseline: per state (median over the positions in that state)", "",
                  "| state | positions | median ms | max ms | total ms |", "|---|---:|---:|---:|---:|"]
        for row in by_state(labels, base["median_ms"]):
            lines.append(f"| {row['state']} | {row['n']} | {_fmt(row['median_ms'])} | {_fmt(row['max_ms'])} | "
                         f"{_fmt(row['total_ms'])} |")
        vl = result["vocab_token_lengths"]
        lines += ["", f"Vocabulary: longest token {vl['max_bytes_any']} bytes; longest non-special token without "
                  f"`\"`, `\\`, CR, LF (one that could sit inside a string) {vl['max_chars_string_safe']} characters. "
                  "Such tokens longer than N characters: "
                  + ", ".join(f"N={n}: {c}" for n, c in vl["string_safe_longer_than"].items()) + "."]
    path.write_text("\n".join(lines) + "\n")


# --- the maxLength-pattern switch ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """One schema of the ``--rewrite`` comparison and the valid instance walked over it."""

    name: str
    what: str
    schema: Dict[str, Any]
    instance: Dict[str, Any]


def rewrite_shapes(items: int, seed: int) -> List[Shape]:
    from benchmarks.schemas import EXTRACTION_INSTANCE, EXTRACTION_SCHEMA, TOOL_CALL_INSTANCE, TOOL_CALL_SCHEMA

    return [
        Shape("bench_schema", "BENCH_SCHEMA (the GPU table's schema): 4 maxLength strings, 2 patterns",
              BENCH_SCHEMA, make_instance(items, seed)),
        Shape("tool_call", "TOOL_CALL_SCHEMA: a function call, 4 maxLength strings (one of 400, over the bound), a "
              "const name, a date-time format", TOOL_CALL_SCHEMA, TOOL_CALL_INSTANCE),
        Shape("extraction", "EXTRACTION_SCHEMA: invoice fields, 8 maxLength strings (several filled close to the "
              "bound), an enum", EXTRACTION_SCHEMA, EXTRACTION_INSTANCE),
    ]


def tokenize_checked(tokenizer: Any, text: str) -> List[int]:
    ids: List[int] = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(ids) != text:
        raise AssertionError("tokenizer round trip changed the text")
    return ids


def run_rewrite(xgr: Any, info: Any, tokenizer: Any, stop_id: int, bound: int, repeats: int, items: int,
                seed: int, guidance: Optional[Tuple[Any, Any]] = None) -> Dict[str, Any]:
    """Each shape compiled as sent (switch off) and as the plugin rewrites it (switch on), walked over its instance;
    with ``guidance`` (the llguidance module and its tokenizer), also by llguidance as sent."""
    import jsonschema

    from sglang_eagle_overlap.core.schema import rewrite_max_length_strings

    out: Dict[str, Any] = {}
    for shape in rewrite_shapes(items, seed):
        jsonschema.validate(shape.instance, shape.schema)
        ids = tokenize_checked(tokenizer, serialise(shape.instance))
        rewrite = rewrite_max_length_strings(shape.schema, bound)
        row: Dict[str, Any] = {"what": shape.what, "n_tokens": len(ids),
                               "rewritten": [dataclasses.asdict(r) for r in rewrite.rewritten],
                               "left_alone": [dataclasses.asdict(a) for a in rewrite.left_alone],
                               "schema_on": rewrite.schema}
        for switch, schema in (("off", shape.schema), ("on", rewrite.schema), ("llguidance", shape.schema)):
            if switch == "llguidance":
                if guidance is None:
                    continue
                r = run_guidance(guidance[0], guidance[1], schema, ids, stop_id, (info.vocab_size + 31) // 32,
                                 repeats)
            else:
                r = run_variant(xgr, info, schema, ids, stop_id, repeats)
            row[switch] = {"compile_s": r["compile_s"], "summary": r["summary"], "median_ms": r["median_ms"],
                           "wall_s": r["wall_s"]}
            m = r["summary"]["median"]
            print(f"{shape.name:13s} switch {switch:3s} compile {r['compile_s']:6.2f}s  mean {m['ms_per_token']:8.4f}"
                  f"  p99 {m['p99_ms']:8.3f}  max {m['max_ms']:7.2f}  >5 ms {m['n_gt_5ms']}  ({r['wall_s']:.1f}s)",
                  flush=True)
        out[shape.name] = row
    return out


def guidance_walk(llg: Any, ll_tokenizer: Any, grammar: str, ids: Sequence[int], stop_id: int, width: int,
                  check: bool) -> List[float]:
    """One fresh llguidance matcher over ``ids``: fill (timed) then consume, at every position, plus the stop."""
    import numpy as np

    matcher = llg.LLMatcher(ll_tokenizer, grammar)
    if matcher.is_error():
        raise AssertionError(f"llguidance refused the grammar: {matcher.get_error()}")
    row = np.full(width, -1, dtype=np.int32)
    ptr, size = row.ctypes.data, width * 4
    out: List[float] = []
    clock = time.perf_counter_ns
    for i, token in enumerate(list(ids) + [stop_id]):
        t0 = clock()
        matcher.unsafe_compute_mask_ptr(ptr, size)
        out.append((clock() - t0) / 1e6)
        if check and not (int(row[token // 32]) >> (token % 32)) & 1:
            raise AssertionError(f"llguidance, position {i}: token {token} is not in the mask")
        if not matcher.consume_token(token):
            raise AssertionError(f"llguidance, position {i}: token {token} rejected: {matcher.get_error()}")
    if check and not matcher.is_stopped():
        raise AssertionError("the llguidance matcher did not stop after the stop token")
    return out


def run_guidance(llg: Any, ll_tokenizer: Any, schema: Dict[str, Any], ids: Sequence[int], stop_id: int,
                 width: int, repeats: int) -> Dict[str, Any]:
    """:func:`run_variant` for llguidance: compile (JSON compiler + matcher), a checked walk, ``repeats`` timed."""
    t0 = time.perf_counter()
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    llg.LLMatcher(ll_tokenizer, grammar)
    compile_s = time.perf_counter() - t0
    cold = guidance_walk(llg, ll_tokenizer, grammar, ids, stop_id, width, check=True)
    reps = [guidance_walk(llg, ll_tokenizer, grammar, ids, stop_id, width, check=False) for _ in range(repeats)]
    median = [statistics.median(col) for col in zip(*reps)] if reps else list(cold)
    n_out = len(ids) + 1
    return {"compile_s": round(compile_s, 4), "summary": {"median": summarize(median, n_out)},
            "median_ms": [round(x, 4) for x in median], "wall_s": round(time.perf_counter() - t0, 2)}


def _run_lines(meta: Dict[str, Any]) -> List[str]:
    """The command and machine lines that open a result file of ``--rewrite`` and ``--bound-sweep``."""
    m = meta["machine"]
    return [f"`{meta['command']}`  ",
            f"Machine: {m['cpus']} CPUs ({m['machine']}, shared with other work), python {m['python']}, sglang "
            f"{meta['sglang']}. Tokenizer: {meta['tokenizer']}. Started {meta['started']}.  "]


def write_rewrite_md(result: Dict[str, Any], path: Path) -> None:
    meta = result["meta"]
    lines = [
        f"# maxLength strings as patterns (SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN): mask cost, xgrammar "
        f"{meta['xgrammar']}" + (f" and llguidance {meta['llguidance']}" if meta.get("llguidance") else "")
        + f", {meta['vocab_size']}-token vocabulary",
        "",
        *_run_lines(meta),
        f"Bound: maxLength <= {meta['bound']} rewritten ({meta['bound_source']}).  ",
        "Per shape, a valid instance is tokenised and walked by a fresh matcher (every token must be in the mask); "
        f"each position's fill is the median of {meta['repeats']} walks after a first one. mean = total fill time / "
        "positions (ms per output token); p99 and max over positions; compile = `compile_json_schema` once, cache "
        "off. One bitmask row, CPU, one thread. Switch off / on: xgrammar with the schema as sent / as the plugin "
        "rewrites it; llguidance: the schema as sent, compiled by llguidance (no rewrite applies to it).",
        "",
        "| shape | positions | switch | compile s | mean ms/token | p99 ms | max ms | fills > 5 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in result["shapes"].items():
        for switch in ("off", "on", "llguidance"):
            if switch not in row:
                continue
            m = row[switch]["summary"]["median"]
            lines.append(f"| {name} | {row['n_tokens'] + 1} | {switch} | {row[switch]['compile_s']:.2f} | "
                         f"{m['ms_per_token']:.4f} | {m['p99_ms']:.3f} | {m['max_ms']:.2f} | {m['n_gt_5ms']} |")
    lines += ["", "## What the rewrite did", ""]
    for name, row in result["shapes"].items():
        done = ", ".join(f"`{r['pointer']}` ({r['min_length']}..{r['max_length']})" for r in row["rewritten"])
        left = ", ".join(f"`{a['pointer']}` ({a['reason']})" for a in row["left_alone"]) or "none"
        lines.append(f"- **{name}** ({row['what']}): rewritten {done or 'nothing'}; maxLength strings left alone: "
                     f"{left}.")
    path.write_text("\n".join(lines) + "\n")


def sweep_text(n: int) -> str:
    """A string of exactly ``n`` characters of words (so the tokenizer uses multi-character tokens)."""
    words = "the quick brown fox jumps over a lazy dog while seven cats watch from distant hills and".split()
    out = ""
    i = 0
    while len(out) < n:
        out += words[i % len(words)] + " "
        i += 1
    return out[:n]


def run_bound_sweep(xgr: Any, info: Any, tokenizer: Any, stop_id: int, lengths: Sequence[int], repeats: int
                    ) -> Dict[str, Any]:
    """For each N: ``{"a": maxLength N}`` against ``{"a": pattern {0,N}}``, walked over a string of N characters."""
    from sglang_eagle_overlap.core.schema import control_free_pattern

    out: Dict[str, Any] = {}
    for n in lengths:
        ids = tokenize_checked(tokenizer, serialise({"a": sweep_text(n)}))
        row: Dict[str, Any] = {"n_tokens": len(ids)}
        for form, string in (("maxLength", {"type": "string", "maxLength": n}),
                             ("pattern", {"type": "string", "pattern": control_free_pattern(0, n)})):
            schema = {"type": "object", "properties": {"a": string}, "required": ["a"], "additionalProperties": False}
            r = run_variant(xgr, info, schema, ids, stop_id, repeats)
            row[form] = {"compile_s": r["compile_s"], "summary": r["summary"]["median"], "wall_s": r["wall_s"]}
            m = r["summary"]["median"]
            print(f"N={n:4d} {form:9s} compile {r['compile_s']:6.2f}s  mean {m['ms_per_token']:8.4f}  "
                  f"max {m['max_ms']:7.2f}  >5 ms {m['n_gt_5ms']}  ({r['wall_s']:.1f}s)", flush=True)
        out[str(n)] = row
    return out


def write_bound_md(result: Dict[str, Any], path: Path) -> None:
    meta = result["meta"]
    lines = [
        f"# maxLength N against the pattern {{0,N}}: compile and fill cost by N, xgrammar {meta['xgrammar']}, "
        f"{meta['vocab_size']}-token vocabulary",
        "",
        *_run_lines(meta),
        "Schema: one object with one string `a`, either `maxLength: N` or `pattern: ^[^\\x00-\\x1f\"\\\\]{0,N}$`; "
        "walked over a string of exactly N characters (the last positions are the slow ones for maxLength). Each "
        f"position's fill is the median of {meta['repeats']} walks after a first one.",
        "",
        "| N | positions | form | compile s | mean ms/token | max ms | fills > 5 ms |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for n, row in result["lengths"].items():
        for form in ("maxLength", "pattern"):
            m = row[form]["summary"]
            lines.append(f"| {n} | {row['n_tokens'] + 1} | {form} | {row[form]['compile_s']:.2f} | "
                         f"{m['ms_per_token']:.4f} | {m['max_ms']:.2f} | {m['n_gt_5ms']} |")
    path.write_text("\n".join(lines) + "\n")


def switch_main(args: argparse.Namespace, xgr: Any, info: Any, tokenizer: Any, stop_id: int) -> int:
    """``--rewrite`` / ``--bound-sweep``: run, then write the md and json of that mode."""
    from sglang_eagle_overlap.settings import MAX_LENGTH_PATTERN_BOUNDS

    xgr_version = version("xgrammar")
    listed = MAX_LENGTH_PATTERN_BOUNDS.get(xgr_version)
    bound = args.bound if args.bound is not None else (listed if listed is not None else 128)
    source = (f"--bound {args.bound}" if args.bound is not None else
              f"settings.MAX_LENGTH_PATTERN_BOUNDS for xgrammar {xgr_version}: the plugin rewrites here"
              if listed is not None else
              f"xgrammar {xgr_version} has no entry in settings.MAX_LENGTH_PATTERN_BOUNDS, so the plugin does NOT "
              "rewrite here; measured with 128 to show what the rewrite would give")
    meta: Dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT),
                                                      "benchmarks/bench_mask_states.py", *sys.argv[1:]]),
        "xgrammar": xgr_version, "sglang": version("sglang"), "machine": _machine(),
        "tokenizer": f"sglang_eo_dev build_tokenizer({VOCAB_SIZE}) (byte-level BPE)", "vocab_size": VOCAB_SIZE,
        "any_whitespace": False, "repeats": args.repeats, "bound": bound, "bound_source": source,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        if args.rewrite:
            guidance = None
            try:
                import llguidance
                import llguidance.hf
            except ImportError:
                print("llguidance is not installed: no llguidance rows", flush=True)
            else:
                meta["llguidance"] = version("llguidance")
                guidance = (llguidance, llguidance.hf.from_tokenizer(tokenizer, VOCAB_SIZE, eos_token=stop_id))
            result = {"meta": meta, "shapes": run_rewrite(xgr, info, tokenizer, stop_id, bound, args.repeats,
                                                          args.items, args.seed, guidance)}
            stem = out / f"mask_rewrite_{xgr_version}"
            write_rewrite_md(result, Path(f"{stem}.md"))
        else:
            lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
            result = {"meta": meta, "lengths": run_bound_sweep(xgr, info, tokenizer, stop_id, lengths,
                                                               args.repeats)}
            stem = out / f"mask_bound_{xgr_version}"
            write_bound_md(result, Path(f"{stem}.md"))
    finally:
        if gc_was:
            gc.enable()
    result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(f"{stem}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
    print(f"wrote {stem}.md and .json")
    return 0


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--items", type=int, default=72, help="log items in the instance (>= 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed walks after the first, per variant (median)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list, from: " + ", ".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help=f"variants {', '.join(QUICK_VARIANTS)}, 1 repeat")
    ap.add_argument("--top", type=int, default=30, help="slowest baseline positions listed in the md")
    ap.add_argument("--seed", type=int, default=0)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--rewrite", action="store_true",
                      help="the maxLength-pattern switch off vs on, on three schema shapes (mask_rewrite_*)")
    mode.add_argument("--bound-sweep", action="store_true",
                      help="maxLength N vs the pattern {0,N} for each N of --lengths (mask_bound_*)")
    ap.add_argument("--bound", type=int, default=None,
                    help="--rewrite: the largest maxLength rewritten (default: the installed xgrammar's bound)")
    ap.add_argument("--lengths", default="12,32,64,96,128,129,256", help="--bound-sweep: the Ns, comma list")
    args = ap.parse_args(argv)
    names = list(QUICK_VARIANTS) if args.quick else [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}")
    repeats = 1 if args.quick else args.repeats

    sys.path.insert(0, str(ROOT / "dev"))  # the dev tokenizer builder; main only, not on import
    import transformers
    import xgrammar as xgr
    from sglang_eo_dev.cpu_runtime.models import build_tokenizer

    tok_dir = build_tokenizer(VOCAB_SIZE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE)
    stop_ids = list(info.stop_token_ids)
    if not stop_ids:
        raise RuntimeError("the tokenizer has no stop token")
    if args.rewrite or args.bound_sweep:
        sys.path.insert(0, str(ROOT))  # the plugin's package of this checkout (the rewrite and its bounds)
        return switch_main(args, xgr, info, tokenizer, stop_ids[0])
    schema = BENCH_SCHEMA
    doc = make_instance(args.items, args.seed)
    text = serialise(doc)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(ids) != text:
        raise AssertionError("tokenizer round trip changed the text")
    prefixes: List[str] = [str(tokenizer.decode(ids[:i])) for i in range(len(ids) + 1)]
    positions = [{"state": state, "left": left, "context": p[-CONTEXT_CHARS:].replace("|", "\\|"),
                  "token": (str(tokenizer.decode([t])) if i < len(ids) else "<stop>").replace("|", "\\|")}
                  for i, (p, t) in enumerate(zip(prefixes, list(ids) + [stop_ids[0]]))
                  for state, left in [state_at(p)]]

    result: Dict[str, Any] = {
        "meta": {
            "what": "xgrammar fill_next_token_bitmask time per position of a BENCH_SCHEMA instance",
            "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT),
                                                          "benchmarks/bench_mask_states.py", *sys.argv[1:]]),
            "xgrammar": version("xgrammar"), "sglang": version("sglang"), "transformers": version("transformers"),
            "machine": _machine(),
            "tokenizer": f"sglang_eo_dev build_tokenizer({VOCAB_SIZE}) (byte-level BPE)",
            "vocab_size": VOCAB_SIZE, "any_whitespace": False, "schema": schema, "n_log_items": args.items,
            "text": text, "n_tokens": len(ids), "token_ids": ids, "stop_token_id": stop_ids[0], "repeats": repeats,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "vocab_token_lengths": vocab_lengths(list(info.decoded_vocab),
                                             sorted({*info.special_token_ids, *tokenizer.all_special_ids, *stop_ids})),
        "positions": positions,
        "variants": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"mask_states_{version('xgrammar')}"
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for name in names:
            description, make = VARIANTS[name]
            variant_schema = make(schema)
            r = run_variant(xgr, info, variant_schema, ids, stop_ids[0], repeats)
            result["variants"][name] = {"description": description, "schema": variant_schema, **r}
            s = r["summary"]
            print(f"{name:28s} compile {r['compile_s']:5.2f}s  ms/token first {s['first']['ms_per_token']:7.3f} "
                  f"median {s['median']['ms_per_token']:7.3f}  >1/>5/>20 ms {s['median']['n_gt_1ms']}/"
                  f"{s['median']['n_gt_5ms']}/{s['median']['n_gt_20ms']}  max {s['median']['max_ms']:.1f} ms  "
                  f"({r['wall_s']:.1f}s)", flush=True)
            result["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
            Path(f"{stem}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")  # compact: ~0.3 MB
            write_md(result, Path(f"{stem}.md"), args.top)
    finally:
        if gc_was:
            gc.enable()
    print(f"wrote {stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
