"""Grammar-forced drafts at SGLang's verify, the same for both bands and the vendored patches.

Call order per EAGLE verify (``run_eagle_verify``), on the scheduler thread:

1. entry, before ``eagle_prepare_for_verify`` turns the draft tokens into the target's input (and, on a GPU, into
   the CUDA graph's buffers): :func:`before_verify` -- a plugin-owned grammar step replaces its top-path drafts with
   the forced tokens the previous step picked (:meth:`~sglang_eagle_overlap.core.ForcedDrafts.apply`); any
   other verify drops them, so they are never applied to a later step;
2. the grammar job records each valid node's forced continuation while it builds the mask; ``GrammarStep`` uploads
   the table with the mask;
3. right after the host's ``eagle_sample`` of a plugin-owned step: :func:`after_sample` -- the device picks the
   accepted node's row (:meth:`~sglang_eagle_overlap.core.ForcedDrafts.after_verify`).

The tokenizer is the requests' own (``Req.tokenizer``, set by SGLang's scheduler), taken from the first request that
has one: its ``encode`` tokenizes the forced text, its ``decode`` lets the core find the other tokenizations of that
text the draft model may propose (kept, not replaced). Without one, nothing is recorded and nothing replaced. With
the switch unset ("auto"), the first verify decides by its algorithm (``Settings.forced_drafts_for``): a draft trained
on the target's outputs already proposes the forced text, so they stay off there and cost nothing. A
Hugging Face fast tokenizer's Rust ``backend_tokenizer`` also encodes many strings per call (:func:`batch_encoder`):
a forced string met for the first time then costs two tokenizer calls instead of ~20 on the grammar job.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence

from sglang_eagle_overlap.core import BatchEncoder
from sglang_eagle_overlap.integration.requests import algorithm_name
from sglang_eagle_overlap.integration.runtime import Runtime
from sglang_eagle_overlap.settings import FORCED_DRAFTS_AUTO_ALGORITHMS

__all__ = ["after_sample", "batch_encoder", "before_verify", "request_ids"]

logger = logging.getLogger("sglang_eagle_overlap")

# Tokenized both ways before the batch encoder is trusted: JSON punctuation, spaces, a newline, non-ASCII, digits.
_CHECK_TEXTS = ('{"name": "Ada", "tags": [1, 2]}', '", "', " \n  ", "café – ok", "12.5e-3", ":")

# ``batch`` / ``verify_input`` are SGLang's ScheduleBatch / EagleVerifyInput: Any (SGLang ships no types).


def request_ids(reqs: Sequence[Any]) -> List[str]:
    return [str(getattr(r, "rid", "")) for r in reqs]


def before_verify(rt: Runtime, batch: Any, verify_input: Any, owned: bool) -> None:
    """Step 1 (see the module docstring). ``owned``: the plugin builds this step's grammar mask."""
    forced = rt.step.forced
    if forced is None:
        return
    if not rt.forced_decided and rt.settings.forced_drafts is None:
        rt.forced_decided = True
        algorithm = algorithm_name(batch)
        if not rt.settings.forced_drafts_for(algorithm):
            rt.step.forced = None
            logger.info("sglang-eagle-overlap: grammar-forced drafts off for %s (SGLANG_EAGLE_OVERLAP_FORCED_DRAFTS "
                        "unset: on for %s, whose verify trees the plugin owns; =1 turns them on)",
                        algorithm or "this algorithm", ", ".join(sorted(FORCED_DRAFTS_AUTO_ALGORITHMS)))
            return
    if not owned or verify_input is None or getattr(verify_input, "draft_token", None) is None:
        forced.discard()
        return
    if forced.encode is None:
        tok = next((r.tokenizer for r in batch.reqs if getattr(r, "tokenizer", None) is not None), None)
        if tok is not None:
            forced.encode = lambda s: tok.encode(s, add_special_tokens=False)
            forced.decode = tok.decode
            forced.encode_batch = batch_encoder(tok)
    # a grammar whose forced text may never end (no finite document) is never asked for it: xgrammar's search would
    # allocate until the process runs out of memory (the runtime's ForcedDrafts asks only admitted matchers)
    for r in batch.reqs:
        grammar = getattr(r, "grammar", None)
        matcher, compiled = getattr(grammar, "matcher", None), getattr(grammar, "ctx", None)
        if matcher is not None and compiled is not None:
            forced.admit(matcher, compiled)
    forced.apply(verify_input.draft_token, verify_input.retrieve_next_token, request_ids(batch.reqs),
                 draft_probs_used=getattr(verify_input, "draft_probs", None) is not None,
                 chain=getattr(verify_input, "topk", 0) == 1)


def batch_encoder(tok: Any) -> Optional[BatchEncoder]:
    """``tok.encode(s, add_special_tokens=False)`` for many strings in one call, through a Hugging Face fast
    tokenizer's Rust ``backend_tokenizer`` (what its ``encode`` runs, without the per-call Python around it). None when
    ``tok`` has none, or when the two disagree on :data:`_CHECK_TEXTS` (then every string goes through ``encode``)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "encode_batch", None)):
        return None

    def encode_batch(texts: Sequence[str]) -> List[List[int]]:
        return [list(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]

    try:
        same = encode_batch(_CHECK_TEXTS) == [list(tok.encode(t, add_special_tokens=False)) for t in _CHECK_TEXTS]
    except Exception as exc:  # noqa: BLE001  a tokenizer whose backend call differs: per-string encode
        logger.info("sglang-eagle-overlap: the tokenizer's batch encoder is not usable (%s: %s); forced drafts "
                    "tokenize string by string", type(exc).__name__, exc)
        return None
    if not same:
        logger.info("sglang-eagle-overlap: the tokenizer's batch encoder disagrees with its encode; forced drafts "
                    "tokenize string by string")
        return None
    return encode_batch


def after_sample(rt: Runtime, batch: Any, sample_result: Any) -> None:
    """Step 3: ``sample_result`` is ``eagle_sample``'s ``(predict, accept lengths, accept_index)``."""
    forced = rt.step.forced
    if forced is None:
        return
    try:
        accept_index = sample_result[2]
    except (TypeError, IndexError):
        forced.discard()
        return
    forced.after_verify(accept_index, request_ids(batch.reqs))
