#!/usr/bin/env bash
# The README's first command: what the plugin changes, on the real SGLang engine (scripts/demo.py --help for all
# switches). Default: CPU + the real SmolLM2-135M-Instruct with its locally trained EAGLE3 draft (built once per
# machine by scripts/build_real_model.sh; --tiny: the tiny hand-set models), SGLang 0.5.16 plugin off vs on, then 0.5.23
# plugin on; the CPU venvs are built on first use (scripts/setup_cpu_env.sh, 3-5 min and ~3.4 GB each). On a GPU machine pass
# --model-path/--draft-model-path: the demo then runs in the current Python environment (your SGLang + the plugin).
#
# SGLANG_VERSION=0.5.16|0.5.23 is the same as --sglang-version (kept for older instructions).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ARGS=("$@")
if [[ -n "${SGLANG_VERSION:-}" ]]; then ARGS=(--sglang-version "$SGLANG_VERSION" "${ARGS[@]}"); fi

wants() { local a; for a in "${ARGS[@]}"; do [[ "$a" == "$1" || "$a" == "$1="* ]] && return 0; done; return 1; }
if wants --model-path || wants -h || wants --help; then
  exec "${PYTHON:-python3}" "$ROOT/scripts/demo.py" "${ARGS[@]}"   # GPU machine: your own SGLang environment (PYTHON=...)
fi
# CPU mode: build the venvs this run needs (no-op when cached), then let demo.py start one engine at a time.
VERSIONS="0.5.16 0.5.23"
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  case "${ARGS[$i]}" in
    --sglang-version) VERSIONS="${ARGS[$((i + 1))]:-}" ;;
    --sglang-version=*) VERSIONS="${ARGS[$i]#*=}" ;;
  esac
done
[[ "$VERSIONS" == "all" ]] && VERSIONS="0.5.16 0.5.23"
for v in $VERSIONS; do
  bash "$ROOT/scripts/setup_cpu_env.sh" "$v"
done
if ! wants --tiny; then
  bash "$ROOT/scripts/build_real_model.sh" "${VERSIONS%% *}" >/dev/null   # once per machine, then cached
fi
exec python3 "$ROOT/scripts/demo.py" "${ARGS[@]}"
