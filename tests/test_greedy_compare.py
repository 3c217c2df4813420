"""``tests/gpu/greedy_compare.py``, the CUDA tests' greedy comparison up to bf16 near-ties, on CPU (pure Python).

The top-logprob entries below have SGLang's shape (``meta_info["output_top_logprobs"]``: per output position a list
of ``(logprob, token_id, text)``, best first; over HTTP lists, a masked ``-inf`` as ``null``).
"""

from __future__ import annotations

import math
import sys

import pytest

from tests.gpu.greedy_compare import EPS, GreedyMismatch, compare_greedy, compare_group, ranked_top

REF = [10, 11, 12, 13, 14, 15]


def _tops(ref, gap=1.0, at=None, runner_up=99, second_lp=None):
    """Top-2 entries per position of ``ref``: the reference token first, ``runner_up`` ``gap`` nats below it (at
    position ``at`` only ``second_lp`` replaces that logprob when given)."""
    out = []
    for i, t in enumerate(ref):
        lp2 = -1.0 - gap
        if i == at and second_lp is not None:
            lp2 = second_lp
        out.append([(-1.0, t, None), (lp2, runner_up, None)])
    return out


def test_identical_outputs_pass_and_count_every_token():
    v = compare_greedy(REF, REF, _tops(REF))
    assert v.compared == len(REF) and v.tie_at is None and v.gap is None
    # identical outputs need no logprobs at all
    assert compare_greedy(REF, REF, []).compared == len(REF)


def test_near_tie_to_the_runner_up_passes_and_reports_what_was_compared():
    tops = _tops(REF)
    tops[3] = [(-1.0, 13, None), (-1.0 - EPS / 2, 77, None)]
    cand = REF[:3] + [77, 1, 2, 3, 4, 5]  # after the tie anything goes (another context), also another length
    v = compare_greedy(cand, REF, tops, label="req")
    assert (v.compared, v.tie_at) == (4, 3) and v.gap == pytest.approx(EPS / 2)


def test_exact_tie_either_order_passes():
    # torch.topk and argmax may order an exact tie differently: the reference's token may be listed second
    tops = _tops(REF)
    tops[2] = [(-1.0, 55, None), (-1.0, 12, None)]
    assert compare_greedy(REF[:2] + [55], REF, tops).tie_at == 2


def test_divergence_at_a_large_gap_fails_naming_position_tokens_and_gap():
    tops = _tops(REF)
    tops[2] = [(-1.0, 12, None), (-1.0 - 2 * EPS, 77, None)]
    with pytest.raises(GreedyMismatch) as exc:
        compare_greedy(REF[:2] + [77, 13], REF, tops, label="case 5 unconstrained")
    msg = str(exc.value)
    assert "case 5 unconstrained" in msg and "position 2" in msg and "candidate token 77" in msg
    assert "reference token 12" in msg and f"gap {2 * EPS:.4f}" in msg and "not a near-tie" in msg


def test_gap_exactly_eps_is_not_a_tie():
    tops = _tops(REF)
    tops[1] = [(0.0, 11, None), (-0.5, 77, None)]
    compare_greedy(REF[:1] + [77], REF, tops, eps=0.6)
    with pytest.raises(GreedyMismatch):
        compare_greedy(REF[:1] + [77], REF, tops, eps=0.5)


def test_token_outside_the_top_two_fails_even_at_a_tie():
    tops = _tops(REF)
    tops[4] = [(-1.0, 14, None), (-1.0 - EPS / 10, 77, None)]
    with pytest.raises(GreedyMismatch, match=r"position 4.*candidate token 5.*not the reference's top two"):
        compare_greedy(REF[:4] + [5], REF, tops)


def test_reference_token_outside_its_own_top_two_fails():
    # a reference whose token is not among its top two at the tie cannot vouch for the pair
    tops = _tops(REF)
    tops[1] = [(-1.0, 40, None), (-1.0 - EPS / 10, 41, None)]
    with pytest.raises(GreedyMismatch, match="not the reference's top two"):
        compare_greedy([10, 41], REF, tops)


@pytest.mark.parametrize("masked", [-math.inf, None, -sys.float_info.max / 10, -3.4028234663852886e38],
                         ids=["-inf", "null (orjson)", "huge negative", "float32 lowest (SGLang's clamp)"])
def test_masked_runner_up_is_no_tie(masked):
    tops = _tops(REF)
    tops[2] = [(0.0, 12, None), (masked, 77, None)]
    with pytest.raises(GreedyMismatch, match="masked out"):
        compare_greedy(REF[:2] + [77], REF, tops)
    assert ranked_top(tops[2])[1] == (77, -math.inf)


def test_candidate_ending_early_fails_at_that_position():
    with pytest.raises(GreedyMismatch, match=r"position 4.*candidate ends there.*token 14"):
        compare_greedy(REF[:4], REF, _tops(REF, gap=0.0))


def test_candidate_running_longer_fails_at_that_position():
    with pytest.raises(GreedyMismatch, match=r"position 6.*reference ends there.*token 7"):
        compare_greedy(REF + [7], REF, _tops(REF, gap=0.0))


def test_missing_top_logprobs_at_the_divergence_fail():
    tops = _tops(REF, gap=0.0)
    tops[3] = None  # SGLang's detokenizer gives None for a position without values
    with pytest.raises(GreedyMismatch, match="no top-2"):
        compare_greedy(REF[:3] + [99], REF, tops)
    with pytest.raises(GreedyMismatch, match="no top-2"):  # a list shorter than the output
        compare_greedy(REF[:3] + [99], REF, tops[:3])
    with pytest.raises(GreedyMismatch, match="no top-2"):  # top_logprobs_num=1
        compare_greedy(REF[:3] + [99], REF, [t[:1] for t in _tops(REF, gap=0.0)])


def test_ranked_top_sorts_by_logprob_and_reads_http_lists():
    assert ranked_top([[-2.0, 5, "a"], [-1.0, 6, "b"], [None, 7, "c"]]) == [(6, -1.0), (5, -2.0), (7, -math.inf)]
    assert ranked_top(None) == [] and ranked_top([]) == []


def test_group_passes_counts_and_lists_ties():
    tops = _tops(REF)
    tied = [list(t) for t in tops]
    tied[5] = [(-1.0, 15, None), (-1.0 - EPS / 2, 77, None)]
    g = compare_group("grp", [REF, REF[:5] + [77]], [REF, REF], [tops, tied], labels=["a", "b"])
    assert (g.compared, g.total) == (12, 12)
    assert len(g.ties) == 1 and g.ties[0][:2] == ("b", 5)


def test_group_reports_every_failing_request():
    tops = _tops(REF)
    with pytest.raises(GreedyMismatch) as exc:
        compare_group("grp", [REF[:1] + [77], REF, REF[:2] + [99]], [REF] * 3, [tops] * 3, labels=["a", "b", "c"])
    msg = str(exc.value)
    assert "grp [a]: first divergence at position 1" in msg and "grp [c]: first divergence at position 2" in msg
    assert "grp [b]" not in msg


def test_group_fails_when_ties_leave_too_little_compared():
    ref = list(range(100, 120))
    tops = _tops(ref, gap=EPS / 4)  # every position a near-tie to token 99
    cands = [[99] + ref[1:]] * 3  # every request diverges at its first token: 1 of 20 compared each
    with pytest.raises(GreedyMismatch, match=r"only 3 of 60 reference tokens compared"):
        compare_group("grp", cands, [ref] * 3, [tops] * 3)
    assert compare_group("grp", cands, [ref] * 3, [tops] * 3, min_fraction=0.05).compared == 3


def test_group_rejects_mismatched_lengths():
    with pytest.raises(GreedyMismatch, match="2 candidates, 1 references"):
        compare_group("grp", [REF, REF], [REF], [_tops(REF)])


def test_eps_is_a_tie_criterion_for_the_random_pair():
    # greedy_compare's reasoning: above the measured bf16 noise (<= 0.008 nats), well below the pair's median top-2
    # gap (0.031 nats); a larger EPS would accept a runner-up nearly anywhere
    assert 0.008 < EPS < 0.031
