"""Constrained requests under stress on ONE real ``python -m sglang.launch_server`` (EAGLE3 topk 4 + overlap, follower
pair, product plugin on), on both supported SGLang versions: the places where the plugin's accept ledger must still
feed every grammar each accepted token exactly once.

1. **Retraction.** A KV pool too small for the burst (``--max-total-tokens``) and no decode-token reservation at
   admission (``--schedule-conservativeness 0``): SGLang admits requests by their long prompts alone, runs out of KV
   while they decode and retracts some (``ScheduleBatch.retract_decode``: freed, re-queued, prefilled again later with
   their output so far and their grammar object kept). Every request is constrained, so every retraction retracts a
   constrained request; the CPU runtime counts them in the scheduler (:mod:`sglang_eo_dev.cpu_runtime.ledger_probe`).
2. **Aborts with a run in flight.** Constrained requests that stream tokens (so they are decoding, with a verify run
   in flight under overlap) are aborted by id (``/abort_request``) or by the client disconnecting, next to
   constrained requests that must survive.
3. **More than 64 live constrained requests.** Over 64 constrained requests decode at once while a few more arrive:
   their prefill results are small results that reach the ledger while it holds more than 64 requests, which is when
   the ledger prunes itself (it must forget only requests that left the engine).

Reference: the same request sent alone (greedy). The follower target is a bigram machine (its next token depends
only on the current token and the grammar mask), and every prompt of a kind ends with the same text, so the output of
one request of a kind sent alone is the reference of every request of that kind; outputs that break exactly-once (a
token fed twice or skipped changes the mask) differ from it or stop being valid.

Asserted after each burst: every surviving output is token-identical to its reference and valid for its grammar, the
plugin's ``ledger_resets == 0`` (the ledger never met a gap or a conflicting run), no constrained request still
running was forgotten by the ledger (``ledger_live_misses == 0``, checked in the scheduler after every batch result),
SGLang's own runtime recorded no error, and the engine's evidence that the stress happened (retracted constrained
requests; aborted requests; results while the ledger held more than 64 requests).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import jsonschema
import pytest
import requests

from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server
from sglang_eo_dev.cpu_runtime.ledger_probe import PRUNE_FLOOR
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA

from .common import EBNF, REGEX, ebnf_matches, output_ids, wait_idle

pytestmark = pytest.mark.engine

# KV pool: the retraction burst's prompts alone (24 x ~270 tokens) overfill it; the > 64 burst (74 short requests,
# ~70 tokens each with the speculative reservation) fits, so that burst is not retracted.
MAX_TOTAL_TOKENS = 6144
CFG = EngineConfig(pair="follower", spec="topk4", overlap=True, product_plugin=True, max_running_requests=80,
                   extra=(("max_total_tokens", MAX_TOTAL_TOKENS), ("schedule_conservativeness", 0.0)))

LONG_REGEX = "[a-z]{40}"  # ~40 single-token verify steps: keeps a request decoding while others arrive
VICTIM_REGEX = "[a-z]{400}"  # never allowed to finish: aborted after its first streamed tokens


@dataclass(frozen=True)
class Kind:
    """One kind of constrained request: its sampling parameters and the validity check of its output text."""

    params: Dict[str, Any]
    valid: Callable[[str], bool]


def _json_valid(text: str) -> bool:
    doc = json.loads(text)
    jsonschema.validate(doc, FOLLOWER_SCHEMA)
    return doc == FOLLOWER_DOCUMENT


# The follower's document, but with a title too long for it: the follower's drafts are accepted up to where its
# chain would close the string, then the grammar forces other tokens (partial accepts and rejections in one request).
LONG_TITLE_SCHEMA: Dict[str, Any] = {
    "type": "object",
    "properties": {"title": {"type": "string", "pattern": "^[A-Za-z ]{64}$"}},
    "required": ["title"],
    "additionalProperties": False,
}


def _long_json_valid(text: str) -> bool:
    doc = json.loads(text)
    jsonschema.validate(doc, LONG_TITLE_SCHEMA)
    return doc["title"].startswith(FOLLOWER_DOCUMENT["title"])


KINDS = {
    "json": Kind({"json_schema": json.dumps(FOLLOWER_SCHEMA), "max_new_tokens": 48}, _json_valid),
    "jsonlong": Kind({"json_schema": json.dumps(LONG_TITLE_SCHEMA), "max_new_tokens": 96}, _long_json_valid),
    "regex": Kind({"regex": REGEX, "max_new_tokens": 48}, lambda t: re.fullmatch(REGEX, t) is not None),
    "ebnf": Kind({"ebnf": EBNF, "max_new_tokens": 48}, ebnf_matches),
    "long": Kind({"regex": LONG_REGEX, "max_new_tokens": 64}, lambda t: re.fullmatch(LONG_REGEX, t) is not None),
}

# Filler that makes a retraction-burst prompt ~270 tokens; each prompt starts with its own number, so no two share a
# cached prefix (each holds its own KV).
_FILLER = " ".join(["the river runs under the bright morning light and the green hills wait"] * 16)


def _prompt(i: int, long: bool) -> str:
    return f"Record {i:03d}. " + (_FILLER if long else "") + " Answer:"


def _body(kind: str, i: int, long: bool = False, rid: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    body: Dict[str, Any] = {"text": _prompt(i, long),
                            "sampling_params": {"temperature": 0, **KINDS[kind].params, **extra}}
    if rid:
        body["rid"] = rid
    return body


def _post(server, body: Dict[str, Any], timeout: float = 300) -> requests.Response:
    return requests.post(server.base_url + "/generate", json=body, timeout=timeout)


def _ok(r: requests.Response) -> Dict[str, Any]:
    assert r.status_code == 200, (r.status_code, r.text[:500])
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    return out


@pytest.fixture(scope="module")
def server(engine_pool, tmp_path_factory):
    engine_pool.close()  # one engine at a time on this machine
    tmp = tmp_path_factory.mktemp("constrained-stress")
    srv = launch_server(CFG, log_path=str(tmp / "server.log"), stats_file=str(tmp / "stats.json"),
                        plugin_stats_file=str(tmp / "plugin-stats.json"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def references(server) -> Dict[str, List[int]]:
    """Each kind's output ids with its request sent alone (a short and a long prompt must agree: the outputs do not
    depend on the prompt before its common ending, which is what lets one reference stand for a kind)."""
    refs: Dict[str, List[int]] = {}
    for kind in KINDS:
        short = _ok(_post(server, _body(kind, 900, rid=f"ref-{kind}")))
        assert KINDS[kind].valid(short["text"]), (kind, short["text"])
        refs[kind] = output_ids(short)
        assert refs[kind], (kind, short)
    long = _ok(_post(server, _body("json", 901, long=True, rid="ref-json-long")))
    assert output_ids(long) == refs["json"], (long["text"], refs["json"])
    wait_idle(server, 120)
    return refs


def _plugin(server) -> Dict[str, Any]:
    stats = server.plugin_stats()
    assert stats.get("active") is True, stats
    return stats


def _check_survivors(results: Dict[str, requests.Response], kinds: Dict[str, str],
                     refs: Dict[str, List[int]]) -> None:
    for name, r in results.items():
        out = _ok(r)
        kind = kinds[name]
        assert KINDS[kind].valid(out["text"]), (name, out["text"])
        assert output_ids(out) == refs[kind], (name, out["text"], output_ids(out), refs[kind])


def _check_ledger(server, before: Dict[str, Any]) -> Dict[str, Any]:
    """The exactly-once evidence after a burst: no re-anchor, no live request forgotten, no runtime error."""
    wait_idle(server, 180)
    plugin = _plugin(server)
    assert plugin["ledger_resets"] == 0, plugin  # the ledger never met a gap or a conflicting run
    assert plugin["aborts"] == 0 and plugin["mask_failures"] == 0, plugin  # no grammar rejected a committed token
    stats = server.stats()
    assert stats.get("runtime_errors") == [], stats
    assert stats["ledger_live_misses"] == before.get("ledger_live_misses", 0), (
        f"the ledger forgot constrained requests that were still running: {stats.get('ledger_live_miss_rids')}")
    assert server.proc.poll() is None, server.log_tail()
    return stats


def test_retraction_of_constrained_requests(server, references):
    before = server.stats()
    names: Dict[str, str] = {}
    # first the requests that decode longest (~40 steps): those admitted first then outgrow the pool together
    kinds = ["jsonlong"] * 10 + ["long"] * 8 + ["json"] * 2 + ["regex"] * 2 + ["ebnf"] * 2
    with ThreadPoolExecutor(len(kinds)) as pool:
        jobs = {}
        for i, kind in enumerate(kinds):
            name = f"retract-{kind}-{i}"
            names[name] = kind
            jobs[name] = pool.submit(_post, server, _body(kind, i, long=True, rid=name))
        results = {name: f.result() for name, f in jobs.items()}
    _check_survivors(results, names, references)
    stats = _check_ledger(server, before)
    # SGLang retracted constrained requests of this burst (all of them are constrained), and they finished exactly
    retracted = stats["retracted_constrained"] - before.get("retracted_constrained", 0)
    assert retracted >= 1, ("no constrained request was retracted: the burst did not fill the KV pool", stats)
    assert set(stats["retracted_constrained_rids"]) <= set(names), stats["retracted_constrained_rids"]
    assert "KV cache pool is full. Retract requests." in server.log_tail(4000)


def _stream_tokens(server, body: Dict[str, Any], chunks: int, then: Callable[[], None]) -> Dict[str, Any]:
    """Stream ``body``; after ``chunks`` chunks call ``then()`` (the request is decoding: its tokens are arriving) and
    read on to the end of the stream. Returns the last chunk and how many chunks came before ``then``."""
    body = dict(body, stream=True)
    got, last = 0, None
    with requests.post(server.base_url + "/generate", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            last = json.loads(line[len(b"data:"):])
            got += 1
            if got == chunks:
                then()
    return {"last": last, "chunks": got}


def _stream_and_disconnect(server, body: Dict[str, Any], chunks: int) -> int:
    """Stream ``body``, read ``chunks`` chunks, then drop the connection (SGLang aborts the request)."""
    with requests.Session() as s:
        r = s.post(server.base_url + "/generate", json=dict(body, stream=True), stream=True, timeout=300)
        assert r.status_code == 200, r.text
        got = 0
        for line in r.iter_lines():
            if line and line.startswith(b"data:"):
                got += 1
            if got >= chunks:
                break
        r.close()
    return got


def test_abort_constrained_requests_with_a_run_in_flight(server, references):
    before = server.stats()
    victim_body = {"text": "Spell a long word:", "sampling_params": {"temperature": 0, "regex": VICTIM_REGEX,
                                                                      "max_new_tokens": 400}}
    names: Dict[str, str] = {}
    kinds = ["json", "regex", "ebnf", "long", "json", "long"]
    with ThreadPoolExecutor(len(kinds) + 2) as pool:
        jobs = {}
        for i, kind in enumerate(kinds):
            name = f"abort-survivor-{kind}-{i}"
            names[name] = kind
            jobs[name] = pool.submit(_post, server, _body(kind, 100 + i, rid=name))

        def abort() -> None:
            a = requests.post(server.base_url + "/abort_request", json={"rid": "abort-victim-rid"}, timeout=30)
            assert a.status_code == 200, a.text

        by_rid = pool.submit(_stream_tokens, server, dict(victim_body, rid="abort-victim-rid"), 3, abort)
        gone = pool.submit(_stream_and_disconnect, server, dict(victim_body, rid="abort-victim-disconnect"), 3)
        results = {name: f.result() for name, f in jobs.items()}
        aborted, disconnected = by_rid.result(), gone.result()
    _check_survivors(results, names, references)
    # the victim by id: it was decoding (3 chunks of its grammar-constrained output had arrived) and ended aborted
    assert aborted["chunks"] >= 3, aborted
    meta = aborted["last"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert 3 <= meta["completion_tokens"] < 400, meta
    assert re.fullmatch("[a-z]*", aborted["last"]["text"]), aborted["last"]["text"]  # valid prefix of its grammar
    assert disconnected == 3
    stats = _check_ledger(server, before)
    told = set(stats.get("abort_requests", []))
    assert {"abort-victim-rid", "abort-victim-disconnect"} <= told, stats.get("abort_requests")
    # the engine still serves a constrained request exactly after the aborts
    after = _ok(_post(server, _body("json", 199, rid="after-aborts")))
    assert output_ids(after) == references["json"]


def test_more_than_64_live_constrained_requests(server, references):
    before = server.stats()
    early = ["long", "jsonlong"] * 35  # 70 requests that keep decoding for 30-40 steps
    late = ["json", "regex", "ebnf", "json"]
    names: Dict[str, str] = {}
    with ThreadPoolExecutor(len(early) + len(late)) as pool:
        jobs = {}
        for i, kind in enumerate(early):
            name = f"many-{kind}-{i}"
            names[name] = kind
            jobs[name] = pool.submit(_post, server, _body(kind, 200 + i, rid=name))
        # once the early requests decode (a long one streams its tokens), the late ones arrive one by one: each is
        # a small prefill result reaching the ledger while it holds the early requests
        started: List[float] = []
        watch = pool.submit(_stream_tokens, server, _body("long", 290, rid="many-watch"), 2,
                            lambda: started.append(time.monotonic()))
        deadline = time.monotonic() + 120
        while not started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started, "the watched request never streamed its tokens"
        for j, kind in enumerate(late):
            name = f"many-late-{kind}-{j}"
            names[name] = kind
            jobs[name] = pool.submit(_post, server, _body(kind, 300 + j, rid=name))
            time.sleep(0.3)
        results = {name: f.result() for name, f in jobs.items()}
        watched = watch.result()
    _check_survivors(results, names, references)
    assert watched["last"]["meta_info"]["finish_reason"]["type"] == "stop", watched
    stats = _check_ledger(server, before)
    # the stress happened: the ledger held more than 64 requests while prefill results arrived
    assert stats["ledger_max_entries"] > PRUNE_FLOOR, stats
    assert stats["ledger_prefills_over_64"] > before.get("ledger_prefills_over_64", 0), stats
    assert stats["retracted_requests"] == before.get("retracted_requests", 0), "the > 64 burst must fit the KV pool"
