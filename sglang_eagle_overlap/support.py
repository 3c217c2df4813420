"""What the plugin does for each speculative algorithm on each supported SGLang band, as data (pure: imports nothing).

The "Speculative algorithms" table of docs/compatibility.md is this table. Adapters read it (0.5.16: the EAGLE family
whose grammar batches the plugin keeps in the overlap is :func:`kept_algorithms`), and log
:func:`stand_aside_message` once per process for an algorithm the plugin leaves to SGLang.

Decisions:

* ``keep`` -- grammar decode batches stay in the overlapped pipeline with the plugin's guarantees: each accepted token
  advanced exactly once (the ledger), tree masks exact (equal to SGLang's own DFS), verify tree copied to the host
  asynchronously before the verify launch.
* ``mask-only`` -- SGLang itself runs these grammar batches synchronously, by design; the plugin still builds the
  exact tree mask natively and advances through the ledger (exactly once), but there is no overlap to keep.
* ``stand-aside`` -- the plugin does nothing for this algorithm: SGLang's own path, unchanged (said once in the log).

Algorithm names are SGLang's resolved names: ``--speculative-algorithm NEXTN`` (MTP heads: DeepSeek, Qwen3-Next,
GLM, MiMo style) is resolved to ``EAGLE`` by SGLang's argument handling on both bands, so it takes EAGLE's row; the
draft is the model's own MTP layer (``--speculative-draft-model-path`` = the target checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Literal, Optional, Tuple

__all__ = [
    "ALIASES",
    "Cell",
    "Decision",
    "SUPPORT",
    "UNTESTED",
    "cell",
    "kept_algorithms",
    "resolve",
    "stand_aside_message",
]

Decision = Literal["keep", "mask-only", "stand-aside"]

# CLI names SGLang resolves to another algorithm before any worker exists (speculative_hook.py, both bands).
ALIASES: Dict[str, str] = {"NEXTN": "EAGLE"}


@dataclass(frozen=True)
class Cell:
    """One band x algorithm entry. ``tested_by`` names the engine test (``None``: not runnable on the CPU runtime)."""

    band: str
    algorithm: str
    decision: Decision
    reason: str
    tested_by: Optional[str]


_ALGO_TEST = "tests/e2e/test_algorithms.py"
_EQUIV_TEST = "tests/e2e/test_plugin_equivalence.py"

_KEEP_16 = (
    "SGLang 0.5.16 forces every speculative grammar decode batch to sync; its verify goes through "
    "run_eagle_verify, which the plugin hooks (async tree copy, barrier advance, native mask)"
)
_KEEP_23 = (
    "SGLang 0.5.23 overlaps it itself (supports_grammar_overlap); the plugin replaces the tree copy, the barrier "
    "advance and the Python DFS mask"
)
_NGRAM_16 = (
    "NGRAM drafts on the host from req.output_ids and builds its mask inline (generate_token_bitmask) without a "
    "barrier; both need the previous step processed first, so SGLang's synchronous grammar path is kept"
)
_NGRAM_23 = (
    "SGLang 0.5.23 keeps NGRAM grammar batches synchronous by design (host-side drafts, grammar_needs_sync); the "
    "plugin builds the tree mask natively (GrammarTree.from_host) and advances through the ledger"
)

SUPPORT: Tuple[Cell, ...] = (
    Cell("0.5.16", "EAGLE", "keep", _KEEP_16 + "; NEXTN / MTP heads resolve to EAGLE", _ALGO_TEST),
    Cell("0.5.16", "EAGLE3", "keep", _KEEP_16, _EQUIV_TEST),
    Cell("0.5.16", "STANDALONE", "keep", _KEEP_16 + " (StandaloneWorkerV2 is an EAGLEWorkerV2)", _ALGO_TEST),
    Cell("0.5.16", "NGRAM", "stand-aside", _NGRAM_16, _ALGO_TEST),
    Cell("0.5.23", "EAGLE", "keep", _KEEP_23 + "; NEXTN / MTP heads resolve to EAGLE", _ALGO_TEST),
    Cell("0.5.23", "EAGLE3", "keep", _KEEP_23, _EQUIV_TEST),
    Cell("0.5.23", "STANDALONE", "keep", _KEEP_23 + " (StandaloneWorkerV2 is an EAGLEWorkerV2)", _ALGO_TEST),
    Cell("0.5.23", "NGRAM", "mask-only", _NGRAM_23, _ALGO_TEST),
)

# Algorithms SGLang also has on these bands whose models the CPU runtime cannot run (no engine test here): what the
# plugin does for them, read from the installed sources. Not in SUPPORT, so nothing treats them as tested.
UNTESTED: Tuple[Cell, ...] = (
    Cell("0.5.16", "EAGLE (multi-layer MTP, --enable-multi-layer-eagle)", "keep",
         "MultiLayerEagleWorkerV2 verifies through run_eagle_verify, which the plugin hooks; needs a model with "
         "several MTP layers (MiMo-V2 style)", None),
    Cell("0.5.16", "FROZEN_KV_MTP", "stand-aside",
         "not in the plugin's EAGLE family (Gemma4 assistant drafts; needs Gemma4 layers)", None),
    Cell("0.5.16", "DFLASH / DSPARK", "stand-aside",
         "their 0.5.16 workers build no grammar tree mask; needs their block-diffusion drafts", None),
    Cell("0.5.23", "EAGLE (multi-layer MTP, --enable-multi-layer-eagle)", "keep",
         "verifies through run_eagle_verify (GrammarTree / build_grammar_vocab_mask, hooked); needs a model with "
         "several MTP layers", None),
    Cell("0.5.23", "FROZEN_KV_MTP", "keep",
         "an EAGLEWorkerV2 subclass: run_eagle_verify path, hooked; needs a Gemma4 assistant draft", None),
    Cell("0.5.23", "DFLASH / DSPARK", "keep",
         "SGLang overlaps them (supports_grammar_overlap); their GrammarTree.from_linear_chain and "
         "build_grammar_vocab_mask calls are hooked; needs their block-diffusion drafts", None),
    Cell("0.5.23", "UNO", "stand-aside", "SGLang rejects grammar requests with UNO (NotImplementedError)", None),
)

_BY_KEY: Dict[Tuple[str, str], Cell] = {(c.band, c.algorithm): c for c in SUPPORT}


def resolve(algorithm: str) -> str:
    """SGLang's resolved name for a CLI algorithm name (``NEXTN`` -> ``EAGLE``); upper-cased."""
    name = str(algorithm).upper()
    return ALIASES.get(name, name)


def cell(band: str, algorithm: str) -> Optional[Cell]:
    """The table entry for ``band`` ("0.5.16" / "0.5.23") and ``algorithm`` (any case, aliases resolved), or None for
    an algorithm the table does not list (the plugin then stands aside)."""
    return _BY_KEY.get((band, resolve(algorithm)))


def kept_algorithms(band: str) -> FrozenSet[str]:
    """Resolved names whose grammar decode batches the plugin keeps in the overlap on ``band``."""
    return frozenset(c.algorithm for c in SUPPORT if c.band == band and c.decision == "keep")


def stand_aside_message(band: str, algorithm: str) -> str:
    """The one log line for an algorithm the plugin leaves to SGLang on ``band``."""
    entry = cell(band, algorithm)
    why = entry.reason if entry is not None else "not in the plugin's support table (sglang_eagle_overlap/support.py)"
    return (
        f"sglang-eagle-overlap: speculative algorithm {resolve(algorithm)} on SGLang {band}: the plugin stands aside, "
        f"grammar batches take SGLang's own path ({why})"
    )
