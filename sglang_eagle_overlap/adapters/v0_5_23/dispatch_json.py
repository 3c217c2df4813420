"""AROUND ``sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json``.

Why: inside a JSON-schema string with ``maxLength``, once 9 or fewer characters are left, xgrammar 0.2.7's
``fill_next_token_bitmask`` takes 1-31 ms per token on a 128k vocabulary, for every request with such a schema and
for SGLang's own path alike; the same bound written as the pattern ``^[^\\x00-\\x1f"\\\\]{min,max}$`` fills in
~0.01 ms up to 128 characters, and admits the same strings minus raw control characters (not JSON). The schema must be
rewritten where xgrammar compiles it and nowhere above: SGLang's grammar cache, its logs and its errors keep the schema
text as the request sent it.

How: SGLang's grammar cache calls ``dispatch_json(key_string)`` on a miss, on its compile thread;
:func:`~.band.dispatch_json` compiles the text ``integration.schemas.schema_to_compile`` gives (the text as sent unless
the switch ``SGLANG_EAGLE_OVERLAP_MAX_LENGTH_PATTERN`` and the installed xgrammar's measured bound allow a rewrite)
through SGLang's own ``dispatch_json``, so SGLang's validation and error handling run unchanged.

Upstream state: xgrammar 0.2.7 compiles ``maxLength`` to ``[^"\\\\\\r\\n]{min,max}`` (slow fills near the bound:
xgrammar issue #852, PRs #903 / #917 target it; raw control characters admitted); SGLang 0.5.23 passes the schema
through unchanged.

When to remove: when the installed xgrammar fills a ``maxLength`` string as fast as the pattern and excludes control
characters from it (then ``settings.MAX_LENGTH_PATTERN_BOUNDS`` should not list that version, and this hook does
nothing).
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_eagle_overlap.adapters.v0_5_23 import band
from sglang_eagle_overlap.integration import runtime
from sglang_eagle_overlap.integration.hooks import Hook

TARGET = "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.dispatch_json"


# ``self`` is SGLang's XGrammarGrammarBackend and the result its grammar object: Any (SGLang ships no types).
def dispatch_json_around(original: Callable[..., Any], self: Any, key_string: str) -> Any:
    rt = runtime.active()
    if rt is None or rt.max_length_pattern_bound is None:
        return original(self, key_string)
    return band.dispatch_json(rt, original, self, key_string)


HOOK = Hook(
    target=TARGET,
    hook_type="AROUND",
    fn=dispatch_json_around,
    callers=(),  # a method: every caller goes through the class attribute
    why="bounded maxLength strings compiled as control-character-free patterns (fast masks, valid JSON)",
)
