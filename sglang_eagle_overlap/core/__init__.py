"""Engine-agnostic core: imports neither SGLang nor CUDA-only code."""

from sglang_eagle_overlap.core.ledger import (
    AcceptLedger,
    AdvanceOutcome,
    GrammarLike,
    LedgerConflictError,
    LedgerGapError,
)
from sglang_eagle_overlap.core.mask import (
    HostGrammar,
    MaskRequest,
    MaskStrategy,
    TreeMask,
    TreeMaskBuilder,
    bitmask_width,
    neutralize_timed_out_drafts,
)
from sglang_eagle_overlap.core.stats import COUNTERS, StepStats
from sglang_eagle_overlap.core.step import GrammarStep, MaskJob, StepMask
from sglang_eagle_overlap.core.tree_copy import HostTreeCopier, PendingTree

__all__ = [
    "COUNTERS",
    "AcceptLedger",
    "AdvanceOutcome",
    "GrammarLike",
    "GrammarStep",
    "HostGrammar",
    "HostTreeCopier",
    "LedgerConflictError",
    "LedgerGapError",
    "MaskJob",
    "MaskRequest",
    "MaskStrategy",
    "PendingTree",
    "StepMask",
    "StepStats",
    "TreeMask",
    "TreeMaskBuilder",
    "bitmask_width",
    "neutralize_timed_out_drafts",
]
