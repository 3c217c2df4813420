#!/usr/bin/env bash
# Type-check the plugin package (mypy, strict; configuration in pyproject.toml [tool.mypy]).
#
#   scripts/typecheck.sh                 -> mypy on sglang_eagle_overlap/ against the SGLang 0.5.23 CPU venv
#   TYPECHECK_SGLANG=0.5.16 scripts/typecheck.sh
#
# mypy runs from its own small venv (.venvs/typecheck, created idempotently; a stamp records the pinned version), and
# reads the third-party packages (torch's inline types, SGLang, xgrammar) from the SGLang CPU venv through
# --python-executable, so the check sees the same torch the tests run. Build that venv first
# (scripts/setup_cpu_env.sh 0.5.23; scripts/test.sh does it). Extra arguments go to mypy.
# Cost: ~1 min for the first mypy venv, then the check itself (docs/development.md, "Type check").
set -euo pipefail
MYPY_VERSION=2.4.1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
VENVS="${SGLANG_EO_VENV_DIR:-$ROOT/.venvs}"
TOOL="$VENVS/typecheck"
TARGET="$VENVS/sglang-${TYPECHECK_SGLANG:-0.5.23}/bin/python"
STAMP="$TOOL/.stamp-mypy-$MYPY_VERSION"

if [[ ! -x "$TARGET" ]]; then
  echo "[typecheck] no SGLang venv at ${TARGET%/bin/python}: run scripts/setup_cpu_env.sh ${TYPECHECK_SGLANG:-0.5.23}" \
       "first (mypy reads torch's and SGLang's types from it)" >&2
  exit 2
fi

mkdir -p "$VENVS"
# One run at a time per venv folder (held until mypy exits): two checkouts sharing SGLANG_EO_VENV_DIR must not build
# the tool venv, or write one cache, at the same time.
exec 9>"$VENVS/.typecheck.lock"
flock 9
if [[ ! -f "$STAMP" ]]; then
  echo "[typecheck] installing mypy==$MYPY_VERSION into $TOOL" >&2
  rm -rf "$TOOL"
  "$TARGET" -m venv "$TOOL"   # a venv made from a venv's python is based on the same base interpreter
  # pip's warnings about index locations of a pip configuration that do not exist on this machine are dropped;
  # pipefail keeps pip's own exit status.
  "$TOOL/bin/python" -m pip install -q --disable-pip-version-check "mypy==$MYPY_VERSION" 2>&1 \
    | awk '!/^WARNING: Location .* is ignored: it is neither a file nor a directory\.$/'
  touch "$STAMP"
fi

# The cache lives with the tool venv, not in the checkout: one per SGLang venv, since mypy keys its cache by module
# name and two site-packages in one cache would evict each other's torch on every run.
exec "$TOOL/bin/mypy" --python-executable "$TARGET" --cache-dir "$TOOL/cache-sglang-${TYPECHECK_SGLANG:-0.5.23}" "$@"
