""":func:`forcing_is_bounded` reading a grammar's EBNF text: which constructs it models (postfix ``?``, repetition
ranges with their lower bound, lookaheads anywhere in a sequence, rules that name each other) and which texts it
refuses to vouch for (a call, unbalanced brackets, a line that is not a rule). Each case is a grammar small enough to
decide by hand whether every rule matches some finite string."""

from __future__ import annotations

import pytest

from sglang_eagle_overlap.core.forced import forcing_is_bounded


@pytest.mark.parametrize("text, bounded", [
    # a body written without spaces around ``::=`` is read from its first character
    ('root::="a"', True),
    # trailing blanks after a rule body are not a construct
    ('root ::= "a" \t ', True),
    # a literal may hold the rule separator: only the first ``::=`` of a line splits it
    ('root ::= "::=" x\nx ::= "b"', True),
    # a blank line between rules: the rules after it are still read (x needs itself, so the grammar never ends)
    ('root ::= "a"\n\nx ::= "b" x', False),
    ('root ::= x\n\n   \nx ::= "a"', True),
])
def test_rule_lines_are_split_at_their_first_separator_and_blank_lines_skipped(text, bounded):
    assert forcing_is_bounded(text) is bounded


@pytest.mark.parametrize("text, bounded", [
    # ``?`` makes its element optional: root ends without x, and x then ends through root
    ('root ::= "a"? "b"', True),
    ('root ::= x? "b"\nx ::= "a" root', True),
    # a range whose lower bound is 0 is optional, so root ends without x, and x ends through root
    ('root ::= x{0,1} "c"\nx ::= "a" root', True),
    ('root ::= x{0} "c"\nx ::= "a" root', True),
    # a lower bound of 1 or more needs one x, which needs a root: neither ever ends
    ('root ::= x{1,2} "c"\nx ::= "a" root', False),
    ('root ::= x{2} "c"\nx ::= "a" root', False),
    ('root ::= x{1,} "c"\nx ::= "a" root', False),
    ('root ::= x+ "c"\nx ::= "a" root', False),
    ('root ::= x* "c"\nx ::= "a" root', True),
])
def test_postfix_operators_and_repetition_ranges_count_their_lower_bound(text, bounded):
    assert forcing_is_bounded(text) is bounded


@pytest.mark.parametrize("text, bounded", [
    # a lookahead only narrows what follows it: the sequence goes on after it
    ('root ::= "a" (=("b")) "b"', True),
    ('root ::= (=("a")) x\nx ::= "a" x', False),
    ('root ::= (=("a")) x\nx ::= "a"', True),
])
def test_a_lookahead_in_the_middle_of_a_sequence_is_dropped_and_the_rest_read(text, bounded):
    assert forcing_is_bounded(text) is bounded


@pytest.mark.parametrize("text", [
    'root ::= x("a")\nx ::= "b"',  # a call of a name that is also a rule: still a call, not modelled
    'root ::= ("a"',  # a bracket never closed
    'root ::= ("a" | ("b")',
    'root ::= "a")',  # a bracket never opened
    'root ::= "a"\nthis line is no rule',
    'root ::= "a"\n ::= "b"',  # a rule without a name
    'root ::= "a" ; "b"',  # a character no construct starts with
])
def test_texts_with_constructs_not_modelled_are_not_vouched_for(text):
    """The reader answers False (no forced text asked for) instead of guessing, and never raises."""
    assert forcing_is_bounded(text) is False


def test_a_rule_is_productive_only_once_every_part_of_one_alternative_is():
    """x names root, which ends: x is re-checked when root is found productive, but x also needs y, which needs
    itself, so x never ends (nor does the grammar); with y ending, all three do."""
    assert forcing_is_bounded('root ::= "a"\nx ::= root y\ny ::= "b" y') is False
    assert forcing_is_bounded('root ::= "a"\nx ::= root y\ny ::= "b" y | "c"') is True
    # x names root, but naming a productive rule is not enough: x also needs itself
    assert forcing_is_bounded('root ::= "a"\nx ::= root x') is False
    # a chain where each rule ends only through the one before it, listed in the order that needs re-checks
    assert forcing_is_bounded('a ::= b "x"\nb ::= c "y"\nc ::= d "z"\nd ::= "w"') is True
    assert forcing_is_bounded('a ::= b "x"\nb ::= c "y"\nc ::= d "z"\nd ::= a') is False
