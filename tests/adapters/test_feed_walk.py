"""The walk (docs/architecture.md): a verify step's accepted tokens reach the core in at most 8 Python frames on the
scheduler thread, crossing the plugin <-> SGLang boundary at most twice, on every path of the installed band.

The walk of a path is the list of frames from the SGLang function that hands the tokens over (its frame counted) to
the core's entry that takes the run (``GrammarStep.feed_later`` for a barrier or 0.5.23's post-processing,
``GrammarStep.replay_whole`` / ``feed`` for 0.5.16's post-processing of a run the barrier fed / did not feed;
that frame counted), HookRegistry's wrapper frames included. A frame is SGLang's when its module is under
``sglang.``, the plugin's when under ``sglang_eagle_overlap``; a crossing is a pair of neighbouring frames of which
one is SGLang's and the other the plugin's. The frames are recorded in a fresh interpreter with the plugin's hooks
applied to the installed SGLang (``sglang_eo_dev.probes.feed_walk``, which names each path's SGLang function)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from sglang_eo_dev.helpers.patched_sglang import run_probe

MAX_FRAMES = 8
MAX_CROSSINGS = 2
# The paths of each band: 0.5.16's barrier runs in its run_eagle_verify hook, its post-processing in
# _accept_grammar_tokens; 0.5.23's barrier and post-processing both call advance_grammar_fsm.
PATHS = {"0.5.16": {"barrier", "post_replay", "post_feed"}, "0.5.23": {"barrier", "post"}}
ENTRIES = {"barrier": "GrammarStep.feed_later", "post": "GrammarStep.feed_later",
           "post_replay": "GrammarStep.replay_whole", "post_feed": "GrammarStep.feed"}


def _side(frame: str) -> str:
    module = frame.split(":", 1)[0]
    if module == "sglang_eagle_overlap" or module.startswith("sglang_eagle_overlap."):
        return "plugin"
    if module == "sglang" or module.startswith("sglang."):
        return "sglang"
    return "other"


def crossings(walk: List[str]) -> int:
    sides = [_side(f) for f in walk]
    return sum(1 for a, b in zip(sides, sides[1:]) if {a, b} == {"plugin", "sglang"})


@pytest.fixture(scope="module")
def walks() -> Dict[str, Any]:
    got: Dict[str, Any] = run_probe(["-m", "sglang_eo_dev.probes.feed_walk"], SGLANG_EAGLE_OVERLAP=None,
                                    SGLANG_EAGLE_OVERLAP_GRAMMAR_THREAD=None)
    return got


def test_every_path_of_the_band_is_walked(walks: Dict[str, Any]) -> None:
    assert set(walks["walks"]) == PATHS[walks["band"]]


def _check(walks: Dict[str, Any], path: str) -> None:
    walk = walks["walks"][path]
    assert _side(walk[0]) == "sglang" and walk[-1].endswith(ENTRIES[path]), walk
    assert all(_side(f) != "other" for f in walk), walk  # nothing but SGLang and the plugin between the two ends
    assert len(walk) <= MAX_FRAMES, "\n".join(walk)
    assert crossings(walk) <= MAX_CROSSINGS, "\n".join(walk)


@pytest.mark.sglang_0_5_16
@pytest.mark.parametrize("path", sorted(PATHS["0.5.16"]))
def test_the_0_5_16_walk_is_short(walks: Dict[str, Any], path: str) -> None:
    _check(walks, path)


@pytest.mark.sglang_0_5_23
@pytest.mark.parametrize("path", sorted(PATHS["0.5.23"]))
def test_the_0_5_23_walk_is_short(walks: Dict[str, Any], path: str) -> None:
    _check(walks, path)


def test_a_crossing_is_a_pair_of_neighbours_from_both_sides() -> None:
    s, p = "sglang.srt.x:f", "sglang_eagle_overlap.core.step:g"
    assert crossings([s, s, p, p]) == 1 and crossings([s, p, s, p]) == 3 and crossings([p, p]) == 0
