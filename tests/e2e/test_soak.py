"""The server soak's short form (``benchmarks/soak.py``): a real ``python -m sglang.launch_server`` with the plugin,
the real pair (SmolLM2-135M-Instruct + its EAGLE3 draft), EAGLE3 + overlap, concurrent OpenAI-SDK clients sending
every kind the soak has (JSON schema, regex, EBNF, tool calls required and named, free text, streamed and not,
mid-stream disconnects, invalid and pathological grammars) for a short timed phase.

The soak itself decides pass or fail (a 5xx, an invalid completed output, a valid request rejected or aborted, an
invalid one accepted, a plugin counter that does not add up, the scheduler's RSS growing past its bound, the server
gone); this test runs it and requires exit status 0, then checks from its JSON report that the run covered what the
short form is for: every kind completed and checked (warm-up and timed phase together: 15 s of timed phase on the
real pair is about one request per client, too few to cycle through every kind), disconnects and rejections really
happened, and the plugin did grammar verify steps.

One server start, on SGLang 0.5.23 only (about 2 min with the start on a quiet machine; the full 10-minute soak on both bands is a
benchmark, ``benchmarks/results/soak_cpu_*.md``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.sglang_0_5_23]

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_serves_every_kind_and_its_checks_pass(engine_pool, tmp_path):
    engine_pool.close()  # one engine at a time on this machine
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration", "15", "--clients", "8",
           "--max-tokens", "64", "--out-dir", str(tmp_path), "--name", "soak"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"soak failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    r = json.loads((tmp_path / "soak.json").read_text())
    assert r["passed"] and r["failures"] == [] and r["counter_violations"] == []
    # What the run covered, warm-up (every kind and variant once) and timed phase together.
    seen: dict[str, dict[str, int]] = {}
    for phase in ("warmup", "timed"):
        for kind, k in r[phase]["by_kind"].items():
            for status, n in k["statuses"].items():
                seen.setdefault(kind, {})[status] = seen.get(kind, {}).get(status, 0) + n
    for kind in ("json", "regex", "ebnf", "tool_required", "tool_named", "free"):
        assert seen.get(kind, {}).get("ok", 0) >= 1, (kind, seen.get(kind))  # completed and checked
    assert seen["disconnect"].get("disconnected", 0) >= 1, seen["disconnect"]
    # every invalid request was rejected: the five of the warm-up and any of the timed phase
    assert set(seen["invalid"]) == {"rejected"} and seen["invalid"]["rejected"] >= 5, seen["invalid"]
    # a timed request recorded per client: a guard on the soak's own client loop (the report has no per-client rows,
    # and every recorded outcome, failed or not, counts here; failures are the soak's exit status above)
    assert r["timed"]["requests"] >= 8, r["timed"]
    assert r["plugin_stats"]["steps"] > 0 and r["plugin_stats"]["ledger_resets"] == 0, r["plugin_stats"]
    assert r["scheduler_rss_mib"]["end"] is not None
