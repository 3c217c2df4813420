"""A real ``python -m sglang.launch_server`` (EAGLE3 + overlap, follower pair): OpenAI structured output, concurrent
JSON and free text, a bad schema fails only its own request, an aborted request frees its resources."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA

from .common import accept_length, running_requests, wait_idle

pytestmark = pytest.mark.engine

CFG = EngineConfig(pair="follower", spec="topk1", overlap=True, product_plugin=False)


@pytest.fixture(scope="module")
def server(engine_pool, tmp_path_factory):
    engine_pool.close()  # one engine at a time on this machine
    tmp = tmp_path_factory.mktemp("server")
    srv = launch_server(CFG, log_path=str(tmp / "server.log"), stats_file=str(tmp / "stats.json"))
    yield srv
    srv.stop()


def _generate(server, text, **params):
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 48, **params}}
    return requests.post(server.base_url + "/generate", json=body, timeout=120)


def test_openai_chat_completions_json_schema(server):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Describe the scene as JSON."}],
        "temperature": 0,
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "schema": FOLLOWER_SCHEMA}},
    }
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    doc = json.loads(content)
    jsonschema.validate(doc, FOLLOWER_SCHEMA)
    assert doc == FOLLOWER_DOCUMENT


def test_json_and_free_text_concurrently(server):
    schema = json.dumps(FOLLOWER_SCHEMA)
    jobs = [("json", {"json_schema": schema}), ("free", {}), ("json", {"json_schema": schema}), ("free", {}),
            ("regex", {"regex": r"(yes|no)\.[0-9]{2}"})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(_generate, server, f"Request {i}:", **p) for i, (_, p) in enumerate(jobs)]
        results = [f.result() for f in futures]
    for (kind, _), r in zip(jobs, results):
        assert r.status_code == 200, r.text
        out = r.json()
        if kind == "json":
            assert json.loads(out["text"]) == FOLLOWER_DOCUMENT
            assert accept_length(out["meta_info"]) >= 2.0, out["meta_info"]
        elif kind == "regex":
            assert re.fullmatch(r"(yes|no)\.[0-9]{2}", out["text"]), out["text"]
        else:
            assert out["text"], out


def test_invalid_schema_fails_only_that_request(server):
    r = _generate(server, "Broken:", json_schema='{"type": "object", "properties": {"a": {"type": "nope"}}')
    payload = r.text
    if r.status_code == 200:
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        payload = json.dumps(meta["finish_reason"])
    else:
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "schema" in payload.lower() or "json" in payload.lower() or "grammar" in payload.lower(), payload
    ok = _generate(server, "Valid:", json_schema=json.dumps(FOLLOWER_SCHEMA))
    assert ok.status_code == 200 and json.loads(ok.json()["text"]) == FOLLOWER_DOCUMENT


def test_aborted_request_frees_its_resources(server):
    rid = "eo-abort-me"
    holder = {}

    def long_request():
        holder["r"] = requests.post(
            server.base_url + "/generate",
            json={"text": "Go on forever:", "rid": rid,
                  "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}},
            timeout=300,
        )

    t = threading.Thread(target=long_request)
    t.start()
    # Abort as soon as the request runs (it would finish in a few seconds: the follower's drafts are all accepted).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running_requests(server.get_json("/v1/loads")) == 0:
        time.sleep(0.05)
    time.sleep(0.3)
    assert requests.post(server.base_url + "/abort_request", json={"rid": rid}, timeout=30).status_code == 200
    t.join(timeout=120)
    assert not t.is_alive()
    out = holder["r"].json()
    meta = out["meta_info"] if isinstance(out, dict) and "meta_info" in out else {}
    assert meta.get("finish_reason", {}).get("type") == "abort", (out, server.get_json("/v1/loads"))
    assert meta["completion_tokens"] < 1000
    # Idle again: SGLang's idle self-check raises on a KV/req-slot leak, which would kill the scheduler.
    wait_idle(server, 30)
    time.sleep(2.0)
    assert server.proc.poll() is None, server.log_tail()
    assert "leak" not in server.log_tail(400).lower(), server.log_tail()
    ok = _generate(server, "After abort:", json_schema=json.dumps(FOLLOWER_SCHEMA))
    assert ok.status_code == 200 and json.loads(ok.json()["text"]) == FOLLOWER_DOCUMENT


def test_server_stats_and_accept_length(server):
    stats = server.stats()
    assert stats.get("runtime_errors") == [], stats
    assert stats.get("overlap_enabled") is True, stats
    assert stats.get("grammar_decode_batches", 0) > 0, stats
