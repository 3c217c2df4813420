#!/usr/bin/env bash
# Build the package archive for an offline CUDA host (Python 3.12, torch 2.11+cu130 preinstalled, no index).
#
#   scripts/gpu/build_archive.sh OUT_DIR [PACKAGE_LIST]
#
# Runs on any Linux machine with pip and network access to PyPI (nothing is installed into this machine's Python).
# 1. pip download the pinned py3.12 manylinux wheels of PACKAGE_LIST (default packages-0.5.16-py312.txt), --no-deps;
# 2. unpack them into one site directory (pip install --target --no-deps; the sglang-kernel wheel is unzipped
#    without its 1.1 GB FlashAttention-3 object);
# 3. prune what a Llama + EAGLE3 run with triton attention never loads (lib.sh: prune_site);
# 4. OUT_DIR/site.tar.xz (xz -6) + OUT_DIR/extra/*.whl (extra-0.5.16-py312.txt) + OUT_DIR/MANIFEST (pins, sha256).
#    Measured for 0.5.16 (2026-11-26): site.tar.xz 42.7 MB + wheels 14.4 MB = 54.5 MiB; ~460 MB downloaded, 251 MB
#    unpacked after pruning; ~3 min of xz on 2 cores.
# scripts/gpu/run.sh unpacks and uses it there. Keep OUT_DIR out of git (.gitignore: scripts/gpu/archive/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
out=${1:?usage: build_archive.sh OUT_DIR [PACKAGE_LIST]}
list=${2:-$here/packages-0.5.16-py312.txt}
extra_list=${EXTRA_LIST:-$here/extra-0.5.16-py312.txt}
work=${WORK_DIR:-$(mktemp -d /tmp/sglang-eo-archive.XXXXXX)}
pip=${PIP:-python3 -m pip}
read -r -a plat <<< "$(pip_platform_args)"

mkdir -p "$out/extra" "$work/dl"
read_pins "$list" > "$work/pins.txt"
read_pins "$extra_list" > "$work/extra-pins.txt"
echo "downloading $(wc -l < "$work/pins.txt") pinned wheels (+ $(wc -l < "$work/extra-pins.txt") extra) into $work/dl"
$pip download --no-deps -q -d "$work/dl" "${plat[@]}" -r "$work/pins.txt"
$pip download --no-deps -q -d "$out/extra" "${plat[@]}" -r "$work/extra-pins.txt"

rm -rf "$work/site" && mkdir -p "$work/site"
mapfile -t wheels < <(find "$work/dl" -name '*.whl' ! -name 'sglang_kernel-*' | sort)
$pip install -q --no-deps --no-index --no-compile --target "$work/site" "${plat[@]}" "${wheels[@]}"
for k in "$work"/dl/sglang_kernel-*.whl; do
  [ -e "$k" ] || continue
  # unzip -x keeps the 1.1 GB FlashAttention-3 object off the disk; prune_site drops the rest
  (cd "$work/site" && unzip -q -o "$k" -x 'sgl_kernel/flash_ops*.so')
done
prune_site "$work/site"

tar -C "$work/site" -cf - . | xz -T0 -6 > "$out/site.tar.xz"
{
  echo "# built $(date -u +%FT%TZ) from $(basename "$list") + $(basename "$extra_list")"
  cat "$work/pins.txt" "$work/extra-pins.txt"
  (cd "$out" && sha256sum site.tar.xz extra/*.whl)
} > "$out/MANIFEST"
size=$(du -cb "$out/site.tar.xz" "$out"/extra/*.whl | tail -1 | cut -f1)
echo "archive: $out ($((size / 1048576)) MiB in all; the offline host takes at most 64 MiB per transfer)"
if [ -z "${KEEP_WORK:-}" ]; then rm -rf "$work"; fi
