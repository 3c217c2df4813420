"""Constrained EAGLE3 demo on the real SGLang engine, with the sglang-eagle-overlap plugin.

Default (no arguments): CPU, tiny locally built models (the "json-follower" target + EAGLE3 draft pair, built once and
cached), EAGLE3 topk 1 / 3 steps, overlap scheduler on, xgrammar JSON schema. On a GPU machine:

    python scripts/demo.py --model-path meta-llama/Llama-3.1-8B-Instruct --draft-model-path <eagle3 draft>

Prints each output (and whether it parses and conforms), the accept length, how many grammar decode batches kept
the overlap, and the plugin's grammar time per verify step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

SCHEMA_GPU = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "skills"],
}


def _conforms(text: str, schema: dict) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="target model (GPU mode); default: tiny CPU model built locally")
    ap.add_argument("--draft-model-path", help="EAGLE3 draft model (GPU mode)")
    ap.add_argument("--topk", type=int, default=1, choices=[1, 4])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--plugin", choices=["on", "off"], default="on", help="off: SGLang's own path, for comparison")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="sglang-eo-demo-")
    plugin_stats = os.path.join(tmp, "plugin.json")
    os.environ["SGLANG_EAGLE_OVERLAP_STATS_FILE"] = plugin_stats
    os.environ["SGLANG_EAGLE_OVERLAP"] = "1" if args.plugin == "on" else "0"
    runtime_stats = None

    if args.model_path:
        if not args.draft_model_path:
            ap.error("--draft-model-path is required with --model-path")
        import sglang

        schema = SCHEMA_GPU
        prompts = [f"Describe person #{i} as JSON." for i in range(args.requests)]
        spec = {"speculative_num_steps": 3, "speculative_eagle_topk": args.topk,
                "speculative_num_draft_tokens": 4 if args.topk == 1 else 8}
        t0 = time.time()
        engine = sglang.Engine(model_path=args.model_path, speculative_algorithm="EAGLE3",
                               speculative_draft_model_path=args.draft_model_path, grammar_backend="xgrammar", **spec)
    else:
        from sglang_eo_dev.cpu_runtime import engine as cpu_engine
        from sglang_eo_dev.cpu_runtime import models

        schema = models.FOLLOWER_SCHEMA
        prompts = ["Write the record as JSON:", "JSON please:", "Give me the object:", "Output:"][: args.requests]
        prompts += [f"Record {i}:" for i in range(len(prompts), args.requests)]
        runtime_stats = os.path.join(tmp, "runtime.json")
        cfg = cpu_engine.EngineConfig(pair="follower", spec=f"topk{args.topk}", overlap=True,
                                      product_plugin=args.plugin == "on")
        print(f"[demo] building/reusing tiny models and starting the real SGLang engine on CPU ({cfg.describe()}) ...")
        t0 = time.time()
        engine = cpu_engine.start_engine(cfg, stats_file=runtime_stats)
    print(f"[demo] engine up in {time.time() - t0:.1f}s")
    try:
        sampling = {"temperature": 0.0, "max_new_tokens": 96, "json_schema": json.dumps(schema)}
        t0 = time.time()
        outs = engine.generate(prompts, sampling)
        wall = time.time() - t0
        total_tokens = 0
        steps = 0
        ok_all = True
        for p, o in zip(prompts, outs):
            meta = o["meta_info"]
            ok = _conforms(o["text"], schema)
            ok_all &= ok
            total_tokens += meta["completion_tokens"]
            steps += meta.get("spec_verify_ct") or 0
            print(f"\n> {p}\n{o['text']}\n  [{'valid JSON, conforms to schema' if ok else 'INVALID'}; "
                  f"{meta['completion_tokens']} tokens, finish={meta.get('finish_reason')}]")
        print("\n========== numbers ==========")
        print(f"requests: {len(prompts)}, generated tokens: {total_tokens}, wall {wall:.2f}s "
              f"({total_tokens / wall:.1f} tok/s)")
        if steps:
            print(f"accept length (tokens per verify step): {total_tokens / steps:.2f}")
        if runtime_stats and os.path.exists(runtime_stats):
            rs = json.load(open(runtime_stats))
            total = rs.get("grammar_decode_batches", 0)
            off = rs.get("overlap_disabled_grammar_decode_batches", 0)
            print(f"grammar decode batches: {total}, ran with overlap disabled: {off} "
                  f"-> overlap {'KEPT' if total and not off else 'not kept' if off else 'n/a'}")
        if os.path.exists(plugin_stats):
            from sglang_eagle_overlap.core.stats import StepStats

            ps = json.load(open(plugin_stats))
            m = StepStats(**{k: ps.get(k, 0) for k in ("steps", "advance_s", "tree_wait_s", "mask_s")}
                          ).per_step_ms()  # the plugin's own log numbers (grammar = advance + tree wait + mask)
            print(f"plugin: active={ps.get('active')} steps={ps.get('steps')} grammar time/step "
                  f"{m['grammar_ms']:.3f} ms (advance {m['advance_ms']:.3f}, tree wait {m['tree_wait_ms']:.3f}, "
                  f"mask {m['mask_ms']:.3f}), mask time-limit hits {ps.get('mask_timeouts', 0)}")
        elif args.plugin == "on":
            print("plugin: no stats file written (plugin inactive? check the engine log for 'sglang-eagle-overlap')")
        return 0 if ok_all else 1
    finally:
        engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
