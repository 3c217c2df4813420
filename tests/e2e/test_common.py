"""The engine tests' shared helpers (no engine): identity checks must fail when a field is missing."""

from __future__ import annotations

import pytest

from .common import output_ids


def test_output_ids_from_either_place():
    assert output_ids({"output_ids": [3, 4], "meta_info": {}}) == [3, 4]
    assert output_ids({"text": "a", "meta_info": {"output_ids": (5,)}}) == [5]


@pytest.mark.parametrize("out", [{"text": "a", "meta_info": {"finish_reason": {"type": "stop"}}}, {"text": "a"},
                                 {"output_ids": None, "meta_info": {"output_ids": None}}])
def test_missing_output_ids_fail_loudly(out):
    with pytest.raises(AssertionError, match="no output_ids"):
        output_ids(out)
