#!/usr/bin/env bash
# Create (idempotently, cached) a CPU virtualenv with the real SGLang + xgrammar for one supported version.
#
#   scripts/setup_cpu_env.sh 0.5.23        -> .venvs/sglang-0.5.23
#   scripts/setup_cpu_env.sh 0.5.16        -> .venvs/sglang-0.5.16
#
# Recipe (see docs in README "CPU test environment"): torch 2.13.0 CPU, then the packages whose metadata would drag
# in a CUDA torch (sglang, xgrammar, compressed-tensors, torchvision) with --no-deps, then the pure-Python / CPU deps
# SGLang's engine imports. A stamp file records a hash of this script and the version, so a re-run is a no-op.
set -euo pipefail
VER="${1:?usage: setup_cpu_env.sh <sglang-version>}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_EO_VENV_DIR:-$ROOT/.venvs}/sglang-$VER"
PY="${PYTHON:-python3.11}"

case "$VER" in
  0.5.16) XGR=0.2.1; TRANSFORMERS=5.12.1; TOKENIZERS=0.22.2; OPENAI=2.6.1; TVMFFI=0.1.11 ;;
  0.5.23) XGR=0.2.7; TRANSFORMERS=5.19.0; TOKENIZERS=""; OPENAI=""; TVMFFI="" ;;
  *) echo "unsupported SGLang version '$VER' (supported: 0.5.16, 0.5.23)" >&2; exit 2 ;;
esac

STAMP="$VENV/.sglang-eo-stamp"
WANT="$(sha256sum < "$0" | cut -c1-16)-$VER"
install_local() {
  # The plugin itself and the test-only CPU runtime plugin, editable, so their entry points are registered.
  local want_local; want_local="$(cat "$ROOT/pyproject.toml" "$ROOT/dev/pyproject.toml" | sha256sum | cut -c1-16)"
  if [[ -f "$VENV/.local-stamp" && "$(cat "$VENV/.local-stamp")" == "$want_local" ]]; then return 0; fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e "$ROOT" -e "$ROOT/dev" >/dev/null 2>&1
  echo "$want_local" > "$VENV/.local-stamp"
}
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  install_local
  exit 0
fi
echo "[setup] building $VENV" >&2
rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
CONSTRAINTS="$VENV/constraints.txt"
{
  echo "torch==2.13.0"
  echo "transformers==$TRANSFORMERS"
  [[ -n "$TOKENIZERS" ]] && echo "tokenizers==$TOKENIZERS"
  [[ -n "$OPENAI" ]] && echo "openai==$OPENAI"
  [[ -n "$TVMFFI" ]] && echo "apache-tvm-ffi==$TVMFFI"
  true
} > "$CONSTRAINTS"
"${PIP[@]}" --upgrade pip wheel setuptools
# CPU torch (a local wheel on this kind of machine; otherwise the CPU index of PyTorch is not reachable, so the
# registry's build is used, which also runs on CPU).
"${PIP[@]}" -c "$CONSTRAINTS" "torch==2.13.0"
"${PIP[@]}" --no-deps "sglang==$VER" "xgrammar==$XGR" compressed-tensors torchvision
"${PIP[@]}" -c "$CONSTRAINTS" \
  "transformers==$TRANSFORMERS" ${TOKENIZERS:+"tokenizers==$TOKENIZERS"} ${OPENAI:+"openai==$OPENAI"} \
  ${TVMFFI:+"apache-tvm-ffi==$TVMFFI"} apache-tvm-ffi \
  triton dill pyzmq uvloop msgspec orjson pybase64 setproctitle sentencepiece gguf partial_json_parser einops \
  IPython loguru fastapi uvicorn starlette openai jsonschema soundfile python-multipart \
  aiohttp requests numpy pillow psutil pydantic tqdm packaging prometheus-client interegular llguidance \
  tiktoken safetensors huggingface_hub scipy blobfile==3.0.0 watchfiles zstandard distro easydict \
  anthropic nvidia-ml-py pytest hypothesis matplotlib datasets pyyaml ninja py-spy "numba" \
  torchao==0.17.0 2>&1 | grep -v "^$" >&2 || true
"$VENV/bin/python" - <<PYEOF
import importlib.metadata as md
assert md.version("sglang") == "$VER", md.version("sglang")
import torch, xgrammar
print("[setup] torch", torch.__version__, "xgrammar", md.version("xgrammar"), "sglang", md.version("sglang"))
PYEOF
echo "$WANT" > "$STAMP"
install_local
