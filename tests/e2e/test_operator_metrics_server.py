"""Operator metrics and the overlap timeline from a real ``python -m sglang.launch_server --enable-metrics`` with the
plugin (EAGLE3 + overlap, follower pair, one server start): the plugin's Prometheus counters appear on SGLang's own
``/metrics`` endpoint, and the scheduler writes a timeline whose steps carry every phase in call order."""

from __future__ import annotations

import json
import re

import pytest
import requests

from sglang_eagle_overlap.core.timeline import GRAMMAR_PHASES, TIMELINE_ENV
from sglang_eo_dev.timeline_events import group_steps, load_events
from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA

pytestmark = pytest.mark.engine

CFG = EngineConfig(pair="follower", spec="topk1", overlap=True, product_plugin=True,
                   extra=(("enable_metrics", True),))


@pytest.fixture(scope="module")
def server(engine_pool, tmp_path_factory):
    engine_pool.close()  # one engine at a time on this machine
    tmp = tmp_path_factory.mktemp("metrics")
    mp = pytest.MonkeyPatch()
    mp.setenv(TIMELINE_ENV, str(tmp / "timeline.json"))  # launch_server passes os.environ to the server
    try:
        srv = launch_server(CFG, log_path=str(tmp / "server.log"), stats_file=str(tmp / "stats.json"))
    finally:
        mp.undo()
    srv.timeline_file = str(tmp / "timeline.json")
    yield srv
    srv.stop()


def _metric(text: str, name: str) -> float:
    vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)]
    assert vals, f"{name} not on /metrics"
    return sum(vals)


def test_metrics_and_timeline_after_constrained_requests(server):
    import time

    body = {"text": ["JSON:", "More JSON:"],
            "sampling_params": {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(FOLLOWER_SCHEMA)}}
    r = requests.post(server.base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert all(json.loads(o["text"]) == FOLLOWER_DOCUMENT for o in r.json())

    text = requests.get(server.base_url + "/metrics", timeout=30).text
    steps = _metric(text, "sglang_eagle_overlap:grammar_steps_total")
    grammar_s = _metric(text, "sglang_eagle_overlap:grammar_seconds_total")
    unhidden_s = _metric(text, "sglang_eagle_overlap:grammar_unhidden_seconds_total")
    assert steps >= 3 and grammar_s > 0
    # CPU: the forward is synchronous, so nothing is hidden: the un-hidden part is all of the grammar time
    # (measured from the mask step's start; grammar time from the same start).
    assert unhidden_s == pytest.approx(grammar_s, rel=0.05)
    assert _metric(text, "sglang_eagle_overlap:mask_timeouts_total") == 0  # tiny grammar, 50 ms limit: never hit

    time.sleep(1.0)  # the recorder thread rewrites the file every 0.25 s
    grouped = group_steps(load_events(server.timeline_file))
    assert len(grouped) >= steps - 1, (len(grouped), steps)
    for s in grouped:
        assert set(s["phases"]) == {*GRAMMAR_PHASES, "mask_apply"}, s
        assert s["tree_copy"] is not None and s["tree_copy"] <= 0  # async copy started before the launch
        starts = [s["phases"][p][0][0] for p in GRAMMAR_PHASES]
        # The grammar thread (default) starts the work right after the tree copy, while the CPU forward (synchronous
        # on the scheduler thread) runs; the upload comes after the one join, so after the forward.
        assert starts == sorted(starts) and starts[0] >= s["tree_copy"] - 1e-6
        assert s["phases"]["mask_upload"][0][0] >= s["forward"][1] - 1e-6
        assert s["sample"] >= s["phases"]["mask_upload"][0][1] - 1e-6
        assert s["phases"]["mask_apply"][0][0] >= s["sample"] - 1e-6  # the sampler applies the mask it was handed
