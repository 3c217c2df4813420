#!/usr/bin/env bash
# Mutation testing of sglang_eagle_overlap/core/ (ledger, mask, tree copy, step, forced drafts) against the fast unit
# tests of tests/core: it finds code no test would notice breaking. Not part of CI; tests/core/MUTANTS.md gives its
# last result. One file: scripts/mutation.sh run "sglang_eagle_overlap.core.forced*" (mutmut's name glob; named
# mutants are all run again, whatever their earlier verdict).
#
#   scripts/mutation.sh                 # mutmut run, then the summary and the list of surviving mutants
#   scripts/mutation.sh show NAME       # any other mutmut command (show, results, browse, run NAME...)
#
# Tool: mutmut (PyPI), configured in pyproject.toml [tool.mutmut]. It runs in its own venv, .venvs/mutation
# (gitignored), built once here; that venv sees the packages of the SGLang 0.5.23 CPU venv (torch, xgrammar, pytest,
# hypothesis, SGLang) through a .pth file, so the tests run against exactly what scripts/test.sh uses and nothing is
# installed into the SGLang venv. mutmut writes its mutated copy and results to mutants/ (gitignored); a re-run
# without names reuses the results of unchanged mutants (delete mutants/ for a clean run).
#
# Environment: MUTATION_JOBS (parallel mutant workers, default 2), SGLANG_EO_VENV_DIR (default <repo>/.venvs).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
MUTMUT_VERSION=3.8.1
VENVS="${SGLANG_EO_VENV_DIR:-$ROOT/.venvs}"
SGLANG_VENV="$VENVS/sglang-0.5.23"
VENV="$VENVS/mutation"
STAMP="$VENV/.mutation-stamp"

# Built only if missing: mutmut imports the package from mutants/ and dev/ from PYTHONPATH, so the venv's editable
# install of this checkout is not needed (and a checkout sharing another's .venvs must not re-point it).
if [[ ! -x "$SGLANG_VENV/bin/python" ]]; then
  bash scripts/setup_cpu_env.sh 0.5.23 || { echo "[mutation] setup of the SGLang 0.5.23 venv failed" >&2; exit 1; }
fi

want="mutmut==$MUTMUT_VERSION $SGLANG_VENV"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "[mutation] building $VENV (mutmut $MUTMUT_VERSION)"
  rm -rf "$VENV"
  # The SGLang venv's own interpreter creates it: same Python version, so its site-packages can be shared.
  "$SGLANG_VENV/bin/python" -m venv "$VENV"
  site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  shared="$("$SGLANG_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # Appended after this venv's own site-packages: pip then sees what the SGLang venv already has (pytest, click...)
  # and installs only what is missing here, and never touches the SGLang venv (it is outside this environment).
  echo "import site; site.addsitedir('$shared')" > "$site/zz_sglang_0_5_23.pth"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "mutmut==$MUTMUT_VERSION"
  echo "$want" > "$STAMP"
fi

# The package is imported from mutants/ (mutmut puts it first on sys.path and removes the repo root); the test
# helpers come from dev/.
export PYTHONPATH="$ROOT/dev"
# Each mutant's worker compiles what it imports anew unless bytecode may be cached (pytest's rewritten test modules).
unset PYTHONDONTWRITEBYTECODE
if [[ $# -gt 0 ]]; then
  exec "$VENV/bin/mutmut" "$@"
fi
start=$SECONDS
"$VENV/bin/mutmut" run --max-children "${MUTATION_JOBS:-2}"
echo "[mutation] run took $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
"$VENV/bin/mutmut" export-cicd-stats >/dev/null
"$VENV/bin/python" - <<'PYEOF'
import json
s = json.load(open("mutants/mutmut-cicd-stats.json"))
total = s["total"]
killed = s["killed"] + s.get("timeout", 0) + s.get("caught_by_type_check", 0)
print(f"[mutation] {total} mutants: {s['killed']} killed, {s.get('timeout', 0)} timed out (killed), "
      f"{s['survived']} survived, {s['no_tests']} with no test, {s.get('suspicious', 0)} suspicious, "
      f"{s.get('segfault', 0)} segfault; kill rate {100 * killed / max(total, 1):.1f} %")
PYEOF
"$VENV/bin/mutmut" results
