"""Server soak: ``python -m sglang.launch_server`` with the plugin, many concurrent OpenAI-SDK clients, a fixed time.

What runs: the real pair (SmolLM2-135M-Instruct + its locally trained EAGLE3 draft, ``scripts/build_real_model.sh``)
through the project's CPU runtime (``sglang_eo_dev.cpu_runtime``), EAGLE3 topk 1 / 3 steps / 4 draft tokens, overlap
scheduler on, plugin on with its defaults (grammar-forced drafts: ``auto``, i.e. off for EAGLE3; ``--forced-drafts on``
to run them), SGLang's ``--enable-metrics`` (the
plugin's Prometheus counters) and the plugin's JSON stats file. Loopback only (127.0.0.1); the server is stopped at the
end whatever happens.

The clients (``--clients`` threads, each a loop of requests until ``--duration`` seconds have passed; one request per
client at a time) cycle through these kinds, each client starting at a different place in the cycle:

* ``json`` / ``regex`` / ``ebnf`` / ``tool_required`` / ``tool_named`` / ``free``: a valid request, alternately
  streamed and not. JSON uses ``response_format: json_schema`` with the held-apart prompts' schemas; regex and EBNF go
  through ``extra_body`` (SGLang's chat-completions fields ``regex`` / ``ebnf``); tool calls send ``tools`` with
  ``tool_choice: "required"`` or a named function (one call: ``parallel_tool_calls`` false). Each completed output is
  checked: JSON against its schema
  (``jsonschema``), the regex with ``re.fullmatch``, the EBNF by a regular expression of the same language, each tool
  call's name and its arguments against the tool's ``parameters`` (``tool_calls`` with a tool-call parser, else the
  content's JSON array of ``{"name", "parameters"}``). An output cut by ``max_tokens`` (finish reason
  ``length``) is counted as truncated and not checked (no grammar says what a prefix must be beyond "a prefix");
* ``disconnect``: a streamed JSON request whose client closes the connection after a few chunks (SGLang aborts the
  request: the plugin sees a constrained request leave mid-run);
* ``invalid``: a request whose grammar cannot compile or whose fields are wrong (bad JSON-schema type, unbalanced
  regex, EBNF syntax error, a schema that is not an object, a named tool that does not exist): it must get a 4xx;
* ``pathological``: grammars that compile to something odd (deep nesting, a 2000-value enum, a schema with no finite
  document, an impossible integer range, a 1000-way regex alternation): a 4xx or a valid / truncated output are both
  fine; a 5xx or a hang is not.

Before the timed phase one request of every kind and variant runs at once (warm-up: grammar caches, first batch
sizes); the scheduler's RSS after it is the baseline of the RSS bound.

It fails (exit status 1, the reasons in the report) on:

* any server error: a 5xx, a stream that ends in an error event, a connection refused / reset that the client did not
  cause, a request that does not answer within ``--request-timeout``, the server or its scheduler process gone, or
  ``/health_generate`` not answering after the run;
* a 4xx for a valid request, a 200 for an invalid one, a valid request aborted by the server (finish reason
  ``abort``);
* an invalid completed output (above);
* a plugin counter that does not add up (:func:`check_counters`);
* the scheduler's RSS growing by more than ``--rss-bound-mib`` (default 192 MiB) from the warm-up baseline to the end.
  Why that bound: on this CPU engine the scheduler's RSS is ~1.5-1.6 GB (float32 target 517 MB + draft + torch +
  xgrammar); after the warm-up every grammar the soak sends has been compiled once (xgrammar's compiled-grammar cache
  holds a fixed set of entries: the soak sends a fixed set of grammars), every batch size up to the running-request
  limit has run, so what is left is allocator noise. Measured growth on clean runs is in the results file; the bound
  leaves room for glibc arena fragmentation under 12 client threads, while a leak of one tree mask per verify step
  (bs 8 x 4 nodes x 49,152-bit rows = 192 KiB) crosses it in ~1,000 steps, i.e. in about a minute of this soak,
  and a leak of one ledger entry / matcher per request (xgrammar's matcher state for these schemas: ~0.1-1 MiB)
  crosses it within a few hundred requests.

Run (take the engine lock for the whole run on a shared machine)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python benchmarks/soak.py --duration 600

Writes ``<out-dir>/<name>.{json,md}`` (default ``benchmarks/results/soak_cpu_<sglang version>``). ``--duration`` is the
timed phase only; server start (~25-40 s), warm-up and the drain come on top. Not a timing benchmark: latencies are
CPU-engine figures under load, reported, never gated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
import threading
import time
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "dev"))

# --------------------------------------------------------------------------------------------------------- grammars
REGEX = r"(Yes|No), because [a-z ]{5,40}\."
EBNF = 'root ::= "The answer is " ("yes" | "no") ". Confidence: " [0-9] "/10."'
EBNF_AS_REGEX = r"The answer is (yes|no)\. Confidence: [0-9]/10\."
PROM = "sglang_eagle_overlap:"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One request's result. ``status``: ``ok`` (valid completed output), ``truncated`` (finish reason length),
    ``disconnected`` (the client closed it on purpose), ``rejected`` (a 4xx the kind expects); anything else is a
    failure kind (see :data:`FAILURE_STATUSES`)."""

    kind: str
    variant: str
    stream: bool
    phase: str
    status: str
    latency_s: float
    ttft_s: Optional[float] = None
    completion_tokens: int = 0
    detail: str = ""


OK_STATUSES = ("ok", "truncated", "disconnected", "rejected")
FAILURE_STATUSES = ("server_error", "stream_error", "connection_error", "timeout", "unexpected_4xx",
                    "invalid_accepted", "aborted", "invalid_output", "client_error")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request to send. ``expect``: ``valid`` (200 and a checked output), ``reject`` (a 4xx), ``either`` (a 4xx, or
    a 200 whose output passes ``check``). ``check(text, tool_calls)`` raises on an invalid output."""

    kind: str
    variant: str
    body: Dict[str, Any]
    expect: str
    check: Optional[Callable[[str, List[Dict[str, str]]], None]]
    stream: bool = False
    disconnect_after: int = 0


def _json_check(schema: Dict[str, Any]) -> Callable[[str, List[Dict[str, str]]], None]:
    def check(text: str, _calls: List[Dict[str, str]]) -> None:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)

    return check


def _regex_check(pattern: str) -> Callable[[str, List[Dict[str, str]]], None]:
    def check(text: str, _calls: List[Dict[str, str]]) -> None:
        if not re.fullmatch(pattern, text):
            raise ValueError(f"output does not match {pattern!r}: {text!r}")

    return check


def _tool_check(name: str, parameters: Dict[str, Any]) -> Callable[[str, List[Dict[str, str]]], None]:
    def check(text: str, calls: List[Dict[str, str]]) -> None:
        import jsonschema

        if not calls:
            # Without a tool-call parser SGLang constrains a required / named call to a JSON array of
            # {"name", "parameters"} objects and returns it as the content.
            items = json.loads(text)
            if not isinstance(items, list) or not items:
                raise ValueError(f"no tool call in the answer (content {text!r})")
            calls = [{"name": it.get("name"), "arguments": json.dumps(it.get("parameters"))} for it in items]
        for call in calls:
            if call["name"] != name:
                raise ValueError(f"tool call names {call['name']!r}, not {name!r}")
            jsonschema.validate(json.loads(call["arguments"]), parameters)

    return check


def _schema_format(schema: Any, name: str = "answer") -> Dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def _nested(depth: int) -> Dict[str, Any]:
    node: Dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        node = {"type": "array", "items": node, "minItems": 1, "maxItems": 1}
    return node


def build_specs(max_tokens: int) -> Dict[str, List[Spec]]:
    """kind -> its variants (each a :class:`Spec` without the stream flag, which the client loop alternates)."""
    from sglang_eo_dev.real_model.prompts import SCHEMAS, TOOL, Request, held_apart_requests, messages

    every = held_apart_requests()
    # As in tests/e2e/test_real_model.py: held-apart prompt 5 makes the model write an endless number under its
    # schema, so the family's other held-apart prompt stands in for it.
    held = every[:5] + [every[11]]
    tool = TOOL
    fn = tool["function"]
    weather = ("What will the weather be in Reykjavik on 2025-03-14, in celsius? Use the get_weather tool.")

    def chat(msgs: List[Dict[str, str]], **extra: Any) -> Dict[str, Any]:
        return {"messages": msgs, "temperature": 0, "max_tokens": max_tokens, **extra}

    def user_messages(user: str) -> List[Dict[str, str]]:
        return messages(Request(user))

    def schema_spec(kind: str, variant: str, msgs: List[Dict[str, str]], schema: Any, expect: str = "valid",
                    **spec: Any) -> Spec:
        """A ``response_format: json_schema`` request whose output is checked against that same schema."""
        return Spec(kind, variant, chat(msgs, response_format=_schema_format(schema)), expect, _json_check(schema),
                    **spec)

    specs: Dict[str, List[Spec]] = {
        "json": [schema_spec("json", r.schema, messages(r), SCHEMAS[r.schema]) for r in held if r.schema],
        "regex": [Spec("regex", "yes_no_because",
                       chat(user_messages("Is the sky blue on a clear day? Answer yes or no and say why."),
                            extra_body={"regex": REGEX}), "valid", _regex_check(REGEX))],
        "ebnf": [Spec("ebnf", "answer_confidence",
                      chat(user_messages("Is ice colder than steam? Give your answer and a confidence out of 10."),
                           extra_body={"ebnf": EBNF}), "valid", _regex_check(EBNF_AS_REGEX))],
        "tool_required": [Spec("tool_required", fn["name"], chat(user_messages(weather), tools=[tool],
                                                                 tool_choice="required", parallel_tool_calls=False),
                               "valid", _tool_check(fn["name"], fn["parameters"]))],
        "tool_named": [Spec("tool_named", fn["name"],
                            chat(user_messages(weather), tools=[tool], parallel_tool_calls=False,
                                 tool_choice={"type": "function", "function": {"name": fn["name"]}}),
                            "valid", _tool_check(fn["name"], fn["parameters"]))],
        "free": [Spec("free", "chat", chat(user_messages(q)), "valid", None)
                 for q in ("Name two fruits that are yellow.", "Write one sentence about the sea.")],
        "disconnect": [schema_spec("disconnect", r.schema, messages(r), SCHEMAS[r.schema], stream=True,
                                   disconnect_after=2 + i % 4)
                       for i, r in enumerate(held) if r.schema],
        "invalid": [
            Spec("invalid", "bad_type", chat(user_messages("JSON please."), response_format=_schema_format(
                {"type": "object", "properties": {"a": {"type": "nope"}}})), "reject", None),
            Spec("invalid", "bad_regex", chat(user_messages("Say something."), extra_body={"regex": "([a-z]+"}),
                 "reject", None),
            Spec("invalid", "bad_ebnf", chat(user_messages("Say something."), extra_body={"ebnf": 'root ::= "a" |'}),
                 "reject", None),
            Spec("invalid", "schema_not_object", chat(user_messages("JSON please."), response_format=_schema_format(
                "not a schema")), "reject", None),
            Spec("invalid", "unknown_tool", chat(user_messages(weather), tools=[tool], tool_choice={
                "type": "function", "function": {"name": "no_such_tool"}}), "reject", None),
        ],
        "pathological": [
            schema_spec("pathological", "nested_40", user_messages("A nested list, as JSON."), _nested(40), "either"),
            schema_spec("pathological", "enum_2000", user_messages("Pick a code, as JSON."),
                        {"type": "string", "enum": [f"code-{i:04d}" for i in range(2000)]}, "either"),
            schema_spec("pathological", "no_finite_document", user_messages("A linked list, as JSON."), _INFINITE,
                        "either"),
            schema_spec("pathological", "empty_integer_range", user_messages("A number, as JSON."),
                        {"type": "integer", "minimum": 5, "maximum": 1}, "either"),
            Spec("pathological", "alternation_1000", chat(user_messages("Say a word."), extra_body={"regex": _ALT}),
                 "either", _regex_check(_ALT)),
        ],
    }
    return specs


_INFINITE: Dict[str, Any] = {
    "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"],
                       "additionalProperties": False}},
    "$ref": "#/$defs/node",
}
_ALT = "(" + "|".join(f"w{i:03d}[a-z]" for i in range(1000)) + ")"

# The client loop's cycle: a kind's share of the load is its count here.
CYCLE = ("json", "free", "regex", "json", "disconnect", "tool_required", "ebnf", "json", "free", "tool_named",
         "disconnect", "invalid", "pathological")


# ----------------------------------------------------------------------------------------------------------- client
def _openai_client(base_url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="soak", max_retries=0, timeout=timeout)


def run_request(client: Any, spec: Spec, stream: bool, phase: str) -> Outcome:
    """Send ``spec`` once (streamed when ``stream`` or the spec says so) and classify the answer."""
    import openai

    stream = stream or spec.stream
    body = dict(spec.body)
    extra_body = body.pop("extra_body", None)
    t0 = time.monotonic()
    ttft: Optional[float] = None
    text, calls, finish, tokens = "", [], None, 0

    def out(status: str, detail: str = "") -> Outcome:
        return Outcome(spec.kind, spec.variant, stream, phase, status, time.monotonic() - t0, ttft, tokens,
                       detail[:500])

    try:
        if not stream:
            resp = client.chat.completions.create(model="default", extra_body=extra_body, **body)
            choice = resp.choices[0]
            text = choice.message.content or ""
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in (choice.message.tool_calls or [])]
            finish = choice.finish_reason
            tokens = resp.usage.completion_tokens if resp.usage else 0
        else:
            parts: List[str] = []
            by_index: Dict[int, Dict[str, str]] = {}
            chunks = 0
            s = client.chat.completions.create(model="default", extra_body=extra_body, stream=True,
                                               stream_options={"include_usage": True}, **body)
            try:
                for chunk in s:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if not chunk.choices:
                        continue
                    ch = chunk.choices[0]
                    d = ch.delta
                    if d is not None and (d.content or d.tool_calls):
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        chunks += 1
                        parts.append(d.content or "")
                        for tc in d.tool_calls or []:
                            slot = by_index.setdefault(tc.index, {"name": "", "arguments": ""})
                            if tc.function is not None:
                                slot["name"] += tc.function.name or ""
                                slot["arguments"] += tc.function.arguments or ""
                    if ch.finish_reason:
                        finish = ch.finish_reason
                    if spec.disconnect_after and chunks >= spec.disconnect_after and finish is None:
                        s.close()  # the client goes away mid-stream: SGLang must abort the request
                        return out("disconnected", f"after {chunks} chunks")
            finally:
                s.close()
            text = "".join(parts)
            calls = [by_index[i] for i in sorted(by_index)]
    except openai.APIStatusError as e:
        code = e.status_code
        detail = f"{code}: {str(e)[:300]}"
        if code >= 500:
            return out("server_error", detail)
        if spec.expect in ("reject", "either"):
            return out("rejected", detail)
        return out("unexpected_4xx", detail)
    except openai.APITimeoutError as e:
        return out("timeout", str(e))
    except openai.APIConnectionError as e:
        return out("connection_error", f"{e!r}: {e.__cause__!r}")
    except openai.APIError as e:  # an error event inside a 200 stream
        if spec.expect in ("reject", "either") and _looks_like_client_error(str(e)):
            return out("rejected", f"in-stream: {e}")
        return out("stream_error", str(e))
    except Exception as e:  # the SDK choked on the answer: report it, do not crash the client thread
        return out("client_error", f"{type(e).__name__}: {e}")

    if finish == "abort":
        if spec.expect == "reject":
            return out("rejected", f"finish abort: {text[:200]!r}")
        return out("aborted", f"finish_reason abort: {text[:200]!r}")
    if spec.expect == "reject":
        return out("invalid_accepted", f"finish {finish}: {text[:200]!r}")
    if finish == "length":
        return out("truncated")
    if spec.check is not None:
        try:
            spec.check(text, calls)
        except Exception as e:
            return out("invalid_output", f"{type(e).__name__}: {str(e)[:300]}; finish {finish}; text {text[:300]!r}; "
                                         f"calls {calls!r}")
    return out("ok")


def _looks_like_client_error(message: str) -> bool:
    return bool(re.search(r"\b4\d\d\b|invalid|grammar|schema|regex|ebnf|bad request", message, re.I))


# ----------------------------------------------------------------------------------------------------- server side
def find_scheduler(server_pid: int) -> Optional[int]:
    """The scheduler process among the server's descendants, by the process title SGLang gives it
    (``sglang::scheduler``, shortened to 15 characters in ``/proc/<pid>/comm``)."""
    import psutil

    try:
        kids = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in kids:
        try:
            title = " ".join(p.cmdline()) or p.name()
            if "sglang::scheduler" in title or p.name().startswith("sglang::schedul"):
                return p.pid
        except psutil.Error:
            continue
    return None


def rss_mib(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss / 2 ** 20
    except psutil.Error:
        return None


def get_text(base_url: str, path: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(base_url + path, timeout=timeout) as r:
        return r.read().decode()


_LOAD_KEYS = ("num_reqs", "num_running_reqs", "num_waiting_reqs", "running", "waiting", "num_queue_reqs")


def busy_requests(loads: Any) -> int:
    """Running + waiting requests in a ``/v1/loads`` answer (its nesting differs across releases)."""
    total = 0
    stack = [loads]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _LOAD_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
                    total += int(v)
                else:
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(node)
    return total


def prom_metrics(text: str) -> Dict[str, float]:
    """The plugin's counters on ``/metrics`` (summed over label sets / processes), without the ``_total`` suffix."""
    out: Dict[str, float] = {}
    for m in re.finditer(r"^(sglang_eagle_overlap:[a-z_]+?)(?:_total)?(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M):
        name = m.group(1)[len(PROM):]
        if not name.endswith("_created"):
            out[name] = out.get(name, 0.0) + float(m.group(2))
    return out


def check_counters(stats: Dict[str, Any], prom: Dict[str, float], band: str) -> List[str]:
    """What the plugin's counters must satisfy after a soak with constrained traffic; returns the violations.

    * it did the work: grammar verify steps > 0 and tokens fed to grammars through its ledger > 0; on 0.5.16 it kept
      grammar decode batches in the overlap (``overlap_kept`` > 0: stock 0.5.16 forces every one out);
    * nothing went wrong inside it: no ledger re-anchor (``ledger_resets``: a gap or a conflict between what the
      ledger fed and what SGLang committed), no request aborted because its grammar rejected a committed token
      (``aborts``), no failed mask build (``mask_failures``), no step left to SGLang's own path (``fallback_steps``:
      xgrammar is the backend);
    * the two reports agree: the Prometheus counters (written at the end of each step) equal the stats file's
      (rewritten right after): steps, mask time-limit hits, forced drafts proposed and accepted; the un-hidden grammar
      time is part of the grammar time, which is part of the scheduler thread's grammar time;
    * the forced-draft counts nest: changed <= proposed, accepted <= proposed, changed-and-accepted <= both;
    * the step's parts nest: grammar-thread steps + small-batch inline steps <= steps; replays need no feeding
      (they are asks answered from the ledger) so they say nothing alone, and are only reported.
    """
    bad: List[str] = []

    def need(cond: bool, what: str) -> None:
        if not cond:
            bad.append(what)

    steps = int(stats.get("steps", 0))
    need(steps > 0, f"no grammar verify step in the plugin's stats ({steps})")
    need(int(stats.get("tokens_advanced", 0)) > 0, "no token fed through the plugin's ledger")
    if band == "0.5.16":
        need(int(stats.get("overlap_kept", 0)) > 0, "0.5.16: no grammar decode batch kept in the overlap")
    for name in ("ledger_resets", "aborts", "mask_failures", "fallback_steps"):
        need(int(stats.get(name, 0)) == 0, f"{name} = {stats.get(name)} (expected 0)")
    eps = 1e-6
    need(prom.get("grammar_steps", -1) == steps,
         f"Prometheus grammar_steps {prom.get('grammar_steps')} != stats steps {steps}")
    need(prom.get("mask_timeouts", 0.0) == int(stats.get("mask_timeouts", 0)),
         f"Prometheus mask_timeouts {prom.get('mask_timeouts', 0)} != stats {stats.get('mask_timeouts')}")
    need(prom.get("forced_drafts_proposed", 0.0) == int(stats.get("forced_proposed", 0)),
         f"Prometheus forced_drafts_proposed {prom.get('forced_drafts_proposed', 0)} != stats "
         f"{stats.get('forced_proposed')}")
    need(prom.get("forced_drafts_accepted", 0.0) == int(stats.get("forced_accepted", 0)),
         f"Prometheus forced_drafts_accepted {prom.get('forced_drafts_accepted', 0)} != stats "
         f"{stats.get('forced_accepted')}")
    need(prom.get("grammar_unhidden_seconds", 0.0) <= prom.get("grammar_seconds", 0.0) * (1 + 1e-9) + eps,
         f"Prometheus un-hidden {prom.get('grammar_unhidden_seconds')} s > grammar {prom.get('grammar_seconds')} s")
    # Prometheus' grammar time is each step's join-to-mask-ready part, which the stats file's scheduler-thread time
    # (hand-off + that part) contains.
    need(prom.get("grammar_seconds", 0.0) <= float(stats.get("sched_s", 0.0)) * (1 + 1e-9) + eps,
         f"Prometheus grammar {prom.get('grammar_seconds')} s > stats scheduler-thread time {stats.get('sched_s')} s")
    need(abs(float(stats.get("unhidden_s", 0.0)) - prom.get("grammar_unhidden_seconds", 0.0)) <= 1e-6 * max(1, steps),
         f"stats unhidden_s {stats.get('unhidden_s')} != Prometheus {prom.get('grammar_unhidden_seconds')}")
    fp, fc, fa, fca = (int(stats.get(k, 0)) for k in ("forced_proposed", "forced_changed", "forced_accepted",
                                                      "forced_changed_accepted"))
    need(fc <= fp and fa <= fp and fca <= fc and fca <= fa,
         f"forced-draft counts do not nest: proposed {fp}, changed {fc}, accepted {fa}, changed+accepted {fca}")
    need(int(stats.get("thread_steps", 0)) + int(stats.get("small_batch_inline_steps", 0)) <= steps,
         f"thread_steps {stats.get('thread_steps')} + small_batch_inline_steps "
         f"{stats.get('small_batch_inline_steps')} > steps {steps}")
    return bad


def check_runtime(runtime: Dict[str, Any], stats: Dict[str, Any]) -> List[str]:
    """What the CPU runtime's counters (its hooks in the scheduler process) must show with the plugin on: no runtime
    error, no grammar decode batch forced out of the overlap (the plugin keeps them all in), and at least as many
    grammar decode batches as plugin verify steps (each plugin step is one of them)."""
    if not runtime:
        return ["no CPU-runtime stats file written"]
    bad: List[str] = []
    if runtime.get("runtime_errors"):
        bad.append(f"runtime errors in the scheduler: {runtime['runtime_errors'][:5]}")
    if int(runtime.get("overlap_disabled_grammar_decode_batches", 0)) != 0:
        bad.append(f"{runtime['overlap_disabled_grammar_decode_batches']} grammar decode batches left the overlap")
    if stats and int(stats.get("steps", 0)) > int(runtime.get("grammar_decode_batches", 0)):
        bad.append(f"plugin steps {stats.get('steps')} > grammar decode batches "
                   f"{runtime.get('grammar_decode_batches')}")
    return bad


# ------------------------------------------------------------------------------------------------------------ soak
@dataclasses.dataclass
class Soak:
    base_url: str
    specs: Dict[str, List[Spec]]
    clients: int
    request_timeout: float
    seed: int
    outcomes: List[Outcome] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)

    def warmup(self) -> None:
        """Every kind and variant once (disconnects: one; their schemas are the JSON kind's), all at once, streamed for
        every second variant of a kind."""
        jobs = [(spec, i % 2 == 1) for kind in self.specs
                for i, spec in enumerate(self.specs[kind][:1] if kind == "disconnect" else self.specs[kind])]
        threads = []
        for spec, stream in jobs:
            client = _openai_client(self.base_url, self.request_timeout)
            t = threading.Thread(
                target=lambda s=spec, st=stream, c=client: self.record(run_request(c, s, st, "warmup")), daemon=True)
            t.start()
            threads.append(t)
        hung = _join_until(threads, time.monotonic() + self.request_timeout + 30)
        if hung:
            self.record(Outcome("warmup", "hung", False, "warmup", "timeout", self.request_timeout,
                                detail=f"{hung} warm-up clients still waiting"))

    def timed(self, duration: float) -> None:
        stop_at = time.monotonic() + duration

        def loop(i: int) -> None:
            rng = random.Random(self.seed * 1000 + i)
            client = _openai_client(self.base_url, self.request_timeout)
            n = 0
            while time.monotonic() < stop_at:
                kind = CYCLE[(i + n) % len(CYCLE)]
                spec = rng.choice(self.specs[kind])
                self.record(run_request(client, spec, stream=(n + i) % 2 == 1, phase="timed"))
                n += 1

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        hung = _join_until(threads, stop_at + self.request_timeout + 30)  # each request is bounded by request_timeout
        if hung:
            self.record(Outcome("timed", "hung", False, "timed", "timeout", self.request_timeout,
                                detail=f"{hung} clients did not return"))


def _join_until(threads: List[threading.Thread], deadline: float) -> int:
    """Join every thread until ``deadline`` (``time.monotonic()``); how many are still running then."""
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in threads)


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


def summarise(outcomes: List[Outcome], phase: str = "timed") -> Dict[str, Any]:
    rows = [o for o in outcomes if o.phase == phase]
    by_kind: Dict[str, Dict[str, Any]] = {}
    for kind in sorted({o.kind for o in rows}):
        ks = [o for o in rows if o.kind == kind]
        lat = [o.latency_s for o in ks if o.status in ("ok", "truncated", "rejected")]
        ttft = [o.ttft_s for o in ks if o.ttft_s is not None and o.status in ("ok", "truncated")]
        by_kind[kind] = {
            "requests": len(ks),
            "streamed": sum(o.stream for o in ks),
            "statuses": {s: sum(o.status == s for o in ks) for s in sorted({o.status for o in ks})},
            "completion_tokens": sum(o.completion_tokens for o in ks),
            "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99),
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        }
    served = [o for o in rows if o.status in OK_STATUSES]
    done = [o.latency_s for o in rows if o.status in ("ok", "truncated")]
    return {
        "requests": len(rows),
        "served": len(served),
        "statuses": {s: sum(o.status == s for o in rows) for s in sorted({o.status for o in rows})},
        "completion_tokens": sum(o.completion_tokens for o in rows),
        "p50_s": _pct(done, 0.5),
        "p99_s": _pct(done, 0.99),
        "by_kind": by_kind,
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of the timed phase")
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--max-running-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--request-timeout", type=float, default=180.0)
    ap.add_argument("--rss-bound-mib", type=float, default=192.0)
    ap.add_argument("--forced-drafts", choices=("on", "off", "auto"), default="auto")
    ap.add_argument("--tool-call-parser", default="",
                    help="SGLang's --tool-call-parser (answers then come back as tool_calls); default none: SGLang "
                         "constrains a required / named call by a JSON schema and returns the array as the content "
                         "(with qwen25 the real pair never closed its call: every answer hit max_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=None, help="result file stem (default soak_cpu_<sglang version>)")
    args = ap.parse_args(argv)

    from sglang_eagle_overlap.settings import ENV
    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server
    from sglang_eo_dev.cpu_runtime.stats import read_stats

    band = metadata.version("sglang")
    forced = {"on": True, "off": False, "auto": None}[args.forced_drafts]
    extra: Tuple[Tuple[str, Any], ...] = (("enable_metrics", True),)
    if args.tool_call_parser:
        extra += (("tool_call_parser", args.tool_call_parser),)
    cfg = EngineConfig(pair="smollm2", spec="topk1", overlap=True, product_plugin=True, forced_drafts=forced,
                       max_running_requests=args.max_running_requests, extra=extra)
    specs = build_specs(args.max_tokens)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    # The plugin's stats file (its own variable, read in the scheduler process; launch_server copies os.environ) and
    # the CPU runtime's (launch_server's stats_file: forced-sync decisions, runtime errors, aborts seen).
    stats_file = str(tmp / "plugin-stats.json")
    os.environ[ENV["stats_file"]] = stats_file
    runtime_stats_file = str(tmp / "runtime-stats.json")
    log_path = str(tmp / "server.log")
    failures: List[str] = []
    rss: List[Tuple[float, float]] = []
    t_start = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    server = launch_server(cfg, log_path=log_path, stats_file=runtime_stats_file)
    t_up = time.monotonic() - t_start
    stop_sampler = threading.Event()
    try:
        sched = find_scheduler(server.proc.pid)
        if sched is None:
            failures.append("no sglang::scheduler process under the server")
        rss_launch = rss_mib(sched) if sched else None

        def sample() -> None:
            while not stop_sampler.wait(5.0):
                if sched is not None:
                    v = rss_mib(sched)
                    if v is not None:
                        rss.append((round(time.monotonic() - t_start, 1), round(v, 1)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        soak = Soak(server.base_url, specs, args.clients, args.request_timeout, args.seed)
        t0 = time.monotonic()
        soak.warmup()
        t_warm = time.monotonic() - t0
        _wait_idle(server, 60)
        rss_warm = rss_mib(sched) if sched else None
        t0 = time.monotonic()
        soak.timed(args.duration)
        t_timed = time.monotonic() - t0
        try:
            _wait_idle(server, 120)
        except Exception as e:
            failures.append(f"server not idle after the soak: {e}")
        time.sleep(1.0)  # the last step's stats-file write
        rss_end = rss_mib(sched) if sched else None
        stop_sampler.set()

        alive = server.proc.poll() is None and (sched is None or rss_end is not None)
        if not alive:
            failures.append("the server or its scheduler process exited during the soak")
        health = None
        try:
            with urllib.request.urlopen(server.base_url + "/health_generate", timeout=60) as r:
                health = r.status
        except Exception as e:
            health = repr(e)
        if health != 200:
            failures.append(f"/health_generate after the soak: {health}")
        prom_text = ""
        try:
            prom_text = get_text(server.base_url, "/metrics")
        except Exception as e:
            failures.append(f"/metrics unreadable: {e!r}")
        prom = prom_metrics(prom_text)
        stats = read_stats(stats_file)  # written by rename: whole or absent
        runtime = server.stats()
        counter_violations = check_counters(stats, prom, band) if stats else ["no plugin stats file written"]
        counter_violations += check_runtime(runtime, stats)
        failures += [f"counter: {v}" for v in counter_violations]

        for o in soak.outcomes:
            if o.status in FAILURE_STATUSES:
                failures.append(f"{o.phase} {o.kind}/{o.variant}{' stream' if o.stream else ''}: {o.status}: "
                                f"{o.detail}")
        growth = (rss_end - rss_warm) if (rss_end is not None and rss_warm is not None) else None
        if growth is None:
            failures.append("scheduler RSS not measured")
        elif growth > args.rss_bound_mib:
            failures.append(f"scheduler RSS grew {growth:.0f} MiB (> {args.rss_bound_mib:.0f} MiB) from warm-up to end")
        timed = summarise(soak.outcomes, "timed")
        kinds_missing = [k for k in specs if k not in timed["by_kind"]]
        log_tail = server.log_tail(400)
        result = {
            "what": "server soak: python -m sglang.launch_server, plugin on, EAGLE3 topk 1 + overlap, real pair, "
                    "concurrent OpenAI-SDK clients",
            "command": "python benchmarks/soak.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "started": started,
            "environment": {
                "sglang": band, "xgrammar": metadata.version("xgrammar"), "torch": metadata.version("torch"),
                "openai": metadata.version("openai"), "python": platform.python_version(),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "device": "cpu (project CPU runtime)",
            },
            "config": {"duration_s": args.duration, "clients": args.clients,
                       "max_running_requests": args.max_running_requests, "max_tokens": args.max_tokens,
                       "request_timeout_s": args.request_timeout, "forced_drafts": args.forced_drafts,
                       "tool_call_parser": args.tool_call_parser, "engine": cfg.describe(), "cycle": list(CYCLE),
                       "rss_bound_mib": args.rss_bound_mib},
            "seconds": {"server_start": round(t_up, 1), "warmup": round(t_warm, 1), "timed": round(t_timed, 1),
                        "total": round(time.monotonic() - t_start, 1)},
            "timed": timed,
            "warmup": summarise(soak.outcomes, "warmup"),
            "kinds_not_sent_in_timed_phase": kinds_missing,
            "scheduler_rss_mib": {"after_launch": rss_launch, "after_warmup": rss_warm, "end": rss_end,
                                  "growth_from_warmup": growth, "bound": args.rss_bound_mib, "samples": rss},
            "plugin_stats": stats,
            "runtime_stats": {k: v for k, v in runtime.items() if k != "abort_requests"},
            "runtime_aborted_requests": len(runtime.get("abort_requests", [])),
            "prometheus": prom,
            "counter_violations": counter_violations,
            "server_log_tracebacks": log_tail.count("Traceback"),
            "failures": failures,
            "passed": not failures,
        }
    finally:
        stop_sampler.set()
        server.stop()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"soak_cpu_{band}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(render_md(result))
    print(render_md(result))
    if failures:
        print(f"SOAK FAILED ({len(failures)}): server log {log_path}", file=sys.stderr)
        for f in failures[:50]:
            print("  " + f, file=sys.stderr)
        return 1
    return 0


def _wait_idle(server: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    loads: Any = None
    while time.monotonic() < deadline:
        loads = server.get_json("/v1/loads")
        if busy_requests(loads) == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"still busy after {timeout} s: {loads}")


def _fmt(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_md(r: Dict[str, Any]) -> str:
    t, env, cfg, rss = r["timed"], r["environment"], r["config"], r["scheduler_rss_mib"]
    st = r["plugin_stats"]
    lines = [
        f"# Server soak, CPU engine, SGLang {env['sglang']}",
        "",
        f"{r['what']}. Started {r['started']}; `{r['command']}`.",
        f"SGLang {env['sglang']}, xgrammar {env['xgrammar']}, torch {env['torch']}, openai {env['openai']}, "
        f"Python {env['python']}, {env['machine']}, {env['device']}. Engine `{cfg['engine']}`, {cfg['clients']} "
        f"clients, max running requests {cfg['max_running_requests']}, max_tokens {cfg['max_tokens']}, forced drafts "
        f"{cfg['forced_drafts']}, tool-call parser {cfg['tool_call_parser']}.",
        f"Server start {r['seconds']['server_start']} s, warm-up {r['seconds']['warmup']} s, timed phase "
        f"{r['seconds']['timed']} s, total {r['seconds']['total']} s.",
        "",
        f"**{'PASSED' if r['passed'] else 'FAILED'}**: {t['served']} of {t['requests']} timed-phase requests served "
        f"as expected ({', '.join(f'{k} {v}' for k, v in t['statuses'].items())}); {t['completion_tokens']} "
        f"completion tokens; latency of completed requests p50 {_fmt(t['p50_s'])} s, p99 {_fmt(t['p99_s'])} s.",
        "",
        "| kind | requests | streamed | outcomes | p50 s | p99 s | TTFT p50 s |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for kind, k in t["by_kind"].items():
        lines.append(f"| {kind} | {k['requests']} | {k['streamed']} | "
                     f"{', '.join(f'{s} {n}' for s, n in k['statuses'].items())} | {_fmt(k['p50_s'])} | "
                     f"{_fmt(k['p99_s'])} | {_fmt(k['ttft_p50_s'])} |")
    lines += [
        "",
        f"Scheduler RSS: {_fmt(rss['after_launch'], 0)} MiB after launch, {_fmt(rss['after_warmup'], 0)} MiB after "
        f"warm-up, {_fmt(rss['end'], 0)} MiB at the end: growth {_fmt(rss['growth_from_warmup'], 0)} MiB (bound "
        f"{_fmt(rss['bound'], 0)} MiB).",
        "",
        "Plugin counters (stats file): " + ", ".join(
            f"{k} {st.get(k)}" for k in ("steps", "tokens_advanced", "thread_steps", "small_batch_inline_steps",
                                         "overlap_kept", "barrier_runs", "replays", "ledger_resets", "ledger_forgets",
                                         "aborts", "mask_failures", "mask_timeouts", "fallback_steps",
                                         "forced_proposed", "forced_accepted", "ledger_requests",
                                         "pinned_allocations") if k in st) + ".",
        "CPU runtime: " + ", ".join(f"{k} {r['runtime_stats'].get(k)}" for k in (
            "grammar_decode_batches", "overlap_disabled_grammar_decode_batches", "retracted_requests",
            "ledger_max_entries") if k in r["runtime_stats"])
        + f", aborted requests seen {r['runtime_aborted_requests']}.",
        "Prometheus: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r["prometheus"].items())) + ".",
        "",
        "Counter invariants: " + ("all hold." if not r["counter_violations"] else
                                  "; ".join(r["counter_violations"])),
    ]
    if r["failures"]:
        lines += ["", "Failures:", *[f"- {f}" for f in r["failures"][:50]]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
