"""EBNF, regex, structural-tag (tool call) and JSON-schema requests next to an unconstrained one in one batch, for every
speculative algorithm, plugin on and off: each output conforms to its own grammar and finishes by the
grammar's end (token identity with non-speculative greedy is checked by ``test_algorithms``, on the same runs).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA, build_think_follower_models

from .algo_runs import ALGORITHMS, TOOL_BEGIN, TOOL_END, config, run
from .common import REGEX, ebnf_matches

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin-on", "plugin-off"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_grammar_kind_holds_in_one_batch(engine_pool, algorithm, plugin):
    js, rx, ebnf, tag, free = run(engine_pool, config(algorithm, plugin=plugin)).outputs["mixed_kinds"]
    doc = json.loads(js.text)
    jsonschema.validate(doc, FOLLOWER_SCHEMA)
    assert doc == FOLLOWER_DOCUMENT, js.text
    assert re.fullmatch(REGEX, rx.text), rx.text
    assert ebnf_matches(ebnf.text), ebnf.text
    assert tag.text.startswith(TOOL_BEGIN) and tag.text.endswith(TOOL_END), tag.text
    call = json.loads(tag.text[len(TOOL_BEGIN):-len(TOOL_END)])
    jsonschema.validate(call, FOLLOWER_SCHEMA)
    for o in (js, rx, ebnf, tag):
        assert o.finish_reason["type"] == "stop", (o.text, o.finish_reason)
    # The unconstrained request in the same batch is untouched by its neighbours' grammars: the model's own chain.
    assert free.ids == list(build_think_follower_models().chain), free.text
