"""Greedy output against a greedy reference, token for token up to bf16 near-ties (pure Python: no torch, no CUDA).

Why: two bf16 forwards of the same context that differ only in their kernels (a batched and a single decode, a
tree-verify forward and a decode forward, CUDA graph or not) produce logits that differ by a few bf16 ulps, and where
the reference's top two tokens are that close, greedy argmax picks either. Stock SGLang itself does this on the H200
with the tiny random pair (its non-speculative greedy output differs between single and batched requests). So the
claim checked here is: the candidate equals the reference token for token, or, at the first position ``p`` where the
two differ, the reference's top-1 and top-2 logprobs lie less than :data:`EPS` apart and the two outputs' tokens at
``p`` are exactly those two tokens (each picked one of the tied pair). Positions after ``p`` are not compared: the two
contexts differ from there on. Anything else (a token outside the reference's top two, a gap of at least ``EPS``, a
runner-up the grammar masked out, one output ending where the other goes on) fails, naming the request, the
position, both tokens and the gap.

The reference's per-position top logprobs are SGLang's ``meta_info["output_top_logprobs"]`` of a request sent with
``return_logprob=True, top_logprobs_num=2``, read in the installed SGLang 0.5.16 (0.5.23 alike):

* shape: one entry per output position, aligned with ``output_ids`` (the stop token included: ``output_streamer``
  slices both by ``output_ids_through_stop``); each entry a list of ``(logprob, token_id, text)`` tuples (``text`` is
  ``None`` without ``return_text_in_logprobs``; JSON arrays over HTTP), best first (``torch.topk``), or ``None``
  where SGLang had no values (``TokenizerManager.detokenize_top_logprobs_tokens``);
* after the grammar mask: the non-speculative path applies the vocab mask in place to ``next_token_logits``
  (``ModelRunner._preprocess_logits`` -> ``SamplingBatchInfo.apply_logits_bias`` -> ``apply_vocab_mask``) before the
  ``Sampler`` takes ``argmax`` and ``log_softmax`` of the same tensor; the EAGLE verify path masks the verify logits
  in place in ``eagle_sample`` before ``compute_spec_v2_logprobs`` gathers and ``log_softmax``-es them. So a token the
  grammar forbids has logprob ``-inf``, or float32's lowest (``-3.4e38``) where SGLang clamps (the spec path; 0.5.23
  everywhere), and over HTTP ``-inf`` arrives as ``null`` (orjson writes non-finite floats as null). All of these
  count as masked here: a masked runner-up is never a near-tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

__all__ = ["EPS", "MIN_COMPARED_FRACTION", "GreedyMismatch", "Verdict", "GroupVerdict", "ranked_top",
           "compare_greedy", "compare_group"]

# EPS, in nats: the widest top-1/top-2 logprob gap at which a greedy argmax is allowed to have flipped between two
# bf16 forwards. SGLang's logits come out of a bf16 lm_head matmul (rounded to bf16, then cast to float32:
# LogitsProcessor._get_logits), and a logprob gap equals the logit gap, so two kernels' gaps differ by whole bf16 ulps
# of the logits plus what earlier bf16 roundings carried forward. The random pair's logits are small: |logit| < 0.8
# at all 384 greedy positions measured (8 prompts x 48 tokens), where one bf16 ulp is 2^-8 = 0.0039. Measured on CPU
# with transformers (2026-11-27), the top-2 gap changed by at most 0.0077 nats between bf16 and float32, 0.0059
# between a bf16 KV-cache decode and a bf16 full forward, 0.0039 between bf16 left-padded batched and single forwards
# (which flipped 15 of the 384 argmaxes). 0.02 nats (~5 ulps, 2.5x the largest change measured) covers that with
# margin. A larger EPS would stop being a tie criterion on this model: its median top-1/top-2 gap is 0.031 nats, 37 %
# of its gaps are under 0.02 and 95 % under 0.1, so at 0.1 the runner-up would pass nearly anywhere. A model with
# larger logits needs a larger EPS (the ulp grows with the magnitude: 0.03 at |logit| 4-8, 0.06 at 8-16).
EPS = 0.02

# compare_group's floor against a vacuous pass: with every request diverging at a near-tie within its first tokens
# the check would say nothing. Low on purpose: at CPU bf16's measured flip rate (15 of 384 positions) a request keeps
# about 20 of 48 tokens before its first tie, and grammar-forced tokens (masked runner-up) never flip.
MIN_COMPARED_FRACTION = 0.1

# SGLang clamps masked logprobs to float32's lowest on some paths; anything at or below this is masked.
_MASKED = -1e30


class GreedyMismatch(AssertionError):
    """A divergence that a bf16 near-tie does not explain (or too little compared); the message says where and why."""


@dataclass(frozen=True)
class Verdict:
    """``compared``: positions checked (the agreeing prefix plus the tie position, if any); ``tie_at`` / ``gap``: the
    accepted near-tie divergence (``None`` when the outputs are identical)."""

    compared: int
    tie_at: Optional[int] = None
    gap: Optional[float] = None


@dataclass(frozen=True)
class GroupVerdict:
    compared: int
    total: int  # reference tokens over the group
    ties: Tuple[Tuple[str, int, float], ...]  # (label, position, gap) of each accepted near-tie


def _logprob(value: Any) -> float:
    if value is None:  # orjson writes -inf as null
        return -math.inf
    v = float(value)
    return -math.inf if v <= _MASKED else v


def ranked_top(entries: Optional[Sequence[Sequence[Any]]]) -> List[Tuple[int, float]]:
    """``(token_id, logprob)`` of one position's ``output_top_logprobs`` entry, best first (masked: ``-inf``)."""
    if not entries:
        return []
    pairs = [(int(e[1]), _logprob(e[0])) for e in entries]
    return sorted(pairs, key=lambda t: t[1], reverse=True)  # stable: SGLang's order among equal logprobs


def _fmt(lp: float) -> str:
    return "-inf (masked)" if lp == -math.inf else f"{lp:.4f}"


def compare_greedy(candidate: Sequence[int], reference: Sequence[int],
                   reference_top: Sequence[Optional[Sequence[Sequence[Any]]]], *, eps: float = EPS,
                   label: str = "") -> Verdict:
    """Check ``candidate`` against ``reference`` (token ids), ``reference_top`` being the reference's per-position
    ``output_top_logprobs`` (at least two per position). Returns a :class:`Verdict`; raises :class:`GreedyMismatch`
    unless the outputs are identical or first differ at a near-tie (module docstring)."""
    cand = [int(t) for t in candidate]
    ref = [int(t) for t in reference]
    common = min(len(cand), len(ref))
    p = next((i for i in range(common) if cand[i] != ref[i]), common)
    if p == len(cand) == len(ref):
        return Verdict(compared=len(ref))
    where = (f"{label}: first divergence at position {p} (reference {len(ref)} tokens, candidate {len(cand)}; "
             f"common prefix {ref[max(0, p - 4):p]})")
    if p == len(cand):
        # SGLang's output_ids end with the stop token, so a stop at a tie shows as a token difference, not as this
        raise GreedyMismatch(f"{where}: the candidate ends there, the reference goes on with token {ref[p]}: no "
                             "token of the candidate's to be the other of a tied pair")
    if p == len(ref):
        raise GreedyMismatch(f"{where}: the reference ends there (last token {ref[-1] if ref else None}), the "
                             f"candidate goes on with token {cand[p]}: the reference has no logprobs at that position")
    c, r = cand[p], ref[p]
    top = ranked_top(reference_top[p] if p < len(reference_top) else None)
    if len(top) < 2:
        raise GreedyMismatch(f"{where}: candidate token {c}, reference token {r}; the reference has no top-2 "
                             f"logprobs there (got {top}): cannot call it a near-tie")
    (t1, l1), (t2, l2) = top[0], top[1]
    gap = l1 - l2 if l2 != -math.inf else math.inf
    detail = (f"candidate token {c}, reference token {r}; reference top-2 there: {t1} ({_fmt(l1)}), "
              f"{t2} ({_fmt(l2)}), gap {gap:.4f} nats, near-tie below {eps}")
    if {c, r} != {t1, t2}:
        raise GreedyMismatch(f"{where}: {detail}: the two tokens are not the reference's top two, so no tie explains "
                             "the difference")
    if not gap < eps:
        why = "the runner-up is masked out" if l2 == -math.inf else "not a near-tie"
        raise GreedyMismatch(f"{where}: {detail}: {why}")
    return Verdict(compared=p + 1, tie_at=p, gap=gap)


def compare_group(label: str, candidates: Sequence[Sequence[int]], references: Sequence[Sequence[int]],
                  reference_tops: Sequence[Sequence[Optional[Sequence[Sequence[Any]]]]], *, eps: float = EPS,
                  min_fraction: float = MIN_COMPARED_FRACTION, labels: Optional[Sequence[str]] = None) -> GroupVerdict:
    """:func:`compare_greedy` for each request of a group; raises one :class:`GreedyMismatch` listing every failing
    request, or when fewer than ``min_fraction`` of the reference tokens were compared."""
    if not len(candidates) == len(references) == len(reference_tops):
        raise GreedyMismatch(f"{label}: {len(candidates)} candidates, {len(references)} references, "
                             f"{len(reference_tops)} reference logprob lists")
    names = list(labels) if labels is not None else [str(i) for i in range(len(references))]
    failures, ties, compared, total = [], [], 0, 0
    for name, cand, ref, top in zip(names, candidates, references, reference_tops):
        total += len(ref)
        try:
            v = compare_greedy(cand, ref, top, eps=eps, label=f"{label} [{name}]")
        except GreedyMismatch as exc:
            failures.append(str(exc))
            continue
        compared += v.compared
        if v.tie_at is not None:
            ties.append((name, v.tie_at, float(v.gap or 0.0)))
    if failures:
        raise GreedyMismatch("\n".join(failures))
    if compared < min_fraction * total:
        raise GreedyMismatch(f"{label}: only {compared} of {total} reference tokens compared (floor "
                             f"{min_fraction:.0%}): near-ties cut every request short, the check says nothing; ties "
                             f"(request, position, gap): {ties}")
    return GroupVerdict(compared=compared, total=total, ties=tuple(ties))
