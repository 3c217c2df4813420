#!/usr/bin/env bash
# On the offline CUDA host: install the archive from build_archive.sh next to the image's torch, then run ONE piece of
# the GPU work from this checkout. Each sub-command fits one 10-minute device call and writes everything (results,
# logs, junit xml) into the output folder the caller names.
#
#   scripts/gpu/run.sh SUBCOMMAND OUT [ARGS] [-- extra arguments for the benchmark / pytest]
#
#   check           OUT       unpack, then check torch + CUDA, SGLang, xgrammar and the plugin's entry point (~1 min)
#   tests-greedy    OUT       CUDA tests: tree copy + greedy EAGLE3 = non-speculative, plugin on/off (5 engines)
#   tests-other     OUT       CUDA tests: sampling accepted by the grammar + small KV pool retractions next to aborts
#   bench-paths     OUT       both shapes (topk 1, topk 4), bs 1/8/32/64, 160-token outputs, ONE round after the
#                             warm-up: the plugin's default path (grammar thread) next to unconstrained in one engine,
#                             then the inline path (SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=0) in another; no stock
#                             (the call that fits one device slot when only one is lent)
#   bench-table     OUT       the whole table in ONE device call (H200, 2026-11-27 parts: ~530 s with unpacking):
#                             OUT/on = bench-paths's default path + unconstrained (both shapes, one engine each),
#                             OUT/stock = stock SGLang topk 1, OUT/inline = the inline path topk 1, each one round,
#                             then the three merged into OUT (one row per shape and bs); TABLE_UPLOAD_AB=1 adds, last,
#                             OUT/upload0 = the default path + unconstrained for topk 4 with the mask upload on the
#                             verify's stream (SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM=0; not merged: measured on an
#                             H200 2026-11-27, it does not fit next to the three); a part that cannot finish before
#                             TABLE_DEADLINE_S (default 580: run it with a 600 s limit) seconds after the start is
#                             skipped and said so
#   bench-topk1     OUT       the GPU table's topk 1 rows: bs 1/8/32/64, plugin-on engine (json + unconstrained),
#                             plugin-off engine (json, stock) and the plugin with its grammar work inline (json),
#                             160-token outputs (measured on an H200: 536 s with the archive's unpacking)
#   bench-topk4     OUT       the topk 4 / 8 draft tokens rows without stock SGLang (~5 min: 2 engines)
#   bench-stock     OUT SHAPE stock SGLang's column of one shape (topk 4: ~8 min; its slow grammar steps make its
#                             rounds long: topk 4 bs 64 ~130 s each on the H200)
#   bench-workload  OUT NAME [SHAPE]  the same benchmark, one shape (default topk1), for workload NAME
#                             (WORKLOADS in benchmarks/bench_gpu_constrained.py: the hook for a second workload)
#   merge           OUT DIR.. join the benchmark results found in the DIRs into one table in OUT (no GPU needed)
#   env                       print the exports (source-able: eval "$(scripts/gpu/run.sh env)")
#
# The table is one device call, `bench-table OUT`; with two rounds per cell it is three, `bench-topk1 OUT1`,
# `bench-topk4 OUT2` and `bench-stock OUT3 topk4`, then `merge OUT OUT1 OUT2 OUT3` anywhere.
# Times: bench-topk1 measured (H200, 2026-11-24); the others from the per-engine times of that day's calls (engine
# start with CUDA graphs 40-100 s).
# ARCHIVE_DIR (default scripts/gpu/archive) holds site.tar.xz and extra/*.whl. The site directory (SITE, default
# /tmp/sglang-eo-site) is unpacked once per archive (its sha256 is stamped). Nothing is installed into the image's own
# Python: everything goes on PYTHONPATH, first the checkout (the plugin), then SITE, then the import stand-ins (only
# for the packages the host really lacks: flashinfer, deep_gemm). The plugin's entry point (group sglang.srt.plugins)
# is registered by a dist-info written into SITE, so SGLang loads it exactly as after `pip install`.
# DRY_RUN=1 prints the command a sub-command would run and stops before anything is unpacked (tests use it).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
usage() { sed -n '5,/^#   env /p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
mode=${1:-}
[ -n "$mode" ] || usage
shift
out=""
name=""
merge_dirs=()
case "$mode" in
  check|tests-greedy|tests-other|bench-paths|bench-table|bench-topk1|bench-topk4|bench-stock|bench-workload|merge)
    [ $# -ge 1 ] && [ "$1" != "--" ] || { echo "run.sh $mode: name an output folder: run.sh $mode OUT" >&2; exit 2; }
    out=$1
    shift ;;
  env) ;;
  *) echo "run.sh: unknown sub-command '$mode'" >&2; usage ;;
esac
if [ "$mode" = bench-stock ]; then
  [ $# -ge 1 ] && [ "$1" != "--" ] || { echo "run.sh bench-stock: name the shape: run.sh bench-stock OUT SHAPE" >&2; exit 2; }
  shape=$1
  shift
fi
if [ "$mode" = bench-workload ]; then
  [ $# -ge 1 ] && [ "$1" != "--" ] || {
    echo "run.sh bench-workload: name the workload: run.sh bench-workload OUT NAME [SHAPE]" >&2; exit 2; }
  name=$1
  shift
  shape=topk1
  if [ $# -ge 1 ] && [ "$1" != "--" ]; then shape=$1; shift; fi
fi
if [ "$mode" = merge ]; then
  while [ $# -ge 1 ] && [ "$1" != "--" ]; do merge_dirs+=("$1"); shift; done
  [ ${#merge_dirs[@]} -ge 1 ] || { echo "run.sh merge: name the result folders: run.sh merge OUT DIR..." >&2; exit 2; }
fi
[ "${1:-}" = "--" ] && shift
if [ "$mode" = bench-table ]; then
  # three parts, each its own engine(s) and output folder, inside one deadline; then one merged table in OUT
  deadline=$(( $(date +%s) + ${TABLE_DEADLINE_S:-580} ))
  part() {  # NAME SECONDS-IT-NEEDS SUB-COMMAND ARGS...
    local name=$1 need=$2 left
    shift 2
    left=$(( deadline - $(date +%s) ))
    if [ "${DRY_RUN:-0}" != 1 ] && [ "$left" -lt "$need" ]; then
      echo "[run.sh bench-table] skipped $name: ${left} s left, it needs ~${need} s" >&2
      return 0
    fi
    timeout -k 10 "$(( left > 10 ? left - 5 : 5 ))" bash "$0" "$@" || echo "[run.sh bench-table] $name: rc $?" >&2
  }
  part on 0 bench-paths "$out/on" -- --variants json,unconstrained "$@"
  part stock 170 bench-stock "$out/stock" topk1 -- --rounds 1 "$@"
  part inline 100 bench-paths "$out/inline" -- --variants json-inline --shapes topk1 "$@"
  if [ "${TABLE_UPLOAD_AB:-0}" = 1 ]; then
    # the mask upload on the verify's stream (the side stream's A/B: compare its `over unc.` with OUT/on's, each
    # inside its own engine); topk 4 has the larger mask; kept out of the merged table
    SGLANG_EAGLE_OVERLAP_MASK_UPLOAD_STREAM=0 part upload0 130 bench-paths "$out/upload0" -- \
      --variants json,unconstrained --shapes topk4 "$@"
  fi
  merge_cmd=(bash "$0" merge "$out" "$out/on" "$out/stock" "$out/inline")
  if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "${merge_cmd[@]}"; echo; exit 0; fi
  exec "${merge_cmd[@]}"
fi
py=${PYTHON:-python3}
bench=(benchmarks/bench_gpu_constrained.py --device cuda --attention-backend triton --sampling-backend pytorch)
case "$mode" in
  tests-greedy) cmd=("$py" -m pytest -q -m cuda -p no:cacheprovider tests/core/test_tree_copy.py
                     tests/gpu/test_cuda_engine.py::test_greedy_eagle3_matches_non_speculative_up_to_near_ties) ;;
  tests-other) cmd=("$py" -m pytest -q -m cuda -p no:cacheprovider tests/gpu/test_cuda_engine.py -k "not greedy") ;;
  # the table: the plugin (default path: grammar thread), unconstrained, stock SGLang, the plugin's inline path
  bench-paths) cmd=("$py" "${bench[@]}" --variants json,unconstrained,json-inline --shapes topk1,topk4 --rounds 1) ;;
  bench-topk1) cmd=("$py" "${bench[@]}" --variants json,unconstrained,json-off,json-inline --shapes topk1) ;;
  bench-topk4) cmd=("$py" "${bench[@]}" --variants json,unconstrained,json-inline --shapes topk4) ;;
  bench-stock) cmd=("$py" "${bench[@]}" --variants json-off --shapes "$shape") ;;
  bench-workload) cmd=("$py" "${bench[@]}" --workload "$name" --shapes "$shape") ;;
  merge) cmd=("$py" benchmarks/bench_gpu_constrained.py --merge) ;;
  *) cmd=() ;;
esac
case "$mode" in
  # -v names each test as it starts; faulthandler_timeout dumps every thread's stack into the log when one test runs
  # past it (without stopping it), so a call that runs out of time still shows where it was
  tests-*) cmd+=(-v -o "faulthandler_timeout=${GPU_TEST_STACK_DUMP_S:-200}" --junitxml "$out/$mode.xml") ;;
  bench-*) cmd+=(--out "$out") ;;
esac
cmd+=("$@")
if [ "$mode" = merge ]; then
  files=()
  for d in "${merge_dirs[@]}"; do
    for f in "$d"/gpu_constrained_cuda_*.json; do
      case "$f" in *_merged.json|*"*"*) ;; *) files+=("$f") ;; esac
    done
  done
  [ ${#files[@]} -ge 1 ] || { echo "run.sh merge: no gpu_constrained_cuda_*.json in ${merge_dirs[*]}" >&2; exit 1; }
  cmd=("${cmd[@]:0:3}" "${files[@]}" --out "$out" "${cmd[@]:3}")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
  # the plugin's switches set for this call come first, as assignments (bench-table's upload0 part sets one)
  for v in $(compgen -e | grep '^SGLANG_EAGLE_OVERLAP' || true); do printf '%s=%q ' "$v" "${!v}"; done
  if [ ${#cmd[@]} -gt 0 ]; then printf '%q ' "${cmd[@]}"; echo; else echo "($mode: environment only)"; fi
  exit 0
fi
log() { echo "[run.sh $(date -u +%T)] $*" >&2; }
if [ "$mode" = merge ]; then
  mkdir -p "$out"
  cd "$repo" && exec "${cmd[@]}"
fi
archive_dir=${ARCHIVE_DIR:-$repo/scripts/gpu/archive}
[ -f "$archive_dir/site.tar.xz" ] || {
  echo "run.sh: no $archive_dir/site.tar.xz (set ARCHIVE_DIR; scripts/gpu/build_archive.sh builds it)" >&2; exit 1; }
archive=$(cd "$archive_dir" && pwd)
site=${SITE:-/tmp/sglang-eo-site}

# 1. unpack (once per archive)
stamp=$(sha256sum "$archive/site.tar.xz" | cut -c1-16)
if [ "$(cat "$site/.archive-stamp" 2>/dev/null)" != "$stamp" ]; then
  log "unpacking $archive/site.tar.xz into $site"
  rm -rf "$site" && mkdir -p "$site"
  xz -dc "$archive/site.tar.xz" | tar -x -C "$site"
  if compgen -G "$archive/extra/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-deps --no-index --no-compile --target "$site" "$archive"/extra/*.whl
  fi
  echo "$stamp" > "$site/.archive-stamp"
fi

# 2. the plugin's entry point, from pyproject.toml, as an installed distribution would declare it
"$py" - "$repo/pyproject.toml" "$site" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
site = pathlib.Path(sys.argv[2])
for old in site.glob("sglang_eagle_overlap-*.dist-info"):
    for f in old.iterdir():
        f.unlink()
    old.rmdir()
info = site / f"sglang_eagle_overlap-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang-eagle-overlap\nVersion: {project['version']}\n")
groups = project["entry-points"]
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items()) for group, eps in groups.items()))
PY

# 3. environment: checkout first, then the archive, then stand-ins for what the host lacks
pp="$repo:$site"
stand_ins=()
for mod in flashinfer.sampling deep_gemm; do
  if ! PYTHONPATH="$pp" "$py" -c "import $mod" > /dev/null 2>&1; then stand_ins+=("$mod"); fi
done
case "$mode" in
  tests-*|env)
    # the tests import the dev package (fixtures, helpers): a folder holding only a link to it, never dev/ itself
    # (dev/ also holds the CPU runtime's sgl_kernel stand-in, which would shadow the real kernels)
    mkdir -p "$site.dev"
    ln -sfn "$repo/dev/sglang_eo_dev" "$site.dev/sglang_eo_dev"
    pp="$pp:$site.dev" ;;
esac
if [ ${#stand_ins[@]} -gt 0 ]; then
  pp="$pp:$repo/scripts/gpu/stand-ins"
  log "import stand-ins for: ${stand_ins[*]}"
fi
export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
case " ${stand_ins[*]-} " in *" flashinfer.sampling "*) export SGLANG_IS_FLASHINFER_AVAILABLE=false ;; esac
if [ "$mode" = env ]; then
  echo "export PYTHONPATH='$PYTHONPATH'"
  [ -n "${SGLANG_IS_FLASHINFER_AVAILABLE:-}" ] && echo "export SGLANG_IS_FLASHINFER_AVAILABLE=false"
  exit 0
fi

mkdir -p "$out"
"$py" - <<'PY' 2>&1 | tee "$out/check.log"
from importlib.metadata import entry_points, version
import torch
eps = [e.value for e in entry_points(group="sglang.srt.plugins")]
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}; sglang {version('sglang')}, "
      f"xgrammar {version('xgrammar')}, transformers {version('transformers')}; plugin entry points {eps}")
if "sglang_eagle_overlap.plugin:load" not in eps:
    raise SystemExit("the plugin's entry point is not visible: SGLang would run without it")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible")
PY
[ "$mode" = check ] && exit 0

cd "$repo"
log "$mode: ${cmd[*]}"
status=0
"${cmd[@]}" 2>&1 | tee "$out/$mode.log" || status=$?
log "$mode: exit $status; files in $out"
exit $status
