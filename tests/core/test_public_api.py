"""The core's public API stays small and typed: what the rest of the package may use is ``sglang_eagle_overlap.core``
(its ``__all__``), the step object keeps a short call surface, and the runs that cross the boundary are records with
one field order (docs/architecture.md, "Layers"). The import contracts (``scripts/importcheck.sh``) check who
imports what; these check the shape of what is imported."""

from __future__ import annotations

import inspect
from typing import List

import sglang_eagle_overlap.core as core

MAX_STEP_MEMBERS = 15
MAX_STEP_PARAMETERS = 6


def _public_members(cls: type) -> List[str]:
    return sorted(name for name, value in vars(cls).items()
                  if not name.startswith("_") and (callable(value) or isinstance(value, property)))


def test_every_exported_name_exists_and_nothing_private_is_exported() -> None:
    missing = [name for name in core.__all__ if not hasattr(core, name)]
    assert missing == []
    assert not [name for name in core.__all__ if name.startswith("_")]


def test_the_step_keeps_a_short_call_surface() -> None:
    members = _public_members(core.GrammarStep)
    assert len(members) <= MAX_STEP_MEMBERS, members
    # the verify step's call order (module docstring of core.step) is all there
    for name in ("copy_tree", "start_build", "finish_build", "feed", "feed_later", "replay", "prune"):
        assert name in members
    params = [p for p in inspect.signature(core.GrammarStep.__init__).parameters if p != "self"]
    assert len(params) <= MAX_STEP_PARAMETERS, params


def test_telemetry_and_settings_are_parts_the_step_is_given() -> None:
    telemetry = core.StepTelemetry(stats_file=None)
    config = core.StepConfig(mask_time_limit_s=None, grammar_thread=True)
    step = core.GrammarStep(config, telemetry=telemetry)
    try:
        assert step.telemetry is telemetry and step.config is config
        assert not hasattr(step, "write_stats") and not hasattr(step, "snapshot")  # reporting is the part's
    finally:
        step.close()


def test_runs_and_row_runs_share_one_field_order() -> None:
    assert core.Run._fields == ("key", "grammar", "matcher", "start", "tokens")
    assert core.RowRun._fields == ("key", "grammar", "matcher", "start", "row")
    run = core.Run(key="r", grammar=None, matcher=None, start=3, tokens=(1, 2))
    key, grammar, matcher, start, tokens = run  # a record, still unpacked as the ledger does
    assert (key, start, tokens) == ("r", 3, (1, 2)) and run.start == 3
