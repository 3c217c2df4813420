#!/usr/bin/env bash
# Check the plugin package's import contracts (docs/development.md, "Import contracts"):
#
#   scripts/importcheck.sh          -> the contracts on this checkout's sglang_eagle_overlap/
#   scripts/importcheck.sh DIR      -> the same contracts on DIR/sglang_eagle_overlap (tests check modified copies)
#
# Two checks, both run, each printing what breaks it: import-linter with the contracts of pyproject.toml
# [tool.importlinter] (core standalone, core reached only through its package, layers, independent hook modules), then
# scripts/import_cycles.py (no import cycle between the package's modules), both counting TYPE_CHECKING imports.
# Exit status 1 when either fails.
# The tools run from their own small venv, built once per pinned version outside the checkout, under
# ${SGLANG_EO_IMPORTCHECK_CACHE:-~/.cache/sglang-eagle-overlap/importcheck} (a stamp records a complete install). It
# needs any Python >= 3.11 with the venv module (IMPORTCHECK_PYTHON overrides the choice), not SGLang: the contracts
# read the package's source, and an import of SGLang counts without SGLang being installed.
# Cost: ~15 s for the venv the first time, then under 2 s.
set -euo pipefail
IMPORT_LINTER_VERSION=2.17
GRIMP_VERSION=3.20
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$(cd "${1:-$ROOT}" && pwd)"
PACKAGE=sglang_eagle_overlap
CACHE="${SGLANG_EO_IMPORTCHECK_CACHE:-$HOME/.cache/sglang-eagle-overlap/importcheck}"
TOOL="$CACHE/import-linter-$IMPORT_LINTER_VERSION-grimp-$GRIMP_VERSION"
STAMP="$TOOL/.stamp"

if [[ ! -d "$SRC/$PACKAGE" ]]; then
  echo "[importcheck] no $PACKAGE/ in $SRC" >&2
  exit 2
fi

usable_python() {
  command -v "$1" >/dev/null 2>&1 \
    && "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}
find_python() {
  local c
  if [[ -n "${IMPORTCHECK_PYTHON:-}" ]]; then
    usable_python "$IMPORTCHECK_PYTHON" && { echo "$IMPORTCHECK_PYTHON"; return 0; }
    echo "[importcheck] IMPORTCHECK_PYTHON=$IMPORTCHECK_PYTHON is not a Python >= 3.11 with the venv module" >&2
    return 1
  fi
  for c in python3.11 python3.12 python3.13 python3.14 python3; do
    usable_python "$c" && { echo "$c"; return 0; }
  done
  echo "[importcheck] no Python >= 3.11 with the venv module on PATH (set IMPORTCHECK_PYTHON)" >&2
  return 1
}

mkdir -p "$CACHE"
# One build at a time: checkouts on one machine share the tool venv, and a second must not use a half-built one.
exec 9>"$CACHE/.lock"
flock 9
# The stamp is written after a complete install; the import check catches a venv whose base interpreter went away.
if [[ ! -f "$STAMP" ]] || ! "$TOOL/bin/python" -c 'import importlinter, grimp' >/dev/null 2>&1; then
  PY="$(find_python)" || exit 2
  echo "[importcheck] installing import-linter==$IMPORT_LINTER_VERSION grimp==$GRIMP_VERSION into $TOOL" >&2
  rm -rf "$TOOL"
  "$PY" -m venv "$TOOL"
  # pip's warnings about index locations of a pip configuration that do not exist on this machine are dropped;
  # pipefail keeps pip's own exit status.
  "$TOOL/bin/python" -m pip install -q --disable-pip-version-check \
      "import-linter==$IMPORT_LINTER_VERSION" "grimp==$GRIMP_VERSION" 2>&1 \
    | awk '!/^WARNING: Location .* is ignored: it is neither a file nor a directory\.$/'
  touch "$STAMP"
fi
flock -u 9

# The package is found through PYTHONPATH alone (nothing else on it: not an installed copy, not the caller's path).
# No graph cache: the graph of this package builds in well under a second, and a cache shared by checkouts could
# answer for files it did not read. COLUMNS keeps import-linter from wrapping module names across lines.
cd "$SRC"
status=0
PYTHONPATH="$SRC" COLUMNS=200 "$TOOL/bin/lint-imports" --no-cache --no-logo "$ROOT/pyproject.toml" || status=1
echo
PYTHONPATH="$SRC" "$TOOL/bin/python" "$ROOT/scripts/import_cycles.py" "$PACKAGE" || status=1
if (( status )); then
  echo "[importcheck] import contracts broken in $SRC/$PACKAGE (above; docs/development.md, \"Import contracts\")" >&2
fi
exit $status
