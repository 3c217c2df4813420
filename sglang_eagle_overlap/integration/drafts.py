"""Grammar-forced drafts (issue 19) at SGLang's verify, the same for both bands and the vendored patches.

Call order per EAGLE verify (``run_eagle_verify``), on the scheduler thread:

1. entry, before ``eagle_prepare_for_verify`` turns the draft tokens into the target's input (and, on a GPU, into
   the CUDA graph's buffers): :func:`before_verify` -- a plugin-owned grammar step replaces its top-path drafts with
   the forced tokens the previous step picked (:meth:`~sglang_eagle_overlap.core.forced.ForcedDrafts.apply`); any
   other verify drops them, so they are never applied to a later step;
2. the grammar job records each valid node's forced continuation while it builds the mask; ``GrammarStep`` uploads
   the table with the mask;
3. right after the host's ``eagle_sample`` of a plugin-owned step: :func:`after_sample` -- the device picks the
   accepted node's row (:meth:`~sglang_eagle_overlap.core.forced.ForcedDrafts.after_verify`).

The tokenizer is the requests' own (``Req.tokenizer``, set by SGLang's scheduler), taken from the first request that
has one: its ``encode`` tokenizes the forced text, its ``decode`` lets the core find the other tokenizations of that
text the draft model may propose (kept, not replaced). Without one, nothing is recorded and nothing replaced.
"""

from __future__ import annotations

from typing import Any, List, Sequence

from sglang_eagle_overlap.integration.runtime import Runtime

__all__ = ["after_sample", "before_verify", "request_ids"]

# ``batch`` / ``verify_input`` are SGLang's ScheduleBatch / EagleVerifyInput: Any (SGLang ships no types).


def request_ids(reqs: Sequence[Any]) -> List[str]:
    return [str(getattr(r, "rid", "")) for r in reqs]


def before_verify(rt: Runtime, batch: Any, verify_input: Any, owned: bool) -> None:
    """Step 1 (see the module docstring). ``owned``: the plugin builds this step's grammar mask."""
    forced = rt.step.forced
    if forced is None:
        return
    if not owned or verify_input is None or getattr(verify_input, "draft_token", None) is None:
        forced.discard()
        return
    if forced.encode is None:
        tok = next((r.tokenizer for r in batch.reqs if getattr(r, "tokenizer", None) is not None), None)
        if tok is not None:
            forced.encode = lambda s: tok.encode(s, add_special_tokens=False)
            forced.decode = tok.decode
    forced.apply(verify_input.draft_token, verify_input.retrieve_next_token, request_ids(batch.reqs),
                 draft_probs_used=getattr(verify_input, "draft_probs", None) is not None,
                 chain=getattr(verify_input, "topk", 0) == 1)


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
