"""Engine-agnostic core: imports neither SGLang nor CUDA-only code.

The public API: what the outer layers (``integration/``, ``adapters/``, ``plugin.py``, ``metrics.py``) import, always
from this package, and the records that cross the boundary (``Run``, ``RowRun``, ``FeedOutcome``). Tests, benchmarks
and dev tools may import the submodules to reach internals.
"""

from sglang_eagle_overlap.core.forced import BatchEncoder, ForcedDrafts
from sglang_eagle_overlap.core.ledger import FeedOutcome, ResultRuns, RowRun, Run
from sglang_eagle_overlap.core.mask import MaskBatch, MaskRequest
from sglang_eagle_overlap.core.native import NativeGrammar, NativeUnavailable, load_native
from sglang_eagle_overlap.core.schema import SchemaTextRewrite, rewrite_schema_text
from sglang_eagle_overlap.core.step import GrammarStep, MaskJob, StepConfig, StepMask
from sglang_eagle_overlap.core.telemetry import StepTelemetry
from sglang_eagle_overlap.core.timeline import process_timeline
from sglang_eagle_overlap.core.tree_copy import PendingTree

__all__ = [
    "BatchEncoder",
    "FeedOutcome",
    "ForcedDrafts",
    "GrammarStep",
    "MaskBatch",
    "MaskJob",
    "MaskRequest",
    "NativeGrammar",
    "NativeUnavailable",
    "PendingTree",
    "ResultRuns",
    "RowRun",
    "Run",
    "SchemaTextRewrite",
    "StepConfig",
    "StepMask",
    "StepTelemetry",
    "load_native",
    "process_timeline",
    "rewrite_schema_text",
]
