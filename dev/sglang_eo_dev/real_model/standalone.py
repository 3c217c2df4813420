"""A STANDALONE draft for SmolLM2-135M-Instruct: a layer-truncated copy of the target.

An honest imperfect draft: the target's embedding, its first :data:`LAYERS` decoder layers, its final norm and its
(tied) output head, with no training at all. It shares the tokenizer, so SGLang's STANDALONE worker runs it as an
ordinary small Llama. Built once per machine from the cached target folder, keyed by content (``cached``), in a few
seconds (a safetensors filter, no model load).

Call order: :func:`build_standalone` (idempotent; returns the cached folder).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

from sglang_eo_dev.real_model.target import cached, code_hash, log

__all__ = ["LAYERS", "build_standalone"]

LAYERS = 6  # of the target's 30


def build_standalone(target_dir: Path, layers: int = LAYERS) -> Path:
    """The first ``layers`` decoder layers of ``target_dir`` as an HF Llama folder (cached)."""
    key = "smollm2-standalone-" + hashlib.sha256(
        f"{target_dir.name}:{layers}:{code_hash(Path(__file__))}".encode()).hexdigest()[:12]

    def build(out: Path) -> None:
        from safetensors.torch import load_file, save_file

        t0 = time.monotonic()
        cfg = json.loads((target_dir / "config.json").read_text())
        if layers < 1 or layers > int(cfg["num_hidden_layers"]):
            raise ValueError(f"layers must be 1..{cfg['num_hidden_layers']}, got {layers}")
        state = load_file(str(target_dir / "model.safetensors"))
        keep = {}
        for name, t in state.items():
            m = re.match(r"model\.layers\.(\d+)\.", name)
            if m is None or int(m.group(1)) < layers:
                keep[name] = t.contiguous()
        save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in target_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
                shutil.copy(f, out / f.name)
        log(f"STANDALONE draft ({layers} of the target's layers) built in {time.monotonic() - t0:.0f} s: {out}")

    return cached(key, build)
