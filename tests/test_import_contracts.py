"""The import contracts fail on each kind of violation and pass on a tree that keeps them (scripts/importcheck.sh).

The checker runs on a small package laid out like the plugin (``sglang_eagle_overlap`` with core/, integration/,
adapters/v0_5_16/, adapters/v0_5_23/, plugin.py, metrics.py) that keeps every contract; each test writes one
violation into a copy of it and expects exactly the contract it breaks to be reported broken, naming the import.
scripts/test.sh runs the same checker on the real package before the tests, so the real tree is held to the
contracts there; here the point is that the checker can fail, for each contract, including an import under
``if TYPE_CHECKING:`` and a core module no list names.

The checker's tool venv is built by the script when missing (about 15 s, from PyPI); later runs take about a second.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Dict, FrozenSet, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "importcheck.sh"
PACKAGE = "sglang_eagle_overlap"
CYCLES = "import cycles"

# Contract id -> name, as pyproject.toml declares them: the checker prints each name with KEPT or BROKEN.
_CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS: Dict[str, str] = {contract["id"]: contract["name"] for contract in _CONFIG["contracts"]}

_HOOKS = '''\
from sglang_eagle_overlap.adapters.{band} import band
from sglang_eagle_overlap.integration import runtime


def hook() -> object:
    return band.flow(runtime.RUNTIME)
'''
# Both bands' band module: reaches core through its package and integration below it.
_BAND = '''\
from sglang_eagle_overlap.core import Step
from sglang_eagle_overlap.integration import runtime


def flow(step: Step) -> object:
    return runtime.engine()
'''

# A package that keeps every contract: core reached through its package only, each layer importing downwards, hook
# modules importing their band module and integration, SGLang imported above core only, no cycle.
KEPT_TREE: Dict[str, str] = {
    "__init__.py": "",
    "settings.py": "LIMIT = 3\n",
    "core/__init__.py": '''\
from sglang_eagle_overlap.core.ledger import Ledger
from sglang_eagle_overlap.core.step import Step

__all__ = ["Ledger", "Step"]
''',
    "core/ledger.py": "class Ledger:\n    pass\n",
    "core/step.py": '''\
from sglang_eagle_overlap.core.ledger import Ledger


class Step:
    ledger = Ledger
''',
    "integration/__init__.py": "",
    "integration/runtime.py": '''\
from typing import TYPE_CHECKING

from sglang_eagle_overlap.core import Step

if TYPE_CHECKING:
    from sglang_eagle_overlap.metrics import Exporter

RUNTIME = Step()


def engine() -> object:
    import sglang.srt.managers.scheduler
    return sglang.srt.managers.scheduler
''',
    "metrics.py": '''\
from sglang_eagle_overlap.core import Ledger


class Exporter:
    ledger = Ledger
''',
    "adapters/__init__.py": "",
    "adapters/v0_5_16/__init__.py": (
        "from sglang_eagle_overlap.adapters.v0_5_16 import eagle_sample, run_eagle_verify\n"),
    "adapters/v0_5_16/band.py": _BAND,
    "adapters/v0_5_16/eagle_sample.py": _HOOKS.format(band="v0_5_16"),
    "adapters/v0_5_16/run_eagle_verify.py": _HOOKS.format(band="v0_5_16"),
    "adapters/v0_5_23/__init__.py": (
        "from sglang_eagle_overlap.adapters.v0_5_23 import advance_grammar_fsm, eagle_sample, run_eagle_verify\n"),
    "adapters/v0_5_23/band.py": _BAND,
    "adapters/v0_5_23/advance_grammar_fsm.py": _HOOKS.format(band="v0_5_23"),
    "adapters/v0_5_23/eagle_sample.py": _HOOKS.format(band="v0_5_23"),
    "adapters/v0_5_23/run_eagle_verify.py": _HOOKS.format(band="v0_5_23"),
    "plugin.py": '''\
from sglang_eagle_overlap.integration import runtime


def load() -> object:
    from sglang_eagle_overlap.adapters import v0_5_23
    return v0_5_23, runtime
''',
}


class Outcome(NamedTuple):
    returncode: int
    output: str
    broken: FrozenSet[str]  # contract ids reported BROKEN, CYCLES when the cycle check failed


def _write(base: Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = base / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _append(base: Path, name: str, text: str) -> None:
    path = base / PACKAGE / name
    path.write_text(path.read_text() + "\n" + textwrap.dedent(text))


def run_checker(base: Path) -> Outcome:
    """scripts/importcheck.sh on ``base/sglang_eagle_overlap``; every contract's verdict must be printed."""
    result = subprocess.run(["bash", str(SCRIPT), str(base)], capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    broken = set()
    for contract_id, name in CONTRACTS.items():
        verdict = re.search(rf"^{re.escape(name)} (KEPT|BROKEN)", output, re.MULTILINE)
        assert verdict, f"no verdict for contract {name!r} in:\n{output}"
        if verdict.group(1) == "BROKEN":
            broken.add(contract_id)
    cycles = re.search(rf"^(No import cycles|Import cycles) between the modules of {PACKAGE}", output, re.MULTILINE)
    assert cycles, f"no verdict of the cycle check in:\n{output}"
    if cycles.group(1) == "Import cycles":
        broken.add(CYCLES)
    return Outcome(result.returncode, output, frozenset(broken))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _write(tmp_path, KEPT_TREE)
    return tmp_path


def test_every_contract_has_a_violation_here():
    """A contract added to pyproject.toml needs a case below that breaks it; type-only imports count in all."""
    assert set(CONTRACTS) | {CYCLES} == set().union(*(violation.broken for violation in VIOLATIONS.values()))
    assert _CONFIG["exclude_type_checking_imports"] is False


def test_a_tree_that_keeps_the_contracts_passes(tree):
    outcome = run_checker(tree)
    assert outcome.broken == frozenset(), outcome.output
    assert outcome.returncode == 0, outcome.output


def test_a_copy_of_the_real_package_is_checked_not_the_checkout(tmp_path):
    """The checker reads the folder it is given: a copy of the real package with core importing integration breaks
    core-standalone even though the checkout itself keeps it."""
    shutil.copytree(ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    _write(tmp_path, {"core/injected.py": "import sglang_eagle_overlap.integration\n"})
    outcome = run_checker(tmp_path)
    assert "core-standalone" in outcome.broken, outcome.output
    assert "sglang_eagle_overlap.core.injected -> sglang_eagle_overlap.integration" in outcome.output
    assert outcome.returncode != 0


class Violation(NamedTuple):
    files: Dict[str, str]  # new modules of the package
    appended: Dict[str, str]  # text added to the end of existing modules
    broken: FrozenSet[str]  # what the checker must report broken, and nothing else
    shown: str  # the offending import as the report shows it


VIOLATIONS: Dict[str, Violation] = {
    # A new core module no list names; its import of integration is type-only and still counts. Core is below
    # integration, so the layers contract breaks with it.
    "core imports integration under TYPE_CHECKING": Violation(
        files={"core/injected.py": '''\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from sglang_eagle_overlap.integration.runtime import RUNTIME
            '''},
        appended={},
        broken=frozenset({"core-standalone", "layers"}),
        shown="sglang_eagle_overlap.core.injected -> sglang_eagle_overlap.integration.runtime",
    ),
    "core imports SGLang inside a function": Violation(
        files={"core/injected.py": '''\
            def scheduler() -> object:
                from sglang.srt.managers import scheduler
                return scheduler
            '''},
        appended={},
        broken=frozenset({"core-standalone"}),
        shown="sglang_eagle_overlap.core.injected -> sglang",
    ),
    "an adapter imports core.step": Violation(
        files={},
        appended={"adapters/v0_5_16/band.py": "from sglang_eagle_overlap.core.step import Step as _Step\n"},
        broken=frozenset({"core-facade"}),
        shown="sglang_eagle_overlap.adapters.v0_5_16.band -> sglang_eagle_overlap.core.step",
    ),
    "integration imports a core module no list names": Violation(
        files={"core/fresh.py": "VALUE = 1\n"},
        appended={"integration/runtime.py": "from sglang_eagle_overlap.core.fresh import VALUE\n"},
        broken=frozenset({"core-facade"}),
        shown="sglang_eagle_overlap.integration.runtime -> sglang_eagle_overlap.core.fresh",
    ),
    "integration imports an adapter under TYPE_CHECKING": Violation(
        files={"integration/injected.py": '''\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from sglang_eagle_overlap.adapters.v0_5_23.band import flow
            '''},
        appended={},
        broken=frozenset({"layers"}),
        shown="sglang_eagle_overlap.integration.injected -> sglang_eagle_overlap.adapters.v0_5_23.band",
    ),
    "two core modules import each other": Violation(
        files={
            "core/cycle_a.py": '''\
                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from sglang_eagle_overlap.core.cycle_b import B
                A = 1
                ''',
            "core/cycle_b.py": "from sglang_eagle_overlap.core.cycle_a import A\nB = A\n",
        },
        appended={},
        broken=frozenset({CYCLES}),
        shown="sglang_eagle_overlap.core.cycle_a -> sglang_eagle_overlap.core.cycle_b",
    ),
    "a core module imports its own package, which imports it": Violation(
        files={},
        appended={"core/ledger.py": '''\
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from sglang_eagle_overlap.core import Step
            '''},
        broken=frozenset({CYCLES}),
        shown="sglang_eagle_overlap.core.ledger -> sglang_eagle_overlap.core",
    ),
    "a hook module imports another hook module": Violation(
        files={},
        appended={
            "adapters/v0_5_23/eagle_sample.py": "from sglang_eagle_overlap.adapters.v0_5_23 import run_eagle_verify\n",
        },
        broken=frozenset({"hooks-independent"}),
        shown="sglang_eagle_overlap.adapters.v0_5_23.eagle_sample -> "
              "sglang_eagle_overlap.adapters.v0_5_23.run_eagle_verify",
    ),
    "a band module imports a hook module": Violation(
        files={},
        appended={"adapters/v0_5_16/band.py": "from sglang_eagle_overlap.adapters.v0_5_16 import eagle_sample\n"},
        # the hook imports the band module back: a cycle as well
        broken=frozenset({"hooks-independent", CYCLES}),
        shown="sglang_eagle_overlap.adapters.v0_5_16.band -> sglang_eagle_overlap.adapters.v0_5_16.eagle_sample",
    ),
}


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_each_violation_breaks_its_contract(tree, case):
    violation = VIOLATIONS[case]
    _write(tree, violation.files)
    for name, text in violation.appended.items():
        _append(tree, name, text)
    outcome = run_checker(tree)
    assert outcome.broken == violation.broken, outcome.output
    assert outcome.returncode != 0, outcome.output
    assert violation.shown in outcome.output, outcome.output
    for contract_id in violation.broken - {CYCLES}:
        assert f"{CONTRACTS[contract_id]} BROKEN" in outcome.output
    assert "import contracts broken" in outcome.output
