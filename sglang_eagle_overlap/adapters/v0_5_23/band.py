"""SGLang 0.5.23: the grammar-overlap integration itself. The hook modules next to this one and the vendored patch
(``patches/sglang-0.5.23``) both call these, so one code path serves plugin and patch users.

SGLang 0.5.23 already keeps EAGLE grammar decode batches overlapped and calls a barrier inside verify; this band
replaces the three pieces that are slow or not exactly-once there:

1. ``spec_utils.GrammarTree`` -> :class:`PluginGrammarTree`: ``from_device`` (before the target-verify launch) copies
   through the runtime's reusable pinned buffers (``GrammarStep.copy_tree``; SGLang allocates pinned memory every
   step) and remembers the device draft tensor, so unmasked drafts can be neutralised.
2. ``spec_utils.build_grammar_vocab_mask`` -> :func:`build_grammar_vocab_mask` (after the launch, before sampling):
   ``GrammarStep.build_mask`` with SGLang's barrier (``Scheduler._advance_pending_grammar``, which lands in 3),
   native xgrammar tree mask instead of the per-node Python DFS, failed requests aborted alone.
3. ``SchedulerBatchResultProcessor.advance_grammar_fsm`` -> :func:`advance_grammar_fsm`: every run through the ledger
   (exactly once per request id and output position, whichever caller comes first), SGLang's gating, retained runs
   and aborts (``Band.feed_results`` with :class:`Band023`'s hooks).

Besides the verify step, one compile-time piece (hook only; the vendored patch has no call site for it):

4. ``XGrammarGrammarBackend.dispatch_json`` -> :func:`dispatch_json`: a JSON schema's bounded ``maxLength`` strings
   compiled as control-character-free patterns (``integration.schemas``), below SGLang's grammar cache.

The shared flow (in-flight step, mask build, barrier loop) is :class:`~sglang_eagle_overlap.integration.band.Band`;
:class:`Band023` keeps what differs here. The walk (docs/architecture.md) from SGLang's call to the core, for the
barrier (``Scheduler._advance_pending_grammar``) and post-processing alike: ``advance_grammar_fsm`` hook ->
:func:`advance_grammar_fsm` -> ``Band.feed_results`` -> ``GrammarStep.feed_later`` (inside a build's barrier the
runs are checked at once and queued by row for the build's one native call; anywhere else fed at once).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Set, Tuple

import torch
from torch.types import Device

from sglang_eagle_overlap.core import FeedOutcome, MaskJob, PendingTree, ResultRuns, RowRun, StepMask
from sglang_eagle_overlap.integration import drafts, runtime, schemas
from sglang_eagle_overlap.integration.band import Band, InFlight, OnDone
from sglang_eagle_overlap.integration.requests import kept_tokens, mask_requests, result_rows
from sglang_eagle_overlap.integration.runtime import Runtime

__all__ = ["Band023", "PluginGrammarTree", "advance_grammar_fsm", "after_sample", "band_of", "before_verify",
           "build_grammar_vocab_mask", "dispatch_json", "hand_over_verify", "patched_grammar_tree",
           "start_grammar_job"]

logger = logging.getLogger("sglang_eagle_overlap")

# Every ``Any`` below is one of SGLang's objects (its GrammarTree class, Req, SamplingBatchInfo, GrammarMask, batches
# and results): SGLang ships no types.
_sglang_tree: List[Any] = [None]  # SGLang's own GrammarTree, used while the runtime is off


class PluginGrammarTree:
    """The verify tree on the host, copied through the runtime's reusable pinned buffers (duck-compatible with
    SGLang's ``GrammarTree``: ``from_device`` / ``from_host`` / ``from_linear_chain`` / ``resolve``).

    While no runtime is active every constructor delegates to SGLang's own class, so objects and behaviour are
    SGLang's. ``draft_device`` is the caller's draft-token tensor (EAGLE trees), which the mask step may overwrite
    to neutralise unmasked drafts; None for trees whose candidates the caller owns (``from_host``, chains)."""

    __slots__ = ("pending", "draft_device", "job")

    def __init__(self, pending: PendingTree, draft_device: Optional[torch.Tensor] = None,
                 job: Optional[MaskJob] = None) -> None:
        self.pending = pending
        self.draft_device = draft_device
        self.job = job  # the grammar thread's job for this tree, started before the verify launch

    @staticmethod
    def sglang_class() -> Any:
        if _sglang_tree[0] is None:
            from sglang.srt.speculative import spec_utils

            if spec_utils.GrammarTree is PluginGrammarTree:
                raise RuntimeError("sglang-eagle-overlap: SGLang's own GrammarTree was not captured before REPLACE")
            _sglang_tree[0] = spec_utils.GrammarTree
        return _sglang_tree[0]

    @classmethod
    def from_device(cls, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                    draft_token: torch.Tensor) -> Any:
        rt = runtime.active()
        if rt is None:
            return cls.sglang_class().from_device(retrieve_next_token, retrieve_next_sibling, draft_token)
        tree = cls(rt.step.copy_tree(retrieve_next_token, retrieve_next_sibling, draft_token), draft_token)
        tree.job = start_grammar_job(rt, tree)
        return tree

    @classmethod
    def from_host(cls, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                  draft_token: torch.Tensor) -> Any:
        rt = runtime.active()
        if rt is None:
            return cls.sglang_class().from_host(retrieve_next_token, retrieve_next_sibling, draft_token)
        return cls(rt.step.copy_host_tree(retrieve_next_token, retrieve_next_sibling, draft_token))

    @classmethod
    def from_linear_chain(cls, verify_ids_2d: torch.Tensor) -> Any:
        rt = runtime.active()
        if rt is None:
            return cls.sglang_class().from_linear_chain(verify_ids_2d)
        bs, chain_len = verify_ids_2d.shape
        nxt = torch.full((bs, chain_len), -1, dtype=torch.int64)
        nxt[:, :-1] = torch.arange(1, chain_len, dtype=torch.int64)
        sib = torch.full((bs, chain_len), -1, dtype=torch.int64)
        return cls(rt.step.copy_host_tree(nxt, sib, verify_ids_2d))  # chain algorithms own their candidates

    def resolve(self) -> Tuple[torch.Tensor, ...]:
        """Wait for the host copy (one event) and return ``(next_token, next_sibling, draft_tokens)``."""
        return self.pending.resolve()


def hand_over_verify(rt: Runtime, batch: Any, barrier: Any) -> Optional[InFlight]:
    """Just before ``GrammarTree.from_device`` (patched SGLang; the hook hands it over through ``Band.run_verify``):
    give the tree constructor this batch and SGLang's barrier. Returns the step put in flight (None: no grammar)."""
    b = band_of(rt)
    cur = b.verify_step(batch, barrier)
    if cur is not None:
        b.in_flight = cur
    return cur


def before_verify(rt: Runtime, batch: Any, verify_input: Any) -> None:
    """``run_eagle_verify`` entry, before ``eagle_prepare_for_verify`` builds the target's input from the draft tokens:
    grammar-forced drafts replace the top-path drafts of a grammar step (every grammar verify is the plugin's on this
    band); a verify without a grammar drops the previous picks
    (:func:`~sglang_eagle_overlap.integration.drafts.before_verify`)."""
    owned = bool(getattr(batch, "has_grammar", False)) and not batch.forward_mode.is_idle()
    drafts.before_verify(rt, batch, verify_input, owned=owned)


def after_sample(rt: Runtime, batch: Any, sample_result: Any) -> None:
    """Right after ``eagle_sample`` of a grammar step: the accepted node's forced tokens, picked on the device."""
    if getattr(batch, "has_grammar", False):
        drafts.after_sample(rt, batch, sample_result)


def start_grammar_job(rt: Runtime, tree: PluginGrammarTree) -> Optional[MaskJob]:
    """Inside a ``run_eagle_verify`` whose step is in flight: start its job now, before the verify launch
    (``Band.start``: on the grammar thread, or recorded to run inline in ``build_grammar_vocab_mask``). None outside
    one (trees built elsewhere): the mask is built from ``build_grammar_vocab_mask``'s arguments."""
    b = band_of(rt)
    cur = b.start(b.take_verify(tree))
    return None if cur is None else cur.job


def capture_sglang_tree(cls: Any) -> None:
    """Remember SGLang's own ``GrammarTree`` before it is replaced (hook: at register; patch: at import)."""
    if cls is not PluginGrammarTree and _sglang_tree[0] is None:
        _sglang_tree[0] = cls


def build_grammar_vocab_mask(rt: Runtime, *, reqs: Any, tree: PluginGrammarTree, sampling_info: Any,
                             device: Device, barrier: Optional[Callable[[], object]]) -> Any:
    """After the target-verify launch, before sampling: barrier -> tree wait -> native mask -> non-blocking upload.
    Returns SGLang's ``GrammarMask`` (None: no request constrained). Chain trees without a neutralisable draft tensor
    are built without a time limit (exact, never neutralised)."""
    b = band_of(rt)
    if tree.job is not None:  # started before the launch with the same batch and barrier
        job, tree.job = tree.job, None
        return b.finish(job, reqs, sampling_info, device=device, draft_device=tree.draft_device)
    step_mask = rt.step.build_mask(mask_requests(reqs), tree.pending, vocab_size=sampling_info.vocab_size,
                                   device=device, barrier=barrier, draft_device=tree.draft_device)
    return b.settled(step_mask, reqs, sampling_info)


def advance_grammar_fsm(rt: Runtime, result: Any, batch: Any) -> None:
    """SGLang's ``advance_grammar_fsm`` contract, through the ledger (``Band.feed_results`` of this one result, with
    :class:`Band023`'s gating, retained runs and prune rule)."""
    band_of(rt).feed_results(((batch, result),))


def dispatch_json(rt: Runtime, original: Callable[..., Any], backend: Any, key_string: str) -> Any:
    """SGLang's ``XGrammarGrammarBackend.dispatch_json(backend, key_string)`` on the schema text
    ``schemas.schema_to_compile`` gives (the text as sent, unless bounded ``maxLength`` strings became patterns).

    SGLang's cache above this call keys by ``key_string``; the grammar's own ``key_string`` (SGLang's logs and
    copies) is set back to it. A rewritten schema that SGLang's path does not compile (it raises, or returns an
    ``InvalidGrammarObject``) is compiled again as sent, so the request gets SGLang's own grammar or error for its
    schema; a WARNING says so if the schema as sent then compiles."""
    compiled = schemas.schema_to_compile(rt, key_string)
    if not compiled.changed:
        return original(backend, key_string)
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    try:
        grammar = original(backend, compiled.text)
        failure = repr(grammar) if isinstance(grammar, InvalidGrammarObject) else ""
    except Exception as exc:  # anything: SGLang's path on the schema as sent decides what the request gets
        failure = f"{type(exc).__name__}: {exc}"
    if failure:
        as_sent = original(backend, key_string)
        if not isinstance(as_sent, InvalidGrammarObject):
            logger.warning("sglang-eagle-overlap: a JSON schema compiled as sent after its maxLength-pattern rewrite "
                           "failed (%s); please report it with the schema", failure)
        return as_sent
    if getattr(grammar, "key_string", None) == compiled.text:
        grammar.key_string = key_string
    return grammar


class Band023(Band):
    """The 0.5.23 band: SGLang's own barrier and result processors call ``advance_grammar_fsm`` with one result each;
    the runs it answers count as ``replays``."""

    counts_replays = True

    def verify_step(self, batch: Any, barrier: Any) -> Optional[InFlight]:
        """The step a ``run_eagle_verify`` call hands to its tree constructor: its batch and SGLang's barrier (the
        ``grammar_barrier`` argument). None for a batch without a grammar."""
        if not getattr(batch, "has_grammar", False):
            return None
        return InFlight(batch, barrier=barrier)

    def take_verify(self, tree: PluginGrammarTree) -> Optional[InFlight]:
        """The step in flight, taken by its tree constructor (one tree per verify call) with that tree."""
        cur = self.in_flight
        if cur is None:
            return None
        self.in_flight = None
        cur.tree, cur.allow_timeout = tree.pending, tree.draft_device is not None
        return cur

    def leftover(self, grammar: Any, step_mask: StepMask, sampling: Any, verify_input: Any) -> Any:
        """As SGLang: otherwise the extend stage's leftover mask is applied to the verify logits. Returns SGLang's
        ``GrammarMask`` (None: no request constrained)."""
        if grammar is None:
            return None
        sampling.grammar_mask = None
        if step_mask.device_mask is None:
            return None
        from sglang.srt.constrained.base_grammar_backend import GrammarMask

        return GrammarMask(grammar, step_mask.device_mask)

    def rows_to_feed(self, batch: Any, result: Any, finished: List[str]
                     ) -> Optional[Tuple[List[RowRun], ResultRuns]]:
        """SGLang's gating: skip when ``result.grammar_advanced`` or no grammar or neither decode nor extend; extend
        feeds the single prefill token (in-flight chunked prefill skipped); decode ``next_token_ids[i*stride :
        i*stride + accept_lens[i]]``; retracted / finished requests are skipped (SG#28986). The output position is
        ``len(req.output_ids)``: the result is not yet appended. Marks the result advanced (SGLang's barrier asks once
        per result; its runs are fed exactly once)."""
        if result.grammar_advanced or not batch.has_grammar:
            return None
        got = result_rows(batch, result, finished)
        if got is not None:
            result.grammar_advanced = True
        return got

    def when_fed(self, batch: Any, result: Any, rows: List[RowRun], finished: List[str]) -> Optional[OnDone]:
        """The retained runs into ``result.grammar_retained_tokens`` (decode), rejections aborted alone, and the
        ledger pruned. Inside the verify's barrier the runs are fed by the mask build, so this runs when the build is
        joined; SGLang reads ``grammar_retained_tokens`` only after sampling."""
        is_decode = batch.forward_mode.is_decode()
        step = self.step
        reqs = batch.reqs

        def done(outcomes: List[FeedOutcome]) -> None:
            # the run each request keeps, by batch row, in one pass (a rejection aborts its request alone)
            retained: List[Optional[List[int]]] = [None] * len(reqs)
            for row, o in zip(rows, outcomes):
                retained[row.row] = kept_tokens(step, reqs[row.row], o)
            if is_decode:
                result.grammar_retained_tokens = retained
            # Only a decode result says which requests are live: its batch is SGLang's running batch. A prefill batch
            # holds only the new requests, so after one only the finished are forgotten (pruning to it would drop
            # every decoding request's entry, and with it their gap and conflict checks).
            if is_decode and step.ledger_outgrows(len(rows)):  # else no live-key set is made
                step.prune(live_keys(batch, rows), finished)
            elif finished:
                step.prune(None, finished)

        return done


def band_of(rt: Runtime) -> Band023:
    """``rt``'s band, made at the first call in this process (plugin and patched SGLang alike)."""
    b = rt.band
    if not isinstance(b, Band023):
        b = rt.band = Band023(rt.step)
    return b


def live_keys(batch: Any, rows: List[Any]) -> Set[str]:
    """The ledger keys a decode result keeps: its rows' and every constrained request of its batch (also those whose
    run the result does not commit, e.g. a retracted one). Finished requests are forgotten by the prune itself."""
    live = {str(row.key) for row in rows}
    live.update(str(req.rid) for req in batch.reqs if getattr(req, "grammar", None) is not None)
    return live


# -- the vendored patch's entry points --------------------------------------------------------------------------------
def patched_grammar_tree(sglang_cls: Any) -> Any:
    """Called by the patched ``spec_utils`` right after its own ``GrammarTree`` (only when the patched SGLang's
    runtime is on): returns the class to use instead; SGLang's own stays the fallback while no runtime is active."""
    capture_sglang_tree(sglang_cls)
    return PluginGrammarTree
