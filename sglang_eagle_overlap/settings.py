"""The plugin's switches, read once per process from the environment into one immutable :class:`Settings`.

Every switch is parsed here and nowhere else; a malformed value is an error that names the variable, the value and
what is expected (the plugin then refuses to load, loudly), never a silent default.

The switches, what each does and its default are :data:`SWITCH_DOCS` below, in :data:`ENV`'s order;
``python -m sglang_eagle_overlap.settings --markdown`` prints them as the table that README.md and
docs/configuration.md carry (``tests/test_config_table.py`` keeps those copies equal to it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Type, Union

__all__ = ["DEFAULT_FORCED_BONUS_KEYS", "DEFAULT_FORCED_DRAFTS", "DEFAULT_FORCED_TAIL", "DEFAULT_GRAMMAR_THREAD",
           "DEFAULT_GRAMMAR_THREAD_MIN_BATCH", "DEFAULT_LOG_INTERVAL_S", "DEFAULT_MASK_TIME_LIMIT_MS",
           "DEFAULT_MASK_UPLOAD_STREAM", "DEFAULT_MAX_LENGTH_PATTERN", "ENV", "FORCED_DRAFTS_AUTO_ALGORITHMS",
           "MAX_LENGTH_PATTERN_BOUNDS", "SWITCH_DOCS", "Settings", "SettingsError", "SwitchDoc", "default_mask_threads",
           "markdown_table"]

ENV = {
    "enabled": "SGLANG_EAGLE_OVERLAP",
    "mask_threads": "SGLANG_EAGLE_OVERLAP_MASK_THREADS",
    "mask_time_limit_ms": "SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS",
    "stats_file": "SGLANG_EAGLE_OVERLAP_STATS_FILE",
    "log_interval_s": "SGLANG_EAGLE_OVERLAP_LOG_INTERVAL_S",
    "timeline_file": "SGLANG_EAGLE_OVERLAP_TIMELINE_FILE",
    "grammar_thread": "SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD",
    "grammar_thread_min_batch": "SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD_MIN_BATCH",
    "mask_upload_stream": "SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM",
    "forced_drafts": "SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS",
    "forced_bonus_keys": "SGLANG_EAGLE_OVERLAP_FORCED_BONUS_KEYS",
    "forced_tail": "SGLANG_EAGLE_OVERLAP_FORCED_TAIL",
    "native": "SGLANG_EAGLE_OVERLAP_NATIVE",
    "max_length_pattern": "SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN",
}
# Grammar-forced drafts: ``None`` is "auto", on for every algorithm whose trees the plugin's verify step owns (EAGLE,
# EAGLE3 -- NEXTN resolves to EAGLE -- and STANDALONE; NGRAM's grammar batches are SGLang's own). Measured on the real
# pair (benchmarks/bench_real_pair.py, docs/benchmarks.md, CPU, 2026-11-29): with a chat-trained EAGLE3 draft -- the
# kind users have -- forced drafts (keyed by the bonus token, the tail drafted) need 21.6 % (topk 1) / 16.9 % (topk 4)
# fewer verify steps per output token on JSON-schema prompts, 29.7 % / 24.6 % on tool-call arguments; the untrained
# STANDALONE draft 20.8 % (topk 1); with a draft trained on the target's JSON answers the replaced tokens are mostly its
# own guess (-0.3 % / +0.4 %). The host side (each filled node's forced text asked in the native walk on the grammar
# thread, tokenized on the scheduler thread) added 0.5-0.7 ms of scheduler-thread time per step (bs 12, a noisy run).
FORCED_DRAFTS_AUTO_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "STANDALONE"})
DEFAULT_FORCED_DRAFTS: Optional[bool] = None
DEFAULT_FORCED_BONUS_KEYS = 3
DEFAULT_FORCED_TAIL = True
# The grammar thread is on unless switched off: it keeps the grammar's native work off SGLang's scheduler thread. It
# takes only the step's one native call (the previous batch's runs fed and the tree walked, GIL-free, started before the
# verify launch); the scheduler thread keeps the Python (the ledger's checks before the launch, the records after the
# join). Measured on the project's CPU host against the baseline (the all-inline code before the grammar thread; its
# revision is recorded in each result file): the scheduler thread's extra time per constrained step at bs 64 is
# 0.31-0.39x of the baseline's (benchmarks/results/scheduler_budget_<v>_thread_vs_baseline.md, 2026-11-28); in one run
# with both paths it was 0.36-0.43x on the thread against 0.53-0.66x inline
# (benchmarks/results/scheduler_budget_<v>_inline_thread_vs_baseline.md). The thread design the H200 measured slower
# than inline (docs/benchmarks.md: +4.4-24.5 % against +0.2-3.7 % over unconstrained) ran the barrier's and the walk's
# Python on the helper, which then waited for the GIL after each native call (benchmarks/bench_gil_convoy.py); this one
# crosses into Python twice per step. On the H200 (2026-11-26, docs/benchmarks.md, one run with the inline path in its
# own engine) it was +1.7 % to +4.0 % over unconstrained at the median step at bs 8-64, as inline was (+1.5 % to
# +8.9 %), and worse than inline at bs 1: +9.3 % / +20.3 % (topk 1 / topk 4) against +4.1 % / +3.6 %.
DEFAULT_GRAMMAR_THREAD = True
# Hence the smallest verify batch (grammar requests) whose native call goes to the grammar thread: a batch of one runs
# inline. At bs 1 the call is ~0.1-0.3 ms of GIL-free work and hides under the GPU's step either way, while the thread
# path costs 0.35-1.2 ms more there (the H200 did not separate its causes: the work it runs before the verify launch,
# exposed when the draft is short, or the hand-off's GIL round trips). Chosen from that one run (one round per cell);
# bs 2-8 was not separated from noise there.
DEFAULT_GRAMMAR_THREAD_MIN_BATCH = 2
# The tree mask's upload on a side stream (2026-11-27). On the verify's stream the copy waits for the
# target verify launched there and the sampling waits for the copy: serial GPU work after the verify, the kind the step
# model names for the H200's residual (+0.6 % to +3.1 % over unconstrained, docs/benchmarks.md). The mask is
# 4-8 MB at bs 64 (bs x tree nodes rows of 128k-vocab bitmasks). Measured on an H200 (2026-11-27, EAGLE3 topk 4,
# benchmarks/results/gpu_constrained_cuda_0.5.16_h200_table_upload.md against ..._upload0_topk4.md): better than the
# upload on the verify's stream at every batch size, by 0.2 (bs 8) to 2.1 (bs 64) points of the step over
# unconstrained, one round per cell. Nothing changes on the CPU, where there is no upload.
DEFAULT_MASK_UPLOAD_STREAM = True
# JSON-schema strings with ``maxLength`` compiled as control-character-free patterns (``core/schema.py``), per xgrammar
# version: the largest ``maxLength`` rewritten. Only measured versions are listed; any other compiles schemas as sent.
# xgrammar 0.2.7 (SGLang 0.5.23), 128k vocabulary (benchmarks/bench_mask_states.py --bound-sweep, 2026-11-28,
# benchmarks/results/mask_bound_0.2.7.md): the pattern ``{0,N}`` fills in <= 0.016 ms per token up to N = 128 and
# compiles faster than ``maxLength: N``; from N = 129 on xgrammar compiles it another way and each fill takes
# 100-200 ms. xgrammar 0.2.1 (SGLang 0.5.16) is not listed: there the pattern fills as slowly as ``maxLength``
# (mask_bound_0.2.1.md, mask_rewrite_0.2.1.md), so there it would change tokens without a faster fill.
MAX_LENGTH_PATTERN_BOUNDS: Mapping[str, int] = {"0.2.7": 128}
# On where a bound is listed: on BENCH_SCHEMA the mask cost per output token drops from 5.49 ms to 0.009 ms on xgrammar
# 0.2.7, no fill over 5 ms instead of 182, compile 3.9 s instead of 4.5 s (bench_mask_states.py --rewrite,
# benchmarks/results/mask_rewrite_0.2.7.md, docs/benchmarks.md); and the only tokens that can differ from the schema
# as sent are raw control characters inside such strings, which make the output invalid JSON.
DEFAULT_MAX_LENGTH_PATTERN = True
# The mask time limit and the summary line's interval: the values ``Settings.from_env`` takes when a switch is unset.
DEFAULT_MASK_TIME_LIMIT_MS = 50.0
DEFAULT_LOG_INTERVAL_S = 30.0


@dataclass(frozen=True, slots=True)
class SwitchDoc:
    """What one switch of :data:`ENV` does and its default, as a user reads them (markdown inline text)."""

    meaning: str
    default: str


def _on_off(value: bool) -> str:
    return "`1`" if value else "`0`"


# One entry per ENV key: the configuration table of README.md and docs/configuration.md is rendered from this by
# markdown_table(); a switch added to ENV without an entry here makes markdown_table() raise, so the docs cannot miss
# it. Defaults that are constants of this module are read from them, so the table cannot drift from the parser.
SWITCH_DOCS: Mapping[str, SwitchDoc] = {
    "enabled": SwitchDoc(
        "`0` / `false` / `no` / `off` turns the plugin off without uninstalling it (its hooks and a patched SGLang's "
        "call sites alike); SGLang then runs its own grammar path", "on"),
    "mask_threads": SwitchDoc(
        "threads for the tree mask's xgrammar and llguidance fills (an integer >= 1)",
        "1 on <= 2 cores, else half the cores, at most 8"),
    "mask_time_limit_ms": SwitchDoc(
        "per-step time limit of a request's tree-mask build, in ms (`0` = none); a build over it keeps the exact "
        "root row and drops that request's drafts for the step (same tokens, slower). Off in a process that is one "
        "of several `torch.distributed` ranks, so that every rank builds the same mask",
        f"{DEFAULT_MASK_TIME_LIMIT_MS:g}"),
    "stats_file": SwitchDoc(
        "JSON file of the plugin's counters, rewritten after every plugin-owned verify step (`steps`, `grammar_s`, "
        "`unhidden_s`, `mask_timeouts`, `aborts`, ...); one file per rank under tensor parallelism "
        "(`stats.rank<r>.json`)", "none"),
    "log_interval_s": SwitchDoc(
        "seconds between the INFO summary lines of logger `sglang_eagle_overlap`", f"{DEFAULT_LOG_INTERVAL_S:g}"),
    "timeline_file": SwitchDoc(
        "per-phase timeline of every verify step, written as JSON (benchmarks; off when unset)", "none"),
    "grammar_thread": SwitchDoc(
        "`1`: the step's one native call (the previous batch's accepted tokens fed, the tree mask walked) runs on a "
        "grammar thread started before the target-verify launch and joined before sampling; `0`: inline on the "
        "scheduler thread after the launch", _on_off(DEFAULT_GRAMMAR_THREAD)),
    "grammar_thread_min_batch": SwitchDoc(
        "with the grammar thread on, a verify batch of fewer grammar requests than this runs its grammar work inline "
        "(for one request the hand-off costs more than it hides)", str(DEFAULT_GRAMMAR_THREAD_MIN_BATCH)),
    "mask_upload_stream": SwitchDoc(
        "`1`: on a GPU the tree mask's host-to-device copy runs on a stream of its own while the target verify runs, "
        "and sampling waits for it; `0`: on the verify's stream, after the verify",
        _on_off(DEFAULT_MASK_UPLOAD_STREAM)),
    "forced_drafts": SwitchDoc(
        "`1`: the grammar's forced continuation after the accepted node replaces the next step's top-path drafts "
        "(verified like any draft: same output); `0`: drafts are the draft model's only; unset: auto, on for "
        f"{', '.join(sorted(FORCED_DRAFTS_AUTO_ALGORITHMS))} (NEXTN runs as EAGLE), off for the others (NGRAM)",
        "auto"),
    "forced_bonus_keys": SwitchDoc(
        "with forced drafts on: where the accepted node forces nothing itself, this many tokens (those that most "
        "often began forced text so far, e.g. a closing quote) are tried there, and the text the grammar forces "
        "after the one the target writes next becomes the next step's drafts; `0`: the node's own forced text only",
        str(DEFAULT_FORCED_BONUS_KEYS)),
    "forced_tail": SwitchDoc(
        "with forced drafts on: `1`: the forced text's last tokens, which could merge with what the model writes "
        "next (a key's closing `\":\"` before a value), are drafted too, the verify keeping them where the target "
        "writes them so; `0`: held back", _on_off(DEFAULT_FORCED_TAIL)),
    "native": SwitchDoc(
        "`1`: the batch's xgrammar calls go through the plugin's native module, built on first use with the host's "
        "C++ compiler, and a failed build is an error; `0`: Python only; unset: auto, native when it builds (a "
        "warning otherwise)", "auto"),
    "max_length_pattern": SwitchDoc(
        "`1`: before xgrammar compiles a `json_schema` request, each string schema bounded only by `maxLength` (and "
        "`minLength`; no `pattern`, `format`, `enum`, `const` or other keyword but annotations) is compiled as the "
        "pattern `^[^\\x00-\\x1f\"\\\\]{min,max}$`: the same strings minus raw control characters (which are "
        "not JSON), masked in ~0.01 ms per token instead of 1-30 ms near the bound; SGLang's grammar cache keeps "
        "the schema as sent. Only on an xgrammar measured faster with it: "
        + ", ".join(f"{v} (`maxLength` up to {n})" for v, n in MAX_LENGTH_PATTERN_BOUNDS.items())
        + "; nothing on xgrammar 0.2.1 (SGLang 0.5.16). `0`: schemas compiled as sent",
        _on_off(DEFAULT_MAX_LENGTH_PATTERN)),
}


def markdown_table() -> str:
    """The configuration table (markdown, no trailing newline): one row per :data:`ENV` entry, in ``ENV``'s order.

    Raises ``KeyError`` naming an ``ENV`` key that has no :data:`SWITCH_DOCS` entry."""
    rows = ["| variable | what it does | default |", "|---|---|---|"]
    for key, variable in ENV.items():
        try:
            doc = SWITCH_DOCS[key]
        except KeyError:
            raise KeyError(f"settings.ENV[{key!r}] ({variable}) has no SWITCH_DOCS entry") from None
        rows.append(f"| `{variable}` | {doc.meaning} | {doc.default} |")
    return "\n".join(rows)


_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")


def default_mask_threads(cores: Optional[int] = None) -> int:
    """Fill threads when none are asked for: 1 on <= 2 cores (measured in ``benchmarks/results/grammar_step.md``: the
    second fill thread competes with the scheduler and loses under load), else half the cores, at most 8."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return 1 if cores <= 2 else min(8, cores // 2)


class SettingsError(ValueError):
    """A switch has a value the plugin cannot use; the message names the variable and what it expects."""


@dataclass(frozen=True, slots=True)
class Settings:
    enabled: bool = True
    mask_threads: int = 1
    mask_time_limit_s: Optional[float] = DEFAULT_MASK_TIME_LIMIT_MS / 1e3
    stats_file: Optional[str] = None
    log_interval_s: float = DEFAULT_LOG_INTERVAL_S
    timeline_file: Optional[str] = None
    grammar_thread: bool = DEFAULT_GRAMMAR_THREAD
    grammar_thread_min_batch: int = DEFAULT_GRAMMAR_THREAD_MIN_BATCH
    mask_upload_stream: bool = DEFAULT_MASK_UPLOAD_STREAM
    forced_drafts: Optional[bool] = DEFAULT_FORCED_DRAFTS  # None: auto (see FORCED_DRAFTS_AUTO_ALGORITHMS)
    forced_bonus_keys: int = DEFAULT_FORCED_BONUS_KEYS
    forced_tail: bool = DEFAULT_FORCED_TAIL
    native: Optional[bool] = None  # None: auto (native when it builds), True: required, False: Python only
    max_length_pattern: bool = DEFAULT_MAX_LENGTH_PATTERN

    def max_length_pattern_bound(self, xgrammar_version: Optional[str]) -> Optional[int]:
        """The largest ``maxLength`` compiled as a pattern with xgrammar ``xgrammar_version``: None when the switch
        is off or that version's bound was not measured (:data:`MAX_LENGTH_PATTERN_BOUNDS`)."""
        if not self.max_length_pattern or xgrammar_version is None:
            return None
        return MAX_LENGTH_PATTERN_BOUNDS.get(xgrammar_version)

    def forced_drafts_for(self, algorithm: str) -> bool:
        """Whether grammar-forced drafts run for speculative ``algorithm`` (its SGLang name, e.g. ``EAGLE3``): the
        switch when set, else on for :data:`FORCED_DRAFTS_AUTO_ALGORITHMS` only."""
        if self.forced_drafts is not None:
            return self.forced_drafts
        return algorithm.upper() in FORCED_DRAFTS_AUTO_ALGORITHMS

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        env = os.environ if environ is None else environ

        def get(key: str) -> Optional[str]:
            raw = env.get(ENV[key])
            return None if raw is None else raw.strip()

        def optional_flag(key: str) -> Optional[bool]:
            raw = (get(key) or "").lower()
            if raw not in _OFF + _ON:
                raise SettingsError(f"{ENV[key]}={env.get(ENV[key])!r}: expected 1 / 0 (or on / off)")
            return None if not raw else raw not in _OFF

        def flag(key: str, default: bool) -> bool:
            value = optional_flag(key)
            return default if value is None else value

        enabled = flag("enabled", True)
        threads_raw = get("mask_threads")
        threads = default_mask_threads() if not threads_raw else _number(ENV["mask_threads"], threads_raw, int, 1)
        limit_raw = get("mask_time_limit_ms")
        limit_ms = (DEFAULT_MASK_TIME_LIMIT_MS if not limit_raw
                    else _number(ENV["mask_time_limit_ms"], limit_raw, float, 0.0))
        grammar_thread = flag("grammar_thread", DEFAULT_GRAMMAR_THREAD)
        min_batch_raw = get("grammar_thread_min_batch")
        min_batch = (DEFAULT_GRAMMAR_THREAD_MIN_BATCH if not min_batch_raw
                     else _number(ENV["grammar_thread_min_batch"], min_batch_raw, int, 1))
        mask_upload_stream = flag("mask_upload_stream", DEFAULT_MASK_UPLOAD_STREAM)
        forced_drafts = optional_flag("forced_drafts")
        keys_raw = get("forced_bonus_keys")
        bonus_keys = (DEFAULT_FORCED_BONUS_KEYS if not keys_raw
                      else _number(ENV["forced_bonus_keys"], keys_raw, int, 0))
        forced_tail = flag("forced_tail", DEFAULT_FORCED_TAIL)
        native = optional_flag("native")
        max_length_pattern = flag("max_length_pattern", DEFAULT_MAX_LENGTH_PATTERN)
        interval_raw = get("log_interval_s")
        interval = (DEFAULT_LOG_INTERVAL_S if not interval_raw
                    else _number(ENV["log_interval_s"], interval_raw, float, 0.0))
        return cls(
            enabled=enabled,
            mask_threads=int(threads),
            mask_time_limit_s=None if limit_ms <= 0 else limit_ms / 1e3,
            stats_file=get("stats_file") or None,
            log_interval_s=float(interval),
            timeline_file=get("timeline_file") or None,
            grammar_thread=grammar_thread,
            grammar_thread_min_batch=int(min_batch),
            mask_upload_stream=mask_upload_stream,
            forced_drafts=forced_drafts,
            forced_bonus_keys=int(bonus_keys),
            forced_tail=forced_tail,
            native=native,
            max_length_pattern=max_length_pattern,
        )


def _number(name: str, raw: str, kind: Union[Type[int], Type[float]], minimum: float) -> float:
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a {kind.__name__} >= {kind(minimum)}") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: expected a {kind.__name__} >= {kind(minimum)}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m sglang_eagle_overlap.settings --markdown``: print :func:`markdown_table`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sglang_eagle_overlap.settings", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the configuration table (markdown)")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
