"""The native module's Python side, without the C++: what :class:`NativeGrammar` refuses before the call, what it
hands the module, and how it reads the call's values back. A stand-in module records its arguments and returns the
values a test gives it (the header: total, rows reset, errors, run tokens, forced texts)."""

from __future__ import annotations

from typing import Any, List, Sequence

import pytest
import torch
import xgrammar as xgr

from sglang_eagle_overlap.core.native import NativeGrammar


class Module:
    """Records each ``step_batch`` call's arguments; returns ``values`` and the messages / texts it is given."""

    def __init__(self, values: Sequence[int], messages: Sequence[str] = (), texts: Sequence[str] = ()) -> None:
        self.values, self.messages, self.texts = list(values), list(messages), list(texts)
        self.calls: List[Sequence[Any]] = []

    def step_batch(self, *args: Any) -> List[int]:
        self.calls.append(args)
        return self.values

    def step_errors(self) -> List[str]:
        return self.messages

    def step_forced(self) -> List[str]:
        return self.texts


def _native(module: Module) -> NativeGrammar:
    return NativeGrammar(module=module, path="", type_key="", matcher_type=xgr.GrammarMatcher)


def _tree() -> List[torch.Tensor]:
    """nxt, sib, tok, mask of one request with one node."""
    return [torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int32)]


@pytest.mark.parametrize("missing", range(4))
def test_a_walk_without_one_of_its_tensors_is_refused_before_the_call(missing):
    """Each of the tree tensors and the mask is needed by a walk: any one of them missing is a ValueError that says
    so, and the module is never called; without a walk none is needed."""
    module = Module([0, 0, 0, 0, 0])
    nat = _native(module)
    tree: List[Any] = _tree()
    tree[missing] = None
    with pytest.raises(ValueError, match="a walk needs the tree tensors and the mask"):
        nat.step_call((), (), (), ["h"], [0], *tree, 32, None)
    assert module.calls == []
    res = nat.step_batch((), (), (), [], [], *tree, 32, None)  # nothing walked: the missing tensor is not needed
    assert len(module.calls) == 1 and res.total == 0 and list(res.status) == []


def test_a_reset_without_the_buffer_is_refused_before_the_call():
    module = Module([0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="a reset needs the buffer"):
        _native(module).step_call((), (), (), [], [], None, None, None, None, 32, None, reset=[3])
    assert module.calls == []


def test_step_batch_hands_the_forced_flags_and_bonus_keys_to_the_module():
    """``forced_ok`` and ``forced_keys`` reach the native call as its last two arguments (the keys are what the walk
    tries where a node forces nothing itself), and the found texts come back paired with their (row, key)."""
    module = Module([1, 0, 0, 0, 1, 0, 1, 3, 5], texts=['","b":'])  # one walk: status 0, 1 valid; (row 3, key 5)
    res = _native(module).step_batch((), (), (), ["h"], [0], *_tree(), 32, None, forced_ok=[1], forced_keys=[5, 6])
    (args,) = module.calls
    assert list(args[-2]) == [1] and list(args[-1]) == [5, 6]
    assert [(f.row, f.key, f.text) for f in res.forced] == [(3, 5, '","b":')]


def test_errors_are_read_whenever_the_call_reports_some_even_without_run_tokens():
    """A walk that raised in a call that fed nothing (no run tokens): its message is the request's error."""
    module = Module([0, 0, 1, 0, 0, 3, 0], messages=["w0: the matcher raised"])  # one walk: WALK_FAILED, 0 valid
    res = _native(module).step_batch((), (), (), ["h"], [0], *_tree(), 32, None)
    assert res.errors == {("w", 0): "the matcher raised"} and list(res.status) == [3]
