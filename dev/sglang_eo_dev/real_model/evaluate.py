"""Accept length of the real pair's draft on the held-apart prompts, on the real CPU SGLang engine.

Run (under the engine lock, from the repository root, with a CPU venv)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python -m sglang_eo_dev.real_model.evaluate \\
        --spec topk1 --spec topk4

For each speculative variant it starts one engine (EAGLE3, overlap on, plugin as ``--plugin``) and sends the
held-apart prompts twice as one batch each: JSON-schema constrained, and free. It prints, per variant and mode, the
accept length = generated tokens / verify steps summed over the requests (what SGLang's ``spec_verify_ct`` counts),
and for constrained answers how many parse as JSON. ``--json`` prints the same as JSON.

Call order: :func:`chat_prompt` renders a request; :func:`measure` runs one engine; :func:`main` the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["chat_prompt", "measure", "main"]


def chat_prompt(tokenizer, req) -> str:
    """``req`` rendered with the model's chat template, ready for ``Engine.generate(prompt=...)``."""
    from sglang_eo_dev.real_model.prompts import messages

    return tokenizer.apply_chat_template(messages(req), tokenize=False, add_generation_prompt=True)


def measure(spec: str, plugin: bool, max_new_tokens: int = 96) -> dict[str, Any]:
    """Start one engine for ``spec`` and return accept lengths (constrained / free) on the held-apart prompts."""
    from transformers import AutoTokenizer

    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair, start_engine
    from sglang_eo_dev.real_model.prompts import held_apart_requests

    cfg = EngineConfig(pair="smollm2", spec=spec, overlap=True, product_plugin=plugin)  # type: ignore[arg-type]
    pair = model_pair(cfg)
    tok = AutoTokenizer.from_pretrained(pair.target)
    reqs = held_apart_requests()
    prompts = [chat_prompt(tok, r) for r in reqs]
    t0 = time.monotonic()
    engine = start_engine(cfg)
    result: dict[str, Any] = {"spec": spec, "plugin": plugin, "prompts": len(reqs), "start_s": 0.0}
    try:
        result["start_s"] = round(time.monotonic() - t0, 1)
        base = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        for mode in ("constrained", "free"):
            params = [dict(base, json_schema=r.schema_json()) if mode == "constrained" else dict(base) for r in reqs]
            outs = engine.generate(prompt=prompts, sampling_params=params)
            tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
            verify = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
            parsed = 0
            for o in outs:
                try:
                    json.loads(o["text"])
                    parsed += 1
                except ValueError:
                    pass
            result[mode] = {"accept_length": round(tokens / verify, 3) if verify else None, "tokens": tokens,
                            "verify_steps": verify, "json_parses": parsed,
                            "texts": [o["text"] for o in outs]}
    finally:
        engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="append", choices=["topk1", "topk4"], help="speculative variant(s)")
    ap.add_argument("--plugin", choices=["on", "off"], default="on")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--show-texts", action="store_true")
    args = ap.parse_args(argv)
    results = [measure(s, args.plugin == "on", args.max_new_tokens) for s in (args.spec or ["topk1"])]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        for mode in ("constrained", "free"):
            m = r[mode]
            print(f"{r['spec']} plugin {'on' if r['plugin'] else 'off'} {mode:11s}: accept length "
                  f"{m['accept_length']} ({m['tokens']} tokens / {m['verify_steps']} verify steps, "
                  f"{m['json_parses']}/{r['prompts']} parse as JSON)")
            if args.show_texts:
                for t in m["texts"]:
                    print("   ", repr(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
