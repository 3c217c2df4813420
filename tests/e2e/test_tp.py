"""Tensor parallelism: the plugin at TP 2 on the real engine, every supported SGLang.

SGLang runs one scheduler process per TP rank; each compiles its requests' grammars, builds its own tree mask and
advances its own matchers. On CPU the ranks all-reduce over gloo (``engine.py``: ``tp_size``). Follower pair, EAGLE3
topk 1 and topk 4 under the overlap scheduler, plugin on (and off on 0.5.16), the cases of ``test_plugin_equivalence``
(JSON schema, regex + EBNF, a mixed constrained / free batch):

* greedy output token-identical to non-speculative greedy at TP 1 (that module's baseline, shared through the pool);
* no grammar decode batch taken out of the overlap with the plugin (0.5.16 without it: every one), on every rank;
* every rank's plugin stats (``<stem>.rank<r>.json``) agree on what the step did: verify steps, tokens advanced,
  barrier runs, replays, aborts, failures, resets; no runtime hook error on any rank;
* with the plugin on, a request whose grammar raises during the mask build (``SGLANG_EO_FAULTS``) fails alone, with
  the plugin's error, counted once as a mask failure on every rank alike, while the requests sent with it are
  token-identical to the baseline;
* one rank slower than the other (a grammar whose mask build on rank 1 only takes longer than the plugin's time limit)
  changes no token: at TP > 1 the plugin builds every rank's mask without the wall-clock limit, so the ranks cannot
  disagree about which drafts to keep.

Engine starts: 3 at TP 2 on 0.5.16 (topk 1 / 4 plugin on, topk 1 plugin off), 2 on 0.5.23 (plugin on), plus the TP 1
baseline when ``test_plugin_equivalence`` did not already run in the session.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Dict, List, Optional

import pytest

from sglang_eo_dev.cpu_runtime.engine import EngineConfig
from sglang_eo_dev.cpu_runtime.faults import ENV_FLAG as FAULTS_ENV
from sglang_eo_dev.cpu_runtime.faults import RAISE_MARKER, RANK1_SLOW_MARKER
from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA
from sglang_eo_dev.cpu_runtime.stats import read_rank_stats

from .common import output_ids
from .test_plugin_equivalence import CASES, PARAMS
from .test_plugin_equivalence import _run as run_tp1
from .test_plugin_equivalence import _run_all as run_cases

pytestmark = pytest.mark.engine

TP = 2
PLUGIN_STATS_ENV = "SGLANG_EAGLE_OVERLAP_STATS_FILE"
# What every rank's plugin must have done identically (the rank-local timings and pids aside).
SAME_ON_EVERY_RANK = ("steps", "tokens_advanced", "barrier_runs", "replays", "aborts", "mask_failures",
                      "ledger_resets", "fallback_steps", "overlap_kept", "mask_timeouts")
# ... and, without injected faults, the grammar-forced drafts (the fault batch's rank-1-slow request takes the generic
# walk on rank 1 only, which records no forced continuations; ranks of a real deployment take the same path)
SAME_FORCED_ON_EVERY_RANK = ("forced_nodes", "forced_proposed")
FAULT_RIDS = {"json": "tp-json", "raise": f"tp-{RAISE_MARKER}", "rank1_slow": f"tp-{RANK1_SLOW_MARKER}",
              "free": "tp-free"}
MASK_LIMIT_ENV = "SGLANG_EAGLE_OVERLAP_MASK_TIME_LIMIT_MS"
MASK_LIMIT_MS = 40  # the rank-1-slow grammar sleeps 25 ms per row on rank 1: past the limit at its second row


def _tp_cfg(spec: str, plugin: bool) -> EngineConfig:
    # grammar-forced drafts switched on (EAGLE3's default is off): every rank must replace the same drafts
    return EngineConfig(pair="follower", spec=spec, overlap=True, product_plugin=plugin, tp_size=TP,
                        forced_drafts=True if plugin else None)


def _settled(read, *keys: str, timeout: float = 30.0) -> List[Dict[str, Any]]:
    """Every rank's stats once they agree on ``keys`` (the last step's write on the other rank may trail the result
    this process got by a moment); the last reading if they never do (the tests then show the disagreement)."""
    deadline = time.monotonic() + timeout
    while True:
        ranks = read()
        agree = all(ranks) and all(len({r.get(k) for r in ranks}) == 1 for k in keys)
        if agree or time.monotonic() > deadline:
            return ranks
        time.sleep(0.2)


async def _fault_batch(engine) -> Dict[str, Any]:
    """Concurrently (one generate each: a non-streamed request that fails raises in its own call): a JSON request,
    one whose grammar raises in the plugin's mask build, one whose mask build is slow on rank 1 only, a free one."""
    schema = json.dumps(FOLLOWER_SCHEMA)
    json_params = dict(PARAMS, json_schema=schema)
    params = {"json": json_params, "raise": json_params, "rank1_slow": json_params, "free": PARAMS}
    prompts = {"json": CASES["json_schema"][0][0], "raise": CASES["json_schema"][0][1],
               "rank1_slow": CASES["json_schema"][0][2], "free": CASES["mixed_batch"][0][1]}
    names = list(FAULT_RIDS)
    outs = await asyncio.gather(
        *(engine.async_generate(prompt=prompts[n], sampling_params=params[n], rid=FAULT_RIDS[n]) for n in names),
        return_exceptions=True,
    )
    return dict(zip(names, outs))


def _run_tp(engine_pool, spec: str, plugin: bool) -> Dict[str, Any]:
    """Start (once per session) the TP 2 engine, send every case, then the fault batch with the plugin on."""
    cfg = _tp_cfg(spec, plugin)
    key = ("tp", cfg)
    if key in engine_pool.cache:
        return engine_pool.cache[key]
    plugin_stats = os.path.join(engine_pool.tmp_dir, f"tp-plugin-stats-{cfg.describe()}.json")
    saved = {k: os.environ.get(k) for k in (PLUGIN_STATS_ENV, FAULTS_ENV, MASK_LIMIT_ENV)}
    os.environ[PLUGIN_STATS_ENV] = plugin_stats
    if plugin:
        os.environ[FAULTS_ENV] = "1"  # only rids carrying a marker are touched
        os.environ[MASK_LIMIT_ENV] = str(MASK_LIMIT_MS)
    try:
        engine = engine_pool.get(cfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    got: Dict[str, Any] = {"results": run_cases(engine)}
    read_plugin = lambda: read_rank_stats(plugin_stats, TP)  # noqa: E731
    read_runtime = lambda: read_rank_stats(engine_pool.stats_file, TP)  # noqa: E731
    got["plugin"] = _settled(read_plugin, "steps") if plugin else read_plugin()
    got["runtime"] = _settled(read_runtime, "grammar_decode_batches")
    if plugin:
        got["faults"] = engine.loop.run_until_complete(_fault_batch(engine))
        got["plugin_after_faults"] = _settled(read_plugin, "mask_failures", "steps")
        got["runtime_after_faults"] = _settled(read_runtime, "faults_raised", "grammar_decode_batches")
    got["plugin_files_at_tp1_path"] = os.path.exists(plugin_stats)
    engine_pool.cache[key] = got
    return got


# Plugin on: topk 1 and 4; plugin off (stock SGLang under TP): topk 1 on 0.5.16 only, where stock forces grammar
# batches out of the overlap and the plugin's off switch must restore exactly that -- each TP 2 engine start costs
# most of a minute on 2 cores, and stock's behaviour does not depend on the tree shape.
TP_CASES = [("topk1", True), ("topk4", True), pytest.param("topk1", False, marks=pytest.mark.sglang_0_5_16)]
TP_IDS = ["topk1-plugin-on", "topk4-plugin-on", "topk1-plugin-off"]


@pytest.fixture(scope="module")
def baseline(engine_pool):
    return run_tp1(engine_pool, EngineConfig(pair="follower", spec=None, overlap=True, product_plugin=False))[0]


@pytest.mark.parametrize("spec,plugin", TP_CASES, ids=TP_IDS)
def test_tp2_token_identical_to_tp1_nonspec(engine_pool, baseline, spec, plugin):
    got = _run_tp(engine_pool, spec, plugin)["results"]
    for case in CASES:
        for i, (have, want) in enumerate(zip(got[case], baseline[case], strict=True)):
            assert have[1] == want[1], f"TP{TP} {spec} plugin={plugin} {case}[{i}]: {have[0]!r} vs TP1 {want[0]!r}"
            assert have[0] == want[0] and have[2] == want[2]


# Plugin on: topk 1 and 4; plugin off (stock SGLang under TP): topk 1 only -- each TP 2 engine start costs minutes
# on 2 cores, and stock's behaviour does not depend on the tree shape.
@pytest.mark.parametrize("spec,plugin", TP_CASES, ids=TP_IDS)
def test_tp2_every_rank_keeps_grammar_batches_in_overlap(engine_pool, sglang_version, spec, plugin):
    runtime = _run_tp(engine_pool, spec, plugin)["runtime"]
    assert [r.get("rank") for r in runtime] == list(range(TP)), runtime
    assert len({r["pid"] for r in runtime}) == TP, runtime
    for r in runtime:
        assert r.get("runtime_errors") == [] and r.get("overlap_enabled") is True, r
        assert r.get("grammar_decode_batches", 0) > 0, r
    # every rank ran the same grammar decode batches and made the same overlap decision for each
    assert len({r["grammar_decode_batches"] for r in runtime}) == 1, runtime
    assert len({r["overlap_disabled_grammar_decode_batches"] for r in runtime}) == 1, runtime
    disabled = runtime[0]["overlap_disabled_grammar_decode_batches"]
    if plugin or sglang_version[:3] != (0, 5, 16):
        assert disabled == 0, runtime
    else:
        assert disabled == runtime[0]["grammar_decode_batches"], runtime


@pytest.mark.parametrize("spec", ["topk1", "topk4"])
def test_tp2_every_rank_plugin_did_the_same_steps(engine_pool, spec):
    got = _run_tp(engine_pool, spec, True)
    plugin = got["plugin"]
    assert not got["plugin_files_at_tp1_path"], "with TP 2 no rank may write the single-rank stats path"
    assert [p.get("rank") for p in plugin] == list(range(TP)) and {p.get("world_size") for p in plugin} == {TP}
    for p in plugin:
        assert p["active"] is True and p["steps"] > 0 and p["tokens_advanced"] > 0, p
        assert p["forced_drafts"] is True, p  # switched on in _tp_cfg: the same table on every rank
        assert p["aborts"] == 0 and p["mask_failures"] == 0 and p["ledger_resets"] == 0, p
    for name in SAME_ON_EVERY_RANK + SAME_FORCED_ON_EVERY_RANK:
        assert len({p[name] for p in plugin}) == 1, (name, [p[name] for p in plugin])


@pytest.mark.sglang_0_5_16  # the plugin-off TP engine runs on 0.5.16 only (TP_CASES)
def test_tp2_plugin_off_no_rank_writes_stats(engine_pool):
    off = _run_tp(engine_pool, "topk1", False)["plugin"]
    assert off == [{}] * TP, f"plugin off (SGLANG_EAGLE_OVERLAP=0) but a rank wrote stats: {off}"


@pytest.mark.parametrize("spec", ["topk1", "topk4"])
def test_tp2_raising_grammar_fails_its_request_alone_on_every_rank(engine_pool, baseline, spec):
    got = _run_tp(engine_pool, spec, True)
    faults = got["faults"]
    err = faults["raise"]
    assert isinstance(err, Exception), f"the raising grammar's request did not fail: {err!r}"
    text = str(getattr(err, "detail", err)).lower()
    assert "mask build failed" in text and "injected grammar fault" in text, text
    ok = faults["json"]
    assert not isinstance(ok, Exception), ok
    assert output_ids(ok) == baseline["json_schema"][0][1] and json.loads(ok["text"]) == FOLLOWER_DOCUMENT
    free = faults["free"]
    assert not isinstance(free, Exception), free
    assert output_ids(free) == baseline["mixed_batch"][1][1]
    before, after = got["plugin"], got["plugin_after_faults"]
    for r in range(TP):
        assert after[r]["mask_failures"] == before[r]["mask_failures"] + 1, (r, before[r], after[r])
        assert after[r]["ledger_resets"] == 0, after[r]
    for name in SAME_ON_EVERY_RANK:
        assert len({p[name] for p in after}) == 1, (name, [p[name] for p in after])
    runtime = got["runtime_after_faults"]
    for r in runtime:
        assert r.get("faults_raised", 0) >= 1 and r.get("runtime_errors") == [], r
    assert len({r["faults_raised"] for r in runtime}) == 1, runtime


@pytest.mark.parametrize("spec", ["topk1", "topk4"])
def test_tp2_one_slow_rank_changes_no_token(engine_pool, baseline, spec):
    got = _run_tp(engine_pool, spec, True)
    slow = got["faults"]["rank1_slow"]
    assert not isinstance(slow, Exception), slow
    # rank 1 alone built slowly; the output is still the TP 1 one (the ranks kept the same drafts)
    assert output_ids(slow) == baseline["json_schema"][2][1], (slow["text"], baseline["json_schema"][2][0])
    runtime = got["runtime_after_faults"]
    assert runtime[0].get("faults_slow_fills", 0) == 0 and runtime[1].get("faults_slow_fills", 0) >= 2, runtime
    after = got["plugin_after_faults"]
    assert [p["mask_timeouts"] for p in after] == [0] * TP, after
