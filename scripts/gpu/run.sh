#!/usr/bin/env bash
# On the offline CUDA host: install the archive from build_archive.sh next to the image's torch, then run the GPU
# benchmark and/or the CUDA engine tests from this checkout.
#
#   scripts/gpu/run.sh ARCHIVE_DIR [all|bench|tests|env] [-- extra benchmark arguments]
#
# ARCHIVE_DIR holds site.tar.xz and extra/*.whl. The site directory (SITE, default /tmp/sglang-eo-site) is unpacked
# once per archive (its sha256 is stamped). Nothing is installed into the image's own Python: everything goes on
# PYTHONPATH, first the checkout (the plugin), then SITE, then the import stand-ins (only for the packages the host
# really lacks: flashinfer, deep_gemm). The plugin's entry point (group sglang.srt.plugins) is registered by a
# dist-info written into SITE, so SGLang loads it exactly as after `pip install`.
#   all   = tests, then bench (default);  env = print the exports and stop (source-able: eval "$(run.sh DIR env)").
# RESULTS_DIR (default benchmarks/results) receives the benchmark's md/json/png; the run's logs go there too.
# A full benchmark grid (2 shapes x 4 batch sizes x 3 variants, 4 engine starts) may need more than a 10-minute
# slot: split it, e.g. `run.sh DIR bench -- --shapes topk1` then `-- --shapes topk4`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
archive=$(cd "${1:?usage: run.sh ARCHIVE_DIR [all|bench|tests|env] [-- bench args]}" && pwd)
mode=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
[ "${1:-}" = "--" ] && shift
py=${PYTHON:-python3}
site=${SITE:-/tmp/sglang-eo-site}
results=${RESULTS_DIR:-$repo/benchmarks/results}
log() { echo "[run.sh $(date -u +%T)] $*" >&2; }

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

"$py" - <<'PY'
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

mkdir -p "$results"
status=0
cd "$repo"
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  log "CUDA tests: pytest -m cuda tests/gpu tests/core/test_tree_copy.py"
  "$py" -m pytest -q -m cuda -p no:cacheprovider tests/gpu tests/core/test_tree_copy.py 2>&1 \
    | tee "$results/gpu_tests.log" || status=1
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  log "benchmark: benchmarks/bench_gpu_constrained.py $*"
  "$py" benchmarks/bench_gpu_constrained.py --device cuda --attention-backend triton --sampling-backend pytorch \
    --out "$results" "$@" 2>&1 | tee "$results/gpu_bench.log" || status=1
fi
exit $status
