#!/usr/bin/env bash
# The project's test command (README): builds/reuses the CPU venvs and runs the whole suite against each supported
# SGLang. Extra arguments go to pytest, e.g. `scripts/test.sh -m "not engine"` or `SGLANG_VERSIONS=0.5.23 scripts/test.sh`.
# Cost (README "Requirements"): ~30 min for both versions on 2 cores once the venvs exist (~2-5 min and 3.4 GB each
# to build). Engine tests take /tmp/sglang-engine.lock, so they wait for any other engine on the machine.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VERSIONS="${SGLANG_VERSIONS:-0.5.23 0.5.16}"
status=0
for v in $VERSIONS; do
  bash scripts/setup_cpu_env.sh "$v" || { echo "setup of SGLang $v failed" >&2; exit 1; }
done
# The real model (SmolLM2-135M-Instruct + its trained EAGLE3 draft) for the real-pair engine tests: built once per
# machine outside the engine lock (cached; a no-op afterwards).
first=${VERSIONS%% *}
start=$SECONDS
bash scripts/build_real_model.sh "$first" >/dev/null || { echo "building the real model failed" >&2; exit 1; }
echo "===== real model ready ($(( SECONDS - start )) s) ====="
for v in $VERSIONS; do
  echo "===== SGLang $v ====="
  start=$SECONDS
  flock /tmp/sglang-engine.lock "$ROOT/.venvs/sglang-$v/bin/python" -m pytest -q -p no:cacheprovider "$@" tests \
    || status=1
  echo "===== SGLang $v: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s ====="
done
exit $status
