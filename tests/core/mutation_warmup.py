"""Warm-up for the mutation run (``scripts/mutation.sh``); not a test module and imported by nothing else.

mutmut's fork server imports this once (``[tool.mutmut] preload_modules_file``) and forks one worker per mutant from
it. Importing what the core tests import and compiling the test grammars here means every worker starts with torch,
xgrammar, SGLang's grammar modules, the tokenizer infos and the compiled grammars in memory, instead of rebuilding
them (3-11 s per vocabulary on 2 cores). Workers only create matchers from these compiled grammars, which needs no
compiler thread, so nothing here depends on a thread surviving the fork.
"""

from __future__ import annotations

import hypothesis  # noqa: F401
import torch  # noqa: F401
import xgrammar  # noqa: F401

from sglang_eo_dev.helpers import grammars as G
from sglang_eo_dev.helpers.tokenizers import VOCAB_SIZES

G.ensure_sglang_importable()
import sglang.srt.constrained.xgrammar_backend  # noqa: E402,F401
import sglang.srt.speculative.spec_utils  # noqa: E402,F401

for _vocab in VOCAB_SIZES:
    for _name in G.GRAMMARS:
        G.compiled(_name, _vocab)
