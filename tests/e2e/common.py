"""Prompts, grammars and small helpers shared by the engine tests."""

from __future__ import annotations

import json
from typing import Any

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a small city",
    "List of items:",
    "Summer morning by the river",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24}

# Short, bounded grammars so even the random model finishes inside max_new_tokens.
REGEX = r"(yes|no|maybe), [0-9]{2} (red|green|blue)\."
EBNF = 'root ::= "answer: " ("alpha" | "beta" | "gamma") " " [0-9] [0-9]? "."'


def ebnf_matches(text: str) -> bool:
    import re

    return re.fullmatch(r"answer: (alpha|beta|gamma) [0-9][0-9]?\.", text) is not None


def accept_length(meta: dict[str, Any]) -> float:
    """Tokens per verify step as SGLang reports it for one request (completion tokens / verify steps)."""
    verify = meta.get("spec_verify_ct") or 0
    return meta["completion_tokens"] / verify if verify else 0.0


def output_ids(out: dict[str, Any]) -> list[int]:
    """The generated token ids of one response (top level, or ``meta_info`` as some releases put them).

    Raises ``AssertionError`` naming the keys that are there when neither place has them: identity checks compare
    these lists, and two responses that both lack the field must never compare equal."""
    ids = out.get("output_ids")
    if ids is None:
        meta = out.get("meta_info") or {}
        ids = meta.get("output_ids")
        if ids is None:
            raise AssertionError(f"response has no output_ids (keys {sorted(out)}, meta_info keys {sorted(meta)}): "
                                 "identity checks need them")
    return [int(t) for t in ids]


def generate_cases(engine: Any, cases: dict[str, tuple[list[str], list[dict[str, Any]]]]
                   ) -> dict[str, list[tuple[str, list[int], dict[str, Any]]]]:
    """Each case (prompts, sampling params) as one batched ``generate``: per case, (text, output ids, finish reason)
    of every request in order."""
    out = {}
    for name, (prompts, params) in cases.items():
        res = engine.generate(prompt=prompts, sampling_params=params)
        out[name] = [(r["text"], output_ids(r), r["meta_info"]["finish_reason"]) for r in res]
    return out


def schema_str(schema: dict[str, Any]) -> str:
    return json.dumps(schema)


def running_requests(loads: Any) -> int:
    """Sum of running + queued requests in a ``/v1/loads`` answer (its shape varies across releases)."""
    total = 0

    def walk(node: Any) -> None:
        nonlocal total
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _LOAD_KEYS and isinstance(value, (int, float)):
                    total += int(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(loads)
    return total


_LOAD_KEYS = ("num_running_reqs", "num_waiting_reqs", "num_reqs", "running_reqs", "waiting_reqs")


def wait_idle(server: Any, timeout: float) -> None:
    """Poll ``/v1/loads`` until nothing runs or waits; fail if the server process died or it is still busy after
    ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    loads = None
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log_tail()
        loads = server.get_json("/v1/loads")
        if running_requests(loads) == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"server not idle after {timeout} s: {loads}")


def run_cases_on_patched_server(root: Any, tmp_path: Any, cases: dict, mark_env: dict[str, str],
                                spec: str = "topk4") -> tuple[dict, dict, str]:
    """Serve ``cases`` from ``python -m sglang.launch_server`` with the patched SGLang copy at ``root`` first on
    ``PYTHONPATH`` (the product package installed and switched on: its plugin must stand aside, the patch's call sites
    run the integration; random pair, greedy EAGLE3 ``spec``). ``mark_env`` is set for the server's processes.
    Returns ``(outputs per case, runtime stats, server log tail)``; the environment is restored and the server
    stopped whatever happens.

    A separate server process, not an in-process Engine: its spawned scheduler inherits the copy on ``sys.path`` (an
    in-process Engine would hand this process's already imported, unpatched ``sys.path`` to the scheduler).
    """
    import os
    import urllib.request

    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, launch_server

    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), old) if p)
    os.environ.update(mark_env)
    server = None
    try:
        server = launch_server(EngineConfig(pair="random", spec=spec, product_plugin=True),
                               str(tmp_path / "server.log"), stats_file=str(tmp_path / "runtime-stats.json"))
        got = {}
        for case, (prompts, params) in cases.items():
            body = json.dumps({"text": prompts, "sampling_params": params}).encode()
            req = urllib.request.Request(server.base_url + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                outs = json.loads(r.read().decode())
            got[case] = [(o["text"], output_ids(o), o["meta_info"]["finish_reason"]) for o in outs]
        return got, server.stats(), server.log_tail(200)
    finally:
        if server is not None:
            server.stop()
        os.environ["PYTHONPATH"] = old
        for key in mark_env:
            os.environ.pop(key, None)
