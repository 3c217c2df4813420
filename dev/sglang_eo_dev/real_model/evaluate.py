"""Accept length of the real pair's draft on the held-apart prompts, on the real CPU SGLang engine.

Run (under the engine lock, from the repository root, with a CPU venv)::

    flock /tmp/sglang-engine.lock .venvs/sglang-0.5.23/bin/python -m sglang_eo_dev.real_model.evaluate \\
        --spec topk1 --spec topk4

For each speculative variant it starts one engine (EAGLE3, overlap on, plugin as ``--plugin``, the draft of
``--pair``: ``smollm2`` the chat-trained one, ``smollm2-json`` the JSON-trained one) and sends two held-apart batches:
the JSON-schema prompts constrained by their schemas (``constrained``), and the free-text chat prompts of
:mod:`.chat_prompts` (``free``). It prints, per variant and mode, the accept length = generated tokens / verify steps
summed over the requests (what SGLang's ``spec_verify_ct`` counts), and how many answers parse as JSON. ``--json``
prints the same as JSON.

Call order: :func:`chat_prompt` renders a request; :func:`measure` runs one engine; :func:`main` the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

__all__ = ["chat_prompt", "measure", "main", "parses_json"]


def parses_json(text: str) -> bool:
    """Whether ``text`` is one JSON document."""
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def chat_prompt(tokenizer, req) -> str:
    """``req`` rendered with the model's chat template, ready for ``Engine.generate(prompt=...)``."""
    from sglang_eo_dev.real_model.prompts import messages

    return tokenizer.apply_chat_template(messages(req), tokenize=False, add_generation_prompt=True)


def measure(spec: str, plugin: bool, max_new_tokens: int = 96, pair_name: str = "smollm2") -> dict[str, Any]:
    """Start one engine for ``spec`` and return accept lengths on the held-apart prompts: ``constrained`` (JSON
    schemas) and ``free`` (chat prompts, unconstrained)."""
    from transformers import AutoTokenizer

    from sglang_eo_dev.cpu_runtime.engine import EngineConfig, model_pair, start_engine
    from sglang_eo_dev.real_model.chat_prompts import chat_held_apart_requests
    from sglang_eo_dev.real_model.prompts import held_apart_requests

    cfg = EngineConfig(pair=pair_name, spec=spec, overlap=True, product_plugin=plugin)  # type: ignore[arg-type]
    pair = model_pair(cfg)
    tok = AutoTokenizer.from_pretrained(pair.target)
    batches = {"constrained": held_apart_requests(), "free": chat_held_apart_requests()}
    t0 = time.monotonic()
    engine = start_engine(cfg)
    result: dict[str, Any] = {"spec": spec, "plugin": plugin, "pair": pair_name,
                              "prompts": {m: len(r) for m, r in batches.items()}, "start_s": 0.0}
    try:
        result["start_s"] = round(time.monotonic() - t0, 1)
        base = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
        for mode, reqs in batches.items():
            prompts = [chat_prompt(tok, r) for r in reqs]
            params = [dict(base, json_schema=r.schema_json()) if mode == "constrained" else dict(base) for r in reqs]
            outs = engine.generate(prompt=prompts, sampling_params=params)
            tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
            verify = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
            parsed = sum(parses_json(o["text"]) for o in outs)
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
    ap.add_argument("--pair", choices=["smollm2", "smollm2-json"], default="smollm2",
                    help="smollm2: the chat-trained draft (default); smollm2-json: the JSON-trained one")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--show-texts", action="store_true")
    args = ap.parse_args(argv)
    results = [measure(s, args.plugin == "on", args.max_new_tokens, args.pair) for s in (args.spec or ["topk1"])]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        for mode in ("constrained", "free"):
            m = r[mode]
            print(f"{r['pair']} {r['spec']} plugin {'on' if r['plugin'] else 'off'} {mode:11s}: accept length "
                  f"{m['accept_length']} ({m['tokens']} tokens / {m['verify_steps']} verify steps, "
                  f"{m['json_parses']}/{r['prompts'][mode]} parse as JSON)")
            if args.show_texts:
                for t in m["texts"]:
                    print("   ", repr(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def offline_accept(target_dir: str, draft_dir: str, max_new_tokens: int = 80,
                   requests: list | None = None) -> dict[str, float]:
    """Accept length of a greedy topk-1 chain of 3 drafts, simulated without SGLang on the held-apart prompts: the
    target's constrained greedy answers (transformers + xgrammar, cached like the training data), then at each verify
    step the draft's 3-step chain from the accepted position (an estimate; the engine number is :func:`measure`'s).
    ``requests``: other prompts (default the held-apart JSON ones)."""
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from sglang_eo_dev.real_model import data, eagle3
    from sglang_eo_dev.real_model.prompts import held_apart_requests

    tdir, ddir = Path(target_dir), Path(draft_dir)
    samples = data.samples(tdir, held_apart_requests() if requests is None else requests, max_new_tokens)
    dcfg = json.loads((ddir / "config.json").read_text())
    cfg = dict(hidden=dcfg["hidden_size"], heads=dcfg["num_attention_heads"], kv_heads=dcfg["num_key_value_heads"],
               head_dim=dcfg["head_dim"], inter=dcfg["intermediate_size"], eps=dcfg["rms_norm_eps"],
               draft_vocab=dcfg["draft_vocab_size"], theta=dcfg["rope_theta"])
    draft = eagle3._modules(cfg)
    w = load_file(str(ddir / "model.safetensors"))
    state = {k.replace("midlayer.self_attn.", "").replace("midlayer.mlp.", "").replace("midlayer.", ""): v
             for k, v in w.items() if k not in ("d2t", "t2d")}
    draft.load_state_dict(state)
    hot = (w["d2t"] + torch.arange(w["d2t"].shape[0])).tolist()
    embed = load_file(str(tdir / "model.safetensors"))["model.embed_tokens.weight"].float()
    t2d = torch.full((embed.shape[0],), -100, dtype=torch.long)
    t2d[torch.tensor(hot)] = torch.arange(len(hot))
    tokens = steps = 0
    with torch.no_grad():
        for s in samples:
            # correct[k][i]: the draft's step k from position i predicts x[i+2+k] (inputs = the accepted tokens).
            correct = _step_hits(draft, s, embed, t2d, cfg)
            i, n = s.prompt_len - 1, len(s.ids)  # the first output token comes from the prefill
            while i + 2 < n:
                run = 0
                while run < 3 and i + 2 + run < n and correct[run][i]:
                    run += 1
                tokens += 1 + run
                steps += 1
                i += 1 + run
    return {"accept_length": tokens / steps if steps else 0.0, "verify_steps": steps, "prompts": len(samples)}


def _step_hits(draft, s, embed, t2d, cfg) -> list[list[bool]]:
    import torch

    from sglang_eo_dev.real_model.eagle3 import _rope_tables

    T = len(s.ids) - 1
    toks = torch.tensor(s.ids + [0] * 4)
    hidden = draft.fc(s.feats[:T].unsqueeze(0))
    causal = torch.full((T, T), float("-inf")).triu(1)
    pos = torch.arange(T).unsqueeze(0)
    past: list = []
    hits = []
    for k in range(3):
        cos, sin = _rope_tables(pos + k, cfg["head_dim"], cfg["theta"])
        hidden, kv = draft(embed[toks[1 + k:1 + k + T]].unsqueeze(0), hidden, cos, sin, past, causal)
        past.append(kv)
        pred = draft.logits(hidden)[0].argmax(-1)
        hits.append((pred == t2d[toks[2 + k:2 + k + T]]).tolist())
    return hits
