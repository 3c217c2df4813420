"""Reasoning then structure with speculative decoding: ``--reasoning-parser deepseek-r1`` and
``require_reasoning``, so each request's grammar starts right after ``</think>``.

The think-follower models write ``I see</think>\\n{"title": ...}``: unconstrained, a newline follows ``</think>``.
A JSON grammar forbids that newline (no leading whitespace), so:

* a grammar started one token early would mask ``</think>`` itself out (it is not JSON);
* a grammar started one token late would let the newline through;
* started exactly after ``</think>``, the output is the thinking text, ``</think>``, then the document.

``</think>`` is output token 2: the middle draft of the first verify window (topk 1: outputs 1-3 are drafts), and the
draft after it (the newline) must be masked by the grammar in that same window. The ``mid_window`` case stops after
that window (4 new tokens) and checks it was one verify step. Every algorithm, plugin on and off, token-identical to
non-speculative greedy decoding (engines shared with ``test_algorithms`` through ``algo_runs``).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sglang_eo_dev.cpu_runtime.models import FOLLOWER_DOCUMENT, FOLLOWER_SCHEMA, THINK_END, build_think_follower_models

from .algo_runs import ALGORITHMS, MID_WINDOW_TOKENS, baseline_config, config, run
from .common import REGEX

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def models():
    return build_think_follower_models()


def _split(text: str):
    assert THINK_END in text, f"no {THINK_END} in {text!r}"
    head, tail = text.split(THINK_END, 1)
    return head, tail


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin-on", "plugin-off"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_grammar_starts_exactly_after_think_end(engine_pool, models, algorithm, plugin):
    base = run(engine_pool, baseline_config(algorithm))
    got = run(engine_pool, config(algorithm, plugin=plugin))
    outs, want = got.outputs["reasoning"], base.outputs["reasoning"]
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.ids == w.ids, f"{algorithm} reasoning[{i}]: {o.text!r} != non-speculative {w.text!r}"
    free_head, free_tail = _split(outs[3].text)
    assert free_tail.startswith("\n"), f"the model itself writes a newline after {THINK_END}: {outs[3].text!r}"
    for o in outs[:2]:
        head, tail = _split(o.text)
        assert head == free_head, "the thinking part is unconstrained"
        assert o.ids.index(models.think_end_id) == models.think_end_index
        doc = json.loads(tail)  # no newline: the grammar covered the very first token after </think>
        jsonschema.validate(doc, FOLLOWER_SCHEMA)
        assert doc == FOLLOWER_DOCUMENT and not tail[0].isspace(), o.text
        assert o.finish_reason["type"] == "stop", o.finish_reason
    head, tail = _split(outs[2].text)
    assert head == free_head and re.fullmatch(REGEX, tail), outs[2].text


@pytest.mark.parametrize("plugin", [True, False], ids=["plugin-on", "plugin-off"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_think_end_accepted_mid_draft_window(engine_pool, models, algorithm, plugin):
    base = run(engine_pool, baseline_config(algorithm))
    got = run(engine_pool, config(algorithm, plugin=plugin))
    (o,), (w,) = got.outputs["mid_window"], base.outputs["mid_window"]
    assert o.ids == w.ids, f"{algorithm}: {o.text!r} != non-speculative {w.text!r}"
    assert len(o.ids) == MID_WINDOW_TOKENS and o.ids[models.think_end_index] == models.think_end_id, o
    _, tail = _split(o.text)
    # The token after </think> is the document's first token, not the newline the draft proposed.
    assert tail and json.dumps(FOLLOWER_DOCUMENT).startswith(tail), o.text
    if algorithm != "NGRAM":  # NGRAM's drafts come from its n-gram trie, not from a model of this chain
        assert o.verify_ct == 1, (
            f"{algorithm}: expected the prefill token + one verify window (</think> accepted mid-window), got "
            f"{o.verify_ct} verify steps for {o.completion_tokens} tokens"
        )
