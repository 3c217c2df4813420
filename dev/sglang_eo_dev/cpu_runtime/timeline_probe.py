"""Overlap-timeline stamps from the running engine (TEST / BENCHMARK ONLY).

Active only when ``SGLANG_EAGLE_OVERLAP_TIMELINE_FILE`` names a file; :func:`install` (called by the CPU-runtime
plugin right after ``Scheduler.__init__``, when every plugin's class-level hooks are in place) wraps SGLang functions
so their time lands in the product's recorder (:mod:`sglang_eagle_overlap.core.timeline`, one recorder per process).

Always (every path): ``TpModelWorker.forward_batch_generation`` for target-verify forwards -> ``forward`` span (its
start is the *verify launch*; on CPU the forward runs synchronously inside this call), with the batch size and
whether the batch has a grammar; ``XGrammarGrammar.apply_vocab_mask`` -> ``mask_apply`` (the sampler applying the
mask; neither plugin changes it); the scheduler instance's ``run_batch`` / ``process_batch_result`` for decode
batches -> ``run_batch`` / ``postprocess`` spans (where a constrained loop iteration spends its time).

Only when the product plugin is off (stock SGLang; with the plugin on, its own hooks stamp the grammar phases):

* 0.5.16 (forced sync): ``SchedulerBatchResultProcessor._accept_grammar_tokens`` -> ``advance`` (post-processing,
  before the next launch); ``eagle_prepare_for_verify`` end to the forward start -> ``tree_wait`` (the inline
  blocking ``.cpu()`` of the verify tree is in that interval; on CPU it returns the tensor itself);
  ``generate_token_bitmask`` -> ``mask_build``; its end to ``eagle_sample`` -> ``mask_upload`` (``.to(device)``);
  ``eagle_sample`` entry -> ``sample``.
* 0.5.23 (upstream overlap): inside ``build_grammar_vocab_mask``: the ``barrier`` -> ``advance``, ``tree.resolve()``
  -> ``tree_wait``, ``spec_utils.generate_token_bitmask`` -> ``mask_build``, the rest up to its return ->
  ``mask_upload``; post-processing ``advance_grammar_fsm`` outside the barrier -> ``advance``; ``GrammarTree
  .from_device`` -> ``tree_copy`` point; ``eagle_sample`` entry -> ``sample``.

Module globals are rebound in the module whose function calls them (``eagle_worker_common`` calls its own globals).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

__all__ = ["install"]

_installed = [False]


def _product_active() -> bool:
    try:
        from sglang_eagle_overlap.integration import runtime
    except ImportError:
        return False
    return runtime.active() is not None


def _batch_has_grammar(forward_batch: Any) -> bool:
    info = getattr(forward_batch, "sampling_info", None)
    grammars = getattr(info, "grammars", None) if info is not None else None
    return bool(grammars) and any(g is not None for g in grammars)


def install(scheduler: Any, version: tuple) -> None:
    from sglang_eagle_overlap.core.timeline import TIMELINE_ENV

    if not os.environ.get(TIMELINE_ENV) or _installed[0]:
        return
    # imported only when a timeline is asked for: an engine of an older plugin revision (bench_scheduler_budget's
    # ``--before``) runs this probe too, without a timeline
    from sglang_eagle_overlap.core import process_timeline

    _installed[0] = True
    tl = process_timeline(os.environ[TIMELINE_ENV])
    tl.meta.update({"sglang": ".".join(map(str, version)), "product_plugin": _product_active()})
    stock = not _product_active()
    clock = time.perf_counter
    state = {"prep_end": None, "mask_end": None, "in_barrier": 0}

    from sglang.srt.managers import tp_worker
    from sglang.srt.speculative import eagle_worker_common as ewc

    fbg = tp_worker.TpModelWorker.forward_batch_generation

    @functools.wraps(fbg)
    def forward_batch_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_verify"):
            return fbg(self, *args, **kwargs)
        fb = kwargs.get("forward_batch")
        grammar = _batch_has_grammar(fb)
        bs = int(getattr(fb, "batch_size", 0) or 0)
        t0 = clock()
        try:
            return fbg(self, *args, **kwargs)
        finally:
            t1 = clock()
            if stock and grammar and state["prep_end"] is not None and version < (0, 5, 17):
                tl.span("tree_wait", state["prep_end"], t0, bs)
            state["prep_end"] = None
            tl.span("forward", t0, t1, bs, grammar)

    tp_worker.TpModelWorker.forward_batch_generation = forward_batch_generation

    def decode_flags(batch: Any) -> Any:
        try:
            if batch is None or not batch.forward_mode.is_decode():
                return None
            return len(batch.reqs), bool(batch.has_grammar)
        except AttributeError:
            return None

    def loop_part(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(batch: Any, *args: Any, **kwargs: Any) -> Any:
            flags = decode_flags(batch)
            t0 = clock()
            try:
                return fn(batch, *args, **kwargs)
            finally:
                if flags is not None:
                    tl.span(name, t0, clock(), flags[0], flags[1])

        return wrapper

    if scheduler is not None:
        scheduler.run_batch = loop_part("run_batch", scheduler.run_batch)
        scheduler.process_batch_result = loop_part("postprocess", scheduler.process_batch_result)

    from sglang.srt.constrained import xgrammar_backend

    apply = xgrammar_backend.XGrammarGrammar.apply_vocab_mask  # an instance method (already CPU-hooked)

    @functools.wraps(apply)
    def apply_vocab_mask(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return apply(*args, **kwargs)
        finally:
            tl.span("mask_apply", t0, clock())

    xgrammar_backend.XGrammarGrammar.apply_vocab_mask = apply_vocab_mask
    if not stock:
        return

    sample = ewc.eagle_sample

    @functools.wraps(sample)
    def eagle_sample(verify_input: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(batch, "has_grammar", False):
            t = clock()
            if state["mask_end"] is not None and version < (0, 5, 17):
                tl.span("mask_upload", state["mask_end"], t, len(batch.reqs))
            tl.point("sample", t, len(batch.reqs))
        state["mask_end"] = None
        return sample(verify_input, batch, *args, **kwargs)

    ewc.eagle_sample = eagle_sample

    from sglang.srt.managers.scheduler_components import batch_result_processor as brp

    proc_cls = brp.SchedulerBatchResultProcessor

    def timed(name: str, fn: Callable[..., Any], skip_in_barrier: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if skip_in_barrier and state["in_barrier"]:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                tl.span(name, t0, clock())

        return wrapper

    def timed_mask_build(gen: Callable[..., Any]) -> Callable[..., Any]:
        """Upstream's per-node Python mask walk, stamped as ``mask_build``; its end is remembered for the sampler."""

        @functools.wraps(gen)
        def generate_token_bitmask(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return gen(*args, **kwargs)
            finally:
                state["mask_end"] = clock()
                tl.span("mask_build", t0, state["mask_end"])

        return generate_token_bitmask

    if version < (0, 5, 17):
        prep = ewc.eagle_prepare_for_verify

        @functools.wraps(prep)
        def eagle_prepare_for_verify(*args: Any, **kwargs: Any) -> Any:
            out = prep(*args, **kwargs)
            state["prep_end"] = clock()
            return out

        ewc.eagle_prepare_for_verify = eagle_prepare_for_verify
        ewc.generate_token_bitmask = timed_mask_build(ewc.generate_token_bitmask)
        proc_cls._accept_grammar_tokens = timed("advance", proc_cls._accept_grammar_tokens)
        return

    from sglang.srt.speculative import spec_utils

    proc_cls.advance_grammar_fsm = timed("advance", proc_cls.advance_grammar_fsm, skip_in_barrier=True)
    spec_utils.generate_token_bitmask = timed_mask_build(spec_utils.generate_token_bitmask)
    build = ewc.build_grammar_vocab_mask

    class _TimedTree:
        __slots__ = ("tree",)

        def __init__(self, tree: Any) -> None:
            self.tree = tree

        def resolve(self) -> Any:
            t0 = clock()
            try:
                return self.tree.resolve()
            finally:
                tl.span("tree_wait", t0, clock())

    @functools.wraps(build)
    def build_grammar_vocab_mask(*args: Any, **kwargs: Any) -> Any:
        barrier = kwargs.get("barrier")
        if barrier is not None:
            def timed_barrier() -> Any:
                state["in_barrier"] += 1
                t0 = clock()
                try:
                    return barrier()
                finally:
                    state["in_barrier"] -= 1
                    tl.span("advance", t0, clock())

            kwargs["barrier"] = timed_barrier
        if kwargs.get("tree") is not None:
            kwargs["tree"] = _TimedTree(kwargs["tree"])
        state["mask_end"] = None
        out = build(*args, **kwargs)
        if state["mask_end"] is not None:  # the mask build ran: the rest up to here is the upload
            tl.span("mask_upload", state["mask_end"], clock())
            state["mask_end"] = None
        return out

    ewc.build_grammar_vocab_mask = build_grammar_vocab_mask

    grammar_tree = ewc.GrammarTree
    from_device = grammar_tree.from_device

    def stamped_from_device(*args: Any, **kwargs: Any) -> Any:
        tl.point("tree_copy")
        return from_device(*args, **kwargs)

    class _StampedGrammarTree:
        """Stand-in for the module global ``GrammarTree``: ``from_device`` stamps, everything else is SGLang's."""

        from_device = staticmethod(stamped_from_device)

        def __getattr__(self, name: str) -> Any:
            return getattr(grammar_tree, name)

    ewc.GrammarTree = _StampedGrammarTree()
