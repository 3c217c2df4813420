"""The schema rewrite in a running process: which ``maxLength`` bound applies here, and the text a band compiles for
one JSON-schema request (the rewrite itself is :mod:`sglang_eagle_overlap.core`'s ``rewrite_schema_text``).

Call order: ``runtime.create`` reads the bound once (``Runtime.max_length_pattern_bound``: the switch and the
installed xgrammar's version, ``settings.MAX_LENGTH_PATTERN_BOUNDS``); ``plugin.load`` logs once what it is
(:func:`describe`); a band's JSON-schema compile hook calls :func:`schema_to_compile` for every schema SGLang
compiles, on SGLang's grammar-compile thread, below SGLang's grammar cache (which keys by the text as sent).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from sglang_eagle_overlap.core import SchemaTextRewrite, rewrite_schema_text
from sglang_eagle_overlap.integration.runtime import Runtime
from sglang_eagle_overlap.settings import ENV, MAX_LENGTH_PATTERN_BOUNDS, Settings

__all__ = ["describe", "schema_to_compile"]

logger = logging.getLogger("sglang_eagle_overlap")

# SGLang compiles on a thread pool: the counter is incremented under a lock (the scheduler thread only reads it).
_count_lock = threading.Lock()


def describe(settings: Settings, xgrammar_version: Optional[str], hooked: bool) -> str:
    """One log line: what the switch does in this process (``hooked``: the band hooks SGLang's JSON-schema
    compile), and why when nothing."""
    variable = ENV["max_length_pattern"]
    if not settings.max_length_pattern:
        return f"{variable}=0: JSON schemas compile as sent"
    bound = settings.max_length_pattern_bound(xgrammar_version)
    if bound is None or not hooked:
        measured = ", ".join(MAX_LENGTH_PATTERN_BOUNDS)
        return (f"{variable} has no effect with xgrammar {xgrammar_version} on this SGLang (measured faster only on "
                f"xgrammar {measured}, SGLang 0.5.23): JSON schemas compile as sent")
    return (f"JSON-schema strings bounded by maxLength <= {bound} compile as control-character-free patterns "
            f"(xgrammar {xgrammar_version}; {variable}=0 compiles schemas as sent)")


def schema_to_compile(rt: Runtime, text: str) -> SchemaTextRewrite:
    """What to compile for the JSON-schema text ``text``: ``rewrite_schema_text`` with the process's bound, or
    ``text`` unchanged when there is none. A rewritten schema counts as ``schemas_rewritten`` in the stats."""
    bound = rt.max_length_pattern_bound
    if bound is None:
        return SchemaTextRewrite(text, None, "no bound in this process")
    result = rewrite_schema_text(text, bound)
    if result.changed:
        with _count_lock:
            rt.step.count("schemas_rewritten")
        done = result.rewrite
        if done is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("sglang-eagle-overlap: %d maxLength string(s) compiled as patterns (%s); left alone: %s",
                         len(done.rewritten), ", ".join(r.pointer for r in done.rewritten),
                         "; ".join(f"{a.pointer}: {a.reason}" for a in done.left_alone) or "none")
    return result
