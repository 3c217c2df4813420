# Functions shared by build_archive.sh (and its tests): source this file, it runs nothing.

# read_pins FILE: print the "name==version" entries of a package list, one per line (comments, blanks and inline
# comments dropped). Fails on an entry that is not pinned with == (an offline host must get exactly what was tested).
read_pins() {
  local file=$1 line n=0
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line=${line%%#*}
    line=$(printf '%s' "$line" | tr -d '[:space:]')
    [ -z "$line" ] && continue
    case $line in
      *==*) [ -n "${line%%==*}" ] && [ -n "${line#*==}" ] || { echo "$file:$n: bad pin '$line'" >&2; return 1; } ;;
      *) echo "$file:$n: '$line' is not pinned (name==version)" >&2; return 1 ;;
    esac
    printf '%s\n' "$line"
  done < "$file"
}

# prune_site DIR: remove from an unpacked site directory what a Llama + EAGLE3 run with triton attention never
# loads, so the archive fits in 64 MiB: FlashAttention-3 (flash_ops, 1.1 GB), the sm100 kernels, FlashMLA, objects
# built for CPython 3.10, xgrammar's static libraries (65 MB), zstandard's cffi backend, console scripts, typeshed
# stubs, SGLang's diffusion package, llguidance (the offline host runs the xgrammar backend only),
# what only SGLang's evals and GCS signing import, caches.
prune_site() {
  local site=$1
  [ -d "$site" ] || { echo "prune_site: no directory $site" >&2; return 1; }
  if [ -d "$site/sgl_kernel" ]; then
    rm -rf "$site/sgl_kernel/sm100"
    find "$site/sgl_kernel" \( -name 'flash_ops*.so' -o -name 'flashmla_ops*.so' -o -name '*cpython-310*.so' \) -delete
  fi
  rm -rf "$site"/xgrammar/lib/*.a "$site/bin" "$site/jedi/third_party/typeshed"
  rm -rf "$site/sglang/multimodal_gen"  # diffusion serving (11 MB): only sglang's CLI and diffusion kernels import it
  rm -rf "$site"/llguidance "$site"/llguidance-*.dist-info  # 7.6 MB; imported only by grammar_backend="llguidance"
  # imported only by SGLang's evals and blobfile's GCS signing, never by a text engine (10 MB); soundfile's library
  # stays: transformers' audio_utils imports soundfile whenever it is installed, and it cannot load without it
  rm -rf "$site"/datasets "$site"/multiprocess "$site"/Cryptodome
  rm -f "$site"/zstandard/_cffi.*.so  # zstandard imports its C backend; the cffi one (12 MB) is a fallback
  find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
  find "$site" -name '*.pyc' -delete
}

# PIP_PLATFORM_ARGS: pip download/install arguments for CPython 3.12 x86_64 manylinux (and pure-Python) wheels.
pip_platform_args() {
  local t args="--python-version 3.12 --implementation cp --only-binary=:all:"
  for t in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1 linux; do
    args="$args --platform ${t}_x86_64"
  done
  printf '%s --platform any\n' "$args"
}
