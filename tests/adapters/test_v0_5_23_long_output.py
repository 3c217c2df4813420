"""A long constrained output through the adapter's mask path: per-step grammar work does not grow with the output.

Simulates SGLang 0.5.23's overlapped EAGLE loop for one request (topk 2, 3 steps, 7 nodes): at step k the verify's
mask step first runs the grammar barrier (which advances step k-1's accepted run through the adapter's
``advance_grammar_fsm``), then builds the tree mask; the result processor of step k-1 then runs (a no-op advance) and
appends the retained tokens to ``output_ids``. Counts, not timings, are checked:

* SGLang's ``XGrammarGrammar.rollback`` (list slicing, O(output) per call, SG#38863) is never called;
* every committed token reaches the matcher exactly once, spread evenly over steps, fed to the bare matcher (the
  grammar object's ``accept_token`` is never called) and recorded on the grammar object as its own ``accept_token``
  would (``accepted_tokens``);
* the ledger holds one request and a bounded history; the mask builder visits at most ``n`` nodes per step.

Upstream's ``generate_token_bitmask`` on the same final state is run once as a control: it does call ``rollback``,
so the counter would catch the O(N) path if the plugin's mask step ever fell back to it.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from tests.adapters.test_v0_5_23_adapter import VOCAB, _batch, _ours_advance
from tests.adapters.v0_5_23_state import active_state, stand_in_req  # noqa: F401 - active_state is a fixture
from sglang_eo_dev.helpers.devices import verify_result
from sglang_eo_dev.helpers.grammars import ensure_sglang_importable

pytestmark = pytest.mark.sglang_0_5_23

SCHEMA = {"type": "array", "items": {"type": "integer"}}
N_ITEMS = 500


def test_per_step_grammar_work_is_flat_over_a_long_output(active_state, monkeypatch):  # noqa: F811
    ensure_sglang_importable()
    import xgrammar as xgr
    from sglang.srt.constrained.xgrammar_backend import MAX_ROLLBACK_TOKENS, XGrammarGrammar
    from sglang.srt.speculative.spec_utils import generate_token_bitmask

    from sglang_eagle_overlap.adapters.v0_5_23.build_grammar_vocab_mask import build_grammar_vocab_mask_around
    from sglang_eagle_overlap.adapters.v0_5_23.band import PluginGrammarTree
    from sglang_eagle_overlap.core.mask import TreeMaskBuilder
    from sglang_eo_dev.helpers.grammars import _compiler
    from sglang_eo_dev.helpers.tokenizers import EOS_ID, encode
    from sglang_eo_dev.helpers.trees import eagle_tree

    ctx = _compiler(VOCAB).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    truth = list(encode("[" + ", ".join(str(i) for i in range(N_ITEMS)) + "]", VOCAB)) + [EOS_ID]
    assert len(truth) > 600
    grammar = XGrammarGrammar(xgr.GrammarMatcher(ctx, max_rollback_tokens=MAX_ROLLBACK_TOKENS), VOCAB, ctx, None)

    calls = {"rollback": 0, "accept": 0}
    orig_rollback, orig_accept = XGrammarGrammar.rollback, XGrammarGrammar.accept_token

    def counting_rollback(self, k):
        calls["rollback"] += 1
        return orig_rollback(self, k)

    def counting_accept(self, t):
        calls["accept"] += 1
        return orig_accept(self, t)

    monkeypatch.setattr(XGrammarGrammar, "rollback", counting_rollback)
    monkeypatch.setattr(XGrammarGrammar, "accept_token", counting_accept)
    valid_nodes = []  # TreeMask.valid_nodes of every mask the adapter builds (finish: a build's last part)
    orig_finish = TreeMaskBuilder.finish

    def recording_finish(self, *args, **kwargs):
        out = orig_finish(self, *args, **kwargs)
        valid_nodes.append(out.valid_nodes)
        return out

    monkeypatch.setattr(TreeMaskBuilder, "finish", recording_finish)

    rng = random.Random(0)
    n = 7
    req = stand_in_req("long", grammar)
    # Prefill: the first token is committed by the extend result.
    from sglang.srt.managers.utils import GenerationBatchResult

    prefill = GenerationBatchResult(next_token_ids=torch.tensor([truth[0]]))
    _ours_advance(prefill, _batch([req], "EXTEND"))
    req.output_ids.append(truth[0])
    pos = 1  # truth[:pos] is in the matcher once the pending result is advanced
    pending = None
    per_step = []  # tokens fed per step
    ledger = active_state.step.ledger
    while not grammar.is_terminated():
        a0 = len(grammar.accepted_tokens)
        drafts = truth[pos:pos + 3]
        tree = eagle_tree(rng, 2, 3, n, drafts, VOCAB)
        nxt = torch.tensor([tree.nxt]); sib = torch.tensor([tree.sib]); tok = torch.tensor([tree.tok])
        barrier = (lambda res=pending: _ours_advance(res, _batch([req]))) if pending is not None else None
        info = SimpleNamespace(vocab_size=VOCAB, grammar_mask=None)
        mask = build_grammar_vocab_mask_around(None, reqs=[req], tree=PluginGrammarTree.from_device(nxt, sib, tok),
                                               sampling_info=info, device=torch.device("cpu"), barrier=barrier)
        if pending is not None:  # result processor of the previous step: no second advance
            _ours_advance(pending, _batch([req]))
            req.output_ids.extend(pending.grammar_retained_tokens[0])
        # The true continuation is allowed along the main path (nodes 1, 2, 3 in DFS order of eagle_tree).
        if mask is not None and drafts:
            row = mask.vocab_mask[0]
            assert (int(row[drafts[0] >> 5]) >> (drafts[0] & 31)) & 1
        if not drafts:
            break
        run = drafts  # every draft accepted (+ the bonus is the next root)
        pos += len(run)
        pending = verify_result([run], n)
        # Advance eagerly if this was the last run (no next verify to host the barrier).
        if pos >= len(truth):
            _ours_advance(pending, _batch([req]))
            req.output_ids.extend(pending.grammar_retained_tokens[0])
        per_step.append(len(grammar.accepted_tokens) - a0)
        assert len(ledger) <= 1
    assert grammar.is_terminated() and req.output_ids == truth
    steps = len(per_step)
    assert steps > 200
    assert calls["rollback"] == 0, "SGLang's O(output) XGrammarGrammar.rollback was used"
    assert grammar.accepted_tokens == truth  # every committed token exactly once (prefill token included)
    assert calls["accept"] == 0  # fed to the bare matcher, not through the wrapper
    assert max(per_step[:-1]) <= 3  # the last step also advances its own run eagerly
    # One tree mask per step, each over at most the tree's n nodes (never the whole output).
    assert len(valid_nodes) == steps and all(1 <= v <= n for v in valid_nodes), valid_nodes
    # Ledger history is bounded: early positions are forgotten, the request's entry is one.
    assert ledger.outcome("long", 1) is None and len(ledger) == 1
    assert ledger.tokens_fed == len(truth)

    # Control: upstream's mask path on the final-ish state does call XGrammarGrammar.rollback.
    fresh = XGrammarGrammar(xgr.GrammarMatcher(ctx, max_rollback_tokens=MAX_ROLLBACK_TOKENS), VOCAB, ctx, None)
    for t in truth[:50]:
        orig_accept(fresh, t)
    tree = eagle_tree(rng, 2, 3, n, truth[50:53], VOCAB)
    before = calls["rollback"]
    generate_token_bitmask([SimpleNamespace(grammar=fresh)], torch.tensor([tree.nxt]), torch.tensor([tree.sib]),
                           torch.tensor([tree.tok]), VOCAB)
    assert calls["rollback"] > before
