"""Warm-up for the mutation run (``scripts/mutation.sh``); not a test module and imported by nothing else.

mutmut's fork server imports this once (``[tool.mutmut] preload_modules_file``) and forks one worker per mutant from
it. Importing what the core tests import and compiling the test grammars here means every worker starts with torch,
xgrammar, SGLang's grammar modules, the plugin's modules (the mutated copies: 3 MB of source to compile, since mutmut's
trampolines pick the active mutant at call time, not at import), the tokenizer infos and the compiled grammars in
memory, instead of rebuilding them (measured here: ~6 s of a worker's start, and 3-11 s per vocabulary). Workers only
create matchers from these compiled grammars, which needs no compiler thread, so nothing here depends on a thread
surviving the fork.
"""

from __future__ import annotations

import gc

import hypothesis  # noqa: F401
import torch  # noqa: F401
import xgrammar  # noqa: F401

from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.tokenizers import VOCAB_SIZES

G.ensure_sglang_importable()
import sglang.srt.constrained.xgrammar_backend  # noqa: E402,F401
import sglang.srt.speculative.spec_utils  # noqa: E402,F401

import sglang_eagle_overlap.core  # noqa: E402,F401
import sglang_eagle_overlap.integration.requests  # noqa: E402,F401
import sglang_eagle_overlap.plugin  # noqa: E402,F401

for _vocab in VOCAB_SIZES:
    for _name in G.GRAMMARS:
        G.compiled(_name, _vocab)

# Everything above stays alive for the server's life: keep the garbage collector of every worker off it (pytest
# collects garbage at the end of each run; over torch's and SGLang's objects that alone took ~3 s per worker here).
gc.freeze()
