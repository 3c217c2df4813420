#!/usr/bin/env bash
# Create (idempotently, cached) a CPU virtualenv with the real SGLang + xgrammar for one supported version.
#
#   scripts/setup_cpu_env.sh 0.5.23        -> .venvs/sglang-0.5.23
#   scripts/setup_cpu_env.sh 0.5.16        -> .venvs/sglang-0.5.16
#
# Cost of a first build (docs/development.md): ~2 min (measured, fast network) to 5 min and 3.4 GB per version;
# a re-run is a no-op (a stamp file records a hash of this script and the version).
#
# Recipe (why each step: docs/development.md and the comments below): torch 2.13.0 CPU, then the packages whose
# metadata would drag in a CUDA torch (sglang, xgrammar, compressed-tensors, torchvision) with --no-deps, then the
# pure-Python / CPU dependencies SGLang's engine imports. Every pip call must succeed: a failure stops the build
# with pip's own error and no stamp is written.
#
# Environment: PYTHON=/path/to/python3.x (default: the first of python3.11, python3.12, python3.13, python3 that is
# >= 3.11 and can create venvs), SGLANG_EO_VENV_DIR (default: <repo>/.venvs).
set -euo pipefail
VER="${1:?usage: setup_cpu_env.sh <sglang-version>}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${SGLANG_EO_VENV_DIR:-$ROOT/.venvs}/sglang-$VER"

case "$VER" in
  0.5.16) XGR=0.2.1; TRANSFORMERS=5.12.1; TOKENIZERS=0.22.2; OPENAI=2.6.1; TVMFFI=0.1.11 ;;
  0.5.23) XGR=0.2.7; TRANSFORMERS=5.19.0; TOKENIZERS=""; OPENAI=""; TVMFFI="" ;;
  *) echo "[setup] unsupported SGLang version '$VER' (supported: 0.5.16, 0.5.23)" >&2; exit 2 ;;
esac

# A usable interpreter: SGLang 0.5.23 needs Python >= 3.11, and the CPU recipe was measured on 3.11. Each candidate
# is run, not just looked up: a pyenv shim exists for every version pyenv knows but fails unless it is selected.
usable_python() {
  "$1" - <<'PYEOF' >/dev/null 2>&1
import sys, venv, ensurepip  # venv + ensurepip: Debian splits them into python3.x-venv
sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)
PYEOF
}
find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    usable_python "$PYTHON" && { echo "$PYTHON"; return 0; }
    echo "[setup] PYTHON=$PYTHON is not a usable Python >= 3.11 with the venv module" >&2
    return 1
  fi
  local c
  for c in python3.11 python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && usable_python "$c"; then echo "$c"; return 0; fi
  done
  echo "[setup] no usable Python found: need Python >= 3.11 with the venv module (SGLang 0.5.23 requires 3.11;" \
       "the CPU recipe is measured on 3.11). Install python3.11 (Debian/Ubuntu: apt-get install python3.11" \
       "python3.11-venv) or point PYTHON=/path/to/python3.11 at one." >&2
  return 1
}

# pip, with the known harmless noise reduced to one line each and pip's exit status kept:
# * the --no-deps packages (sglang, xgrammar, torchvision, compressed-tensors) declare CUDA-only dependencies and exact
#   pins this CPU venv deliberately leaves out or replaces; pip's resolver lists each after every later install;
# * "Location ... is ignored" lines come from a pip configuration (extra index / find-links) naming folders that
#   do not exist on this machine.
# Anything else pip prints (real errors included) passes through unchanged.
run_pip() {
  local rc
  set +e
  "${PIP[@]}" "$@" 2>&1 | awk '
    /^ERROR: pip.s dependency resolver does not currently take into account/ { inres = 1; next }
    inres && (/ requires .*, which is not installed\.$/ || /, but you have .* which is incompatible\.$/) { n++; next }
    /^WARNING: Location .* is ignored: it is neither a file nor a directory\.$/ { loc++; next }
    { inres = 0; print }
    END {
      if (n) print "[setup] expected: pip listed " n " declared dependencies of the --no-deps packages (CUDA-only" \
                   " packages, exact pins) as missing or different; the CPU venv leaves them out on purpose" \
                   " (docs/troubleshooting.md, \"Expected warnings\")"
      if (loc) print "[setup] note: pip ignored " loc " index locations from your pip configuration that do not exist"
    }' >&2
  rc=${PIPESTATUS[0]}
  set -e
  if [[ $rc -ne 0 ]]; then
    echo "[setup] FAILED: pip install $* (exit $rc); the venv $VENV is incomplete and will be rebuilt next run" >&2
    exit "$rc"
  fi
}

STAMP="$VENV/.sglang-eo-stamp"
WANT="$(sha256sum < "$0" | cut -c1-16)-$VER"
install_local() {
  # The plugin itself and the test-only CPU runtime plugin, editable, so their entry points are registered.
  local want_local out; want_local="$(cat "$ROOT/pyproject.toml" "$ROOT/dev/pyproject.toml" | sha256sum | cut -c1-16)"
  if [[ -f "$VENV/.local-stamp" && "$(cat "$VENV/.local-stamp")" == "$want_local" ]]; then return 0; fi
  if ! out="$("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
      -e "$ROOT" -e "$ROOT/dev" 2>&1)"; then
    echo "$out" >&2
    echo "[setup] FAILED: editable install of the plugin and dev/ into $VENV" >&2
    exit 1
  fi
  echo "$want_local" > "$VENV/.local-stamp"
}
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  install_local
  exit 0
fi
PY="$(find_python)"
echo "[setup] building $VENV with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')" \
     "(first time: 2-5 min, 3.4 GB)" >&2
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
run_pip --upgrade pip wheel setuptools
# CPU torch (a local wheel on this kind of machine; otherwise the CPU index of PyTorch is not reachable, so the
# registry's build is used, which also runs on CPU).
run_pip -c "$CONSTRAINTS" "torch==2.13.0"
run_pip --no-deps "sglang==$VER" "xgrammar==$XGR" compressed-tensors torchvision
run_pip -c "$CONSTRAINTS" \
  "transformers==$TRANSFORMERS" ${TOKENIZERS:+"tokenizers==$TOKENIZERS"} ${OPENAI:+"openai==$OPENAI"} \
  ${TVMFFI:+"apache-tvm-ffi==$TVMFFI"} apache-tvm-ffi \
  triton dill pyzmq uvloop msgspec orjson pybase64 setproctitle sentencepiece gguf partial_json_parser einops \
  IPython loguru fastapi uvicorn starlette openai jsonschema soundfile python-multipart \
  aiohttp requests numpy pillow psutil pydantic tqdm packaging prometheus-client interegular llguidance \
  tiktoken safetensors huggingface_hub scipy blobfile==3.0.0 watchfiles zstandard distro easydict \
  anthropic nvidia-ml-py pytest hypothesis matplotlib datasets pyyaml ninja py-spy "numba" \
  torchao==0.17.0
# Fail here, not at the first engine start, if an import the CPU runtime relies on is missing.
"$VENV/bin/python" - <<PYEOF
import importlib.metadata as md
got = md.version("sglang")
if got != "$VER":
    raise SystemExit(f"[setup] FAILED: sglang {got} installed, expected $VER")
import torch, xgrammar, transformers, triton, zmq, uvloop, fastapi, jsonschema, pytest, hypothesis  # noqa: F401
print("[setup] torch", torch.__version__, "xgrammar", md.version("xgrammar"), "sglang", got)
PYEOF
echo "$WANT" > "$STAMP"
install_local
