#!/usr/bin/env bash
# The project's test command (README): builds/reuses the CPU venvs and runs the whole suite against each supported
# SGLang. Extra arguments go to pytest, e.g. `scripts/test.sh -m "not engine"` or `SGLANG_VERSIONS=0.5.23 scripts/test.sh`.
# Cost (docs/development.md): ~65 min for `.ci/run` on a fresh clone on 2 cores (venv builds ~6 min,
# 3.4 GB each; type check ~45-60 s per version cold, seconds warm; import contracts ~15 s cold, ~1 s warm;
# ~28-31 min of tests per version), the real model cached in ~/.cache (built from nothing: ~14 min, partly hidden
# behind the second venv's install and the type checks). Engine
# tests take /tmp/sglang-engine.lock, so they wait for any other engine on the machine.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VERSIONS="${SGLANG_VERSIONS:-0.5.23 0.5.16}"
# The venvs built below run every test: a skip outside tests/skip_guard.py's ALLOWED_SKIPS (CUDA-only tests, the other
# band's tests) fails the run, e.g. an engine suite skipped because the venv lost its sgl_kernel stand-in.
export SGLANG_EO_REQUIRE_ENGINE="${SGLANG_EO_REQUIRE_ENGINE:-1}"
status=0
first=${VERSIONS%% *}
bash scripts/setup_cpu_env.sh "$first" || { echo "setup of SGLang $first failed" >&2; exit 1; }
# The real model (SmolLM2-135M-Instruct + its chat-trained EAGLE3 draft) for the real-pair engine tests: built once
# per machine outside the engine lock (cached; a no-op afterwards). From nothing it is ~14 min of CPU work, so it runs
# in the background while the other venvs install and the type checks run (mostly network and disk), and the tests
# wait for it.
build_start=$SECONDS
build_log="$(mktemp)"
bash scripts/build_real_model.sh "$first" >/dev/null 2>"$build_log" &
build_pid=$!
trap 'kill "$build_pid" 2>/dev/null; rm -f "$build_log"' EXIT
for v in $VERSIONS; do
  [[ "$v" == "$first" ]] && continue
  bash scripts/setup_cpu_env.sh "$v" || { echo "setup of SGLang $v failed" >&2; exit 1; }
done
# The type check first (scripts/typecheck.sh: mypy strict on sglang_eagle_overlap/, against each SGLang venv's torch
# and xgrammar); a type error fails the run before the ~30 min of tests.
for v in $VERSIONS; do
  echo "===== type check against SGLang $v ====="
  start=$SECONDS
  TYPECHECK_SGLANG="$v" bash scripts/typecheck.sh \
    || { echo "type check against SGLang $v failed (errors above; scripts/typecheck.sh reproduces it)" >&2; exit 1; }
  echo "===== type check against SGLang $v: $(( SECONDS - start )) s ====="
done
# The import contracts next (scripts/importcheck.sh: core standalone and reached only through its package, the
# layers, independent hook modules, no cycles); a broken contract fails the run before the tests too.
echo "===== import contracts ====="
start=$SECONDS
bash scripts/importcheck.sh \
  || { echo "import contracts broken (violations above; scripts/importcheck.sh reproduces it)" >&2; exit 1; }
echo "===== import contracts: $(( SECONDS - start )) s ====="
wait "$build_pid"
build_rc=$?
cat "$build_log" >&2
[[ $build_rc -eq 0 ]] || { echo "building the real model failed (log above)" >&2; exit 1; }
echo "===== real model ready ($(( SECONDS - build_start )) s after the first venv) ====="
for v in $VERSIONS; do
  echo "===== SGLang $v ====="
  start=$SECONDS
  # --durations: the slowest tests with their setup (engine starts), to keep the suite's time in view
  flock /tmp/sglang-engine.lock "$ROOT/.venvs/sglang-$v/bin/python" -m pytest -q -p no:cacheprovider --durations=25 \
    "$@" tests \
    || status=1
  echo "===== SGLang $v: $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s ====="
done
exit $status
