#!/usr/bin/env bash
# The README's main command: a constrained EAGLE3 demo on the real SGLang engine (CPU + tiny local models by
# default; pass --model-path/--draft-model-path on a GPU machine). Arguments go to scripts/demo.py.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VER="${SGLANG_VERSION:-0.5.23}"
if [[ " $* " == *" --model-path"[\ =]* ]]; then   # --model-path M or --model-path=M
  exec python3 "$ROOT/scripts/demo.py" "$@"   # GPU machine: the user's own SGLang environment
fi
bash "$ROOT/scripts/setup_cpu_env.sh" "$VER"
exec "$ROOT/.venvs/sglang-$VER/bin/python" "$ROOT/scripts/demo.py" "$@"
