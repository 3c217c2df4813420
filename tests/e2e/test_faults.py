"""Engine-level faults against ONE real ``python -m sglang.launch_server`` (EAGLE3 topk 4 + overlap, follower pair,
product plugin on), on both supported SGLang versions.

1. References: each surviving request is sent alone first (greedy; its output ids are the reference).
2. Faults, all at once from concurrent client threads: the survivors again, next to requests aborted through
   ``/abort_request``, streaming clients that disconnect mid-stream, invalid schemas, pathological schemas (deeply
   nested, huge enum, unsatisfiable pattern), unicode, a long output, and four injected faults
   (:mod:`sglang_eo_dev.cpu_runtime.faults`, ``SGLANG_EO_FAULTS=1``), a failing and a slow one on each path into the
   plugin's tree-mask build: the generic grammar-object walk (``eo-fault-raise`` / ``eo-fault-slow`` rids) and the
   lockstep path xgrammar requests take (``eo-fault-matcher-raise`` / ``eo-fault-matcher-slow``: the request's real
   matcher wrapped, xgrammar's batched fill reading it); a slow build exceeds
   ``SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS``.
3. Afterwards: every survivor (including the slow one) is token-identical to its reference (no accepted token lost or
   duplicated), each failing request got a clear error of its own, the scheduler was told to abort every aborted and
   every disconnected request, the injected faults are counted as having happened,
   the plugin's ledger never had to re-anchor, the server is idle and SGLang's own idle memory-leak check keeps running
   and passing (strict by default: a leak raises and kills the scheduler), and a normal constrained request is still
   token-identical to the one sent before the faults.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional

import jsonschema
import pytest
import requests

from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server
from sglang_eo_dev.cpu_runtime.faults import RAISE_MARKER, RAISE_MATCHER_MARKER, SLOW_MARKER, SLOW_MATCHER_MARKER
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA

from .common import output_ids, wait_idle

pytestmark = pytest.mark.engine

CFG = EngineConfig(pair="follower", spec="topk4", overlap=True, product_plugin=True)
MASK_LIMIT_MS = 40  # the injected slow grammar / matcher sleeps 25 ms per row / accept: the second already exceeds it

UNICODE_SCHEMA = {
    "type": "object",
    "properties": {"w": {"enum": ["naïve café", "日本語のテキスト", "🙂 emoji ✓", "Ωμέγα"]}},
    "required": ["w"],
}


def _nested(depth: int) -> Dict[str, Any]:
    s: Dict[str, Any] = {"type": "boolean"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


NESTED_SCHEMA = _nested(30)
HUGE_ENUM = [f"item_{i:05d}" for i in range(3000)]
UNSAT_SCHEMA = {"type": "string", "pattern": "^[^\\s\\S]$"}  # no character matches (in the regex's own terms)
REGEX = r"(yes|no)\.[0-9]{2}"


def _body(text: str, rid: Optional[str] = None, **params: Any) -> Dict[str, Any]:
    body: Dict[str, Any] = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 64, **params}}
    if rid:
        body["rid"] = rid
    return body


# The requests that must survive the faults unchanged: name -> (body without rid, check of the output)
SURVIVORS = {
    "json": (_body("Scene A:", json_schema=json.dumps(FOLLOWER_SCHEMA)),
             lambda out: json.loads(out["text"]) == FOLLOWER_DOCUMENT),
    "free": (_body("Plain words here", max_new_tokens=48), lambda out: bool(out["text"])),
    "unicode": (_body("Ünïcödé → 日本語 ✓ 🙂:", json_schema=json.dumps(UNICODE_SCHEMA)),
                lambda out: jsonschema.validate(json.loads(out["text"]), UNICODE_SCHEMA) is None),
    "long": (_body("Go on and on:", max_new_tokens=300, ignore_eos=True),
             lambda out: out["meta_info"]["completion_tokens"] == 300),
    "regex": (_body("Answer:", regex=REGEX), lambda out: re.fullmatch(REGEX, out["text"]) is not None),
    "nested": (_body("Nest:", max_new_tokens=300, json_schema=json.dumps(NESTED_SCHEMA)),
               lambda out: jsonschema.validate(json.loads(out["text"]), NESTED_SCHEMA) is None),
    "enum": (_body("Pick:", json_schema=json.dumps({"enum": HUGE_ENUM})),
             lambda out: json.loads(out["text"]) in HUGE_ENUM),
}


@pytest.fixture(scope="module")
def server(engine_pool, tmp_path_factory):
    engine_pool.close()  # one engine at a time on this machine
    tmp = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_EO_FAULTS", "1")
        mp.setenv("SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS", str(MASK_LIMIT_MS))
        srv = launch_server(CFG, log_path=str(tmp / "server.log"), stats_file=str(tmp / "stats.json"),
                            plugin_stats_file=str(tmp / "plugin-stats.json"))
    yield srv
    srv.stop()


def _post(server, body, timeout=300) -> requests.Response:
    return requests.post(server.base_url + "/generate", json=body, timeout=timeout)


def _ok(r: requests.Response) -> Dict[str, Any]:
    assert r.status_code == 200, (r.status_code, r.text[:500])
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out["meta_info"]
    return out


def _error_text(r: requests.Response) -> Optional[str]:
    """The error a failed request got (HTTP error body, or an abort finish reason), None if it succeeded."""
    if r.status_code != 200:
        return f"HTTP {r.status_code}: {r.text}"
    meta = r.json().get("meta_info", {})
    if meta.get("finish_reason", {}).get("type") == "abort":
        return json.dumps(meta["finish_reason"])
    return None


def _stream_and_disconnect(server, rid: str) -> int:
    """Start a long streaming request, read two chunks, then drop the connection. Returns the chunks read."""
    body = _body("Stream forever:", rid=rid, max_new_tokens=1000, ignore_eos=True)
    body["stream"] = True
    with requests.Session() as s:
        r = s.post(server.base_url + "/generate", json=body, stream=True, timeout=300)
        assert r.status_code == 200, r.text
        chunks = 0
        for line in r.iter_lines():
            if line:
                chunks += 1
            if chunks >= 2:
                break
        r.close()  # a partly read streamed response closes its socket
    return chunks


def test_faults_leave_the_server_serving(server):
    # --- 1. references, one request at a time ------------------------------------------------------------------
    refs: Dict[str, Dict[str, Any]] = {}
    for name, (body, check) in SURVIVORS.items():
        out = _ok(_post(server, dict(body, rid=f"ref-{name}")))
        assert check(out), (name, out)
        assert output_ids(out), (name, out)
        refs[name] = out
    wait_idle(server, 180)
    stats_before = server.stats()
    assert stats_before.get("runtime_errors") == [], stats_before

    # --- 2. faults, concurrently ---------------------------------------------------------------------------------
    jobs: Dict[str, Any] = {}
    with ThreadPoolExecutor(20) as pool:
        for name, (body, _) in SURVIVORS.items():
            jobs[name] = pool.submit(_post, server, dict(body, rid=f"survivor-{name}"))
        jobs["slow"] = pool.submit(_post, server, dict(SURVIVORS["json"][0], rid=f"{SLOW_MARKER}-1"))
        jobs["raise"] = pool.submit(_post, server, dict(SURVIVORS["json"][0], rid=f"{RAISE_MARKER}-1"))
        jobs["slow_matcher"] = pool.submit(_post, server, dict(SURVIVORS["json"][0], rid=f"{SLOW_MATCHER_MARKER}-1"))
        jobs["raise_matcher"] = pool.submit(_post, server, dict(SURVIVORS["json"][0], rid=f"{RAISE_MATCHER_MARKER}-1"))
        jobs["invalid_json"] = pool.submit(
            _post, server, _body("Broken:", json_schema='{"type": "object", "properties": {"a": {"type": "nope"}}'))
        jobs["invalid_range"] = pool.submit(
            _post, server, _body("Range:", json_schema=json.dumps({"type": "integer", "minimum": 5, "maximum": 1})))
        jobs["unsat"] = pool.submit(_post, server, _body("Nothing:", json_schema=json.dumps(UNSAT_SCHEMA)))
        for i in range(2):
            jobs[f"abort{i}"] = pool.submit(
                _post, server, _body("Abort me:", rid=f"eo-abort-{i}", max_new_tokens=1000, ignore_eos=True))
            jobs[f"disconnect{i}"] = pool.submit(_stream_and_disconnect, server, f"eo-disconnect-{i}")
        time.sleep(3.0)  # let the abort victims start
        for i in range(2):
            a = requests.post(server.base_url + "/abort_request", json={"rid": f"eo-abort-{i}"}, timeout=30)
            assert a.status_code == 200, a.text
        results = {name: f.result() for name, f in jobs.items()}

    # --- 3. what each request got --------------------------------------------------------------------------------
    for name, (_, check) in SURVIVORS.items():
        out = _ok(results[name])
        assert check(out), (name, out)
        assert output_ids(out) == output_ids(refs[name]), (name, output_ids(out), output_ids(refs[name]))
    for name in ("slow", "slow_matcher"):  # over the time limit: only slower, never different
        slow = _ok(results[name])
        assert output_ids(slow) == output_ids(refs["json"]), (name, output_ids(slow), output_ids(refs["json"]))
    for name, fault in (("raise", "injected grammar fault"), ("raise_matcher", "injected matcher fault")):
        err = _error_text(results[name])
        assert err is not None and "mask build failed" in err.lower() and fault in err.lower(), (
            name, results[name].status_code, results[name].text[:500])
    for name in ("invalid_json", "invalid_range"):
        err = _error_text(results[name])
        assert err is not None and any(w in err.lower() for w in ("schema", "json", "grammar")), (name, err)
    # xgrammar clamps the negated class to bytes <= 127, so with a byte-level vocabulary bytes >= 0x80 still match:
    # the request either fails with a clear grammar error or completes with a string the grammar terminated.
    err = _error_text(results["unsat"])
    if err is None:
        out = _ok(results["unsat"])
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and out["text"].startswith('"'), out
    else:
        assert any(w in err.lower() for w in ("grammar", "schema", "json")), err
    for i in range(2):
        out = results[f"abort{i}"].json()
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        assert meta.get("finish_reason", {}).get("type") == "abort", out
        assert meta["completion_tokens"] < 1000, meta
        assert results[f"disconnect{i}"] == 2

    # --- 4. idle: nothing leaked, the server still serves exactly ----------------------------------------------
    wait_idle(server, 180)
    checks = server.stats().get("idle_memory_checks", 0)
    deadline = time.monotonic() + 30
    while server.stats().get("idle_memory_checks", 0) <= checks and time.monotonic() < deadline:
        time.sleep(0.5)
    stats = server.stats()
    assert stats.get("idle_memory_checks", 0) > checks, stats  # SGLang's leak check ran again after the faults
    assert server.proc.poll() is None, server.log_tail()
    log = server.log_tail(2000).lower()
    assert "memory leak" not in log, server.log_tail(80)
    assert stats.get("runtime_errors") == [], stats
    assert stats.get("faults_raised", 0) >= 1 and stats.get("faults_slow_fills", 0) >= 2, stats
    # the matcher faults struck on the lockstep path: inside xgrammar's batched fill, and in the walk's accepts
    assert stats.get("faults_matcher_raised_in_batch_fill", 0) >= 1, stats
    assert stats.get("faults_matcher_batch_fills", 0) >= 1 and stats.get("faults_matcher_slow_accepts", 0) >= 2, stats
    assert "lockstep tree mask build failed (InjectedGrammarFault" in Path(server.log_path).read_text(errors="replace")
    aborted = set(stats.get("abort_requests", []))  # the scheduler was told to abort each victim, the
    for i in range(2):  # disconnected streams by SGLang's own disconnect detection
        assert f"eo-abort-{i}" in aborted and f"eo-disconnect-{i}" in aborted, stats.get("abort_requests")
    plugin = server.plugin_stats()
    assert plugin.get("active") is True, plugin
    assert plugin.get("mask_failures") == 2, plugin  # each raising request was caught by the plugin, once
    assert plugin.get("mask_timeouts", 0) >= 2, plugin  # both slow builds hit the time limit
    assert plugin.get("ledger_resets") == 0, plugin  # the ledger never saw a gap or a conflicting run
    after = _ok(_post(server, dict(SURVIVORS["json"][0], rid="after-faults")))
    assert output_ids(after) == output_ids(refs["json"])
    assert json.loads(after["text"]) == FOLLOWER_DOCUMENT
