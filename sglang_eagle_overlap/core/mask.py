"""Draft-tree vocabulary mask, built natively with xgrammar.

One bitmask row per draft node, for every request in the batch (``rows = batch_size * num_draft_tokens``; request
``i`` owns rows ``[i * n, (i + 1) * n)``). Semantics are SGLang's ``traverse_tree`` exactly:

* node 0 (the token the target already committed) is always valid;
* a node is valid iff its parent is valid, its parent did not terminate the grammar, and the parent's row allows its
  token (tokens ``< 0`` or ``>= vocab_size`` are invalid);
* the row of a valid node whose grammar is not terminated after accepting it is the matcher's next-token bitmask;
* every other row (invalid nodes, nodes that terminate the grammar, padding, requests without a grammar) stays
  all-allowed (-1). xgrammar's own ``traverse_draft_tree`` zeroes rejected rows; we restore them, because a fully
  zero row turns a row of logits into all -inf, a NaN hazard under sampling verification.

Every matcher is returned to the state it had on entry.

Strategies (``MaskStrategy``):

* ``"lockstep"`` -- each request walks its tree in DFS order in Python (accept / rollback only, cheap), and every
  round the pending fills of *all* requests go to one ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` call,
  which runs them on C++ threads. xgrammar's per-request ``traverse_draft_tree`` holds the GIL, so Python threads
  cannot parallelise it; this can.
* ``"auto"`` -- ``lockstep`` (measured fastest or on par at every shape of ``benchmarks/bench_grammar_step.py``,
  with one or more threads).

llguidance grammars (a row with ``MaskRequest.guidance``, the bare ``llguidance.LLMatcher`` inside the host grammar)
take the same lockstep rounds: the host grammar object accepts and rolls back (its own termination rule, exactly as
the host's walk would), and every round's fills go to llguidance in one batched call (``LLExecutor``: its threads,
the GIL released), written straight into the mask rows. Other grammars (outlines, a reasoning wrapper) take the
generic walk through the host's grammar object API, request by request, whatever the strategy. The strategies the
product never chooses (xgrammar's per-request ``traverse_draft_tree``, and the generic walk for every request) live
with the dev tools that compare them (``sglang_eo_dev.helpers.strategies``), as a subclass overriding
:meth:`TreeMaskBuilder._walk_xgrammar`.

With the plugin's native module (``TreeMaskBuilder(native=...)``, :mod:`sglang_eagle_overlap.core.native`), the
lockstep walk runs as one C++ call per build, with the previous batch's waiting runs (``feeds``, a ledger plan) fed in
the same call: the same rows, the same matcher states after it, the same time-limit contract, without a Python frame
or a GIL round trip per node. It applies to batches of plain ``xgrammar.GrammarMatcher`` rows on a host mask, on the
real clock and without forced-draft recording; anything else takes the Python walk below. A build is three parts
(:meth:`TreeMaskBuilder.prepare` and :meth:`TreeMaskBuilder.finish` on the thread that owns the requests,
:meth:`TreeMaskBuilder.native_call` made on any thread in between), so that ``GrammarStep`` can make the native call
on its grammar thread; :meth:`TreeMaskBuilder.build` is the three on one thread.

Failures: a grammar that raises during the build (a host grammar object's method, or xgrammar inside the batched
native walk, which is then redone request by request through the exact walk to find the culprit) fails that request
alone: it is reported in ``TreeMask.failed`` with the error, its rows are left all-allowed and its matcher is rolled
back; the caller MUST abort it (and neutralise its drafts). The other requests' rows are exact.

Time limit: if the build for a request exceeds ``time_limit_s`` the request is reported in
``TreeMask.timed_out``. Its root row is always exact (roots are filled first); its other rows are left all-allowed,
and the caller MUST then neutralise that request's draft candidates (see :func:`neutralize_timed_out_drafts`) so
the step accepts only the root-masked bonus token: never a wrong token, only a slower step.

This module imports torch, xgrammar and, for llguidance rows only, llguidance.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Generic, Iterable, List, Literal, Optional, Protocol, Sequence,
                    Tuple, TypeVar)

import torch

from sglang_eagle_overlap.core import tree_copy
from sglang_eagle_overlap.core.forced import ForcedDrafts
from sglang_eagle_overlap.core.ledger import LedgerPlan
from sglang_eagle_overlap.core.native import WALK_FAILED, WALK_TIMED_OUT, NativeGrammar, StepResult
from sglang_eagle_overlap.core.protocols import GuidanceMatcher, WalkMatcher

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import xgrammar as xgr

__all__ = [
    "BuildPlan",
    "MaskBatch",
    "MaskRequest",
    "MaskStrategy",
    "TreeMask",
    "TreeMaskBuilder",
    "HostGrammar",
    "bitmask_width",
    "neutralize_timed_out_drafts",
]

logger = logging.getLogger(__name__)

MaskStrategy = Literal["auto", "lockstep"]


class HostGrammar(Protocol):
    """The host's grammar object API (SGLang's ``BaseGrammarObject``) used by the generic walk."""

    def accept_token(self, token: int) -> object: ...

    def rollback(self, k: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None: ...


@dataclass(slots=True, frozen=True)
class MaskRequest:
    """One batch row. ``matcher`` (an ``xgrammar.GrammarMatcher``) selects the native paths; else ``grammar`` is
    walked through its object API, its fills batched with the other llguidance rows' when ``guidance`` (the
    ``llguidance.LLMatcher`` that ``grammar`` advances) is given, one by one otherwise; ``matcher`` and ``grammar``
    both None means unconstrained (rows stay all-allowed, zero cost). Immutable: an integration hands the same row to
    every step of a request (``integration.requests.RequestView``)."""

    matcher: Optional[xgr.GrammarMatcher] = None
    grammar: Optional[HostGrammar] = None
    request_id: str = ""
    guidance: Optional[GuidanceMatcher] = None


class MaskBatch(List[MaskRequest]):
    """A batch's rows, built with :meth:`of`, which also keeps the index lists :meth:`TreeMaskBuilder.prepare` needs
    (rows of xgrammar matchers, their matchers, rows of host grammars): a build then reads them instead of looping over
    the rows again. Any ``Sequence[MaskRequest]`` builds the same mask."""

    __slots__ = ("native", "generic", "matchers")

    def __init__(self) -> None:
        super().__init__()
        self.native: List[int] = []
        self.generic: List[int] = []
        self.matchers: List[Any] = []

    @classmethod
    def of(cls, requests: Iterable[MaskRequest]) -> MaskBatch:
        """The batch of ``requests``, in order."""
        out = cls()
        native, generic, matchers, append = out.native, out.generic, out.matchers, out.append
        for i, r in enumerate(requests):
            if r.matcher is not None:
                native.append(i)
                matchers.append(r.matcher)
            elif r.grammar is not None:
                generic.append(i)
            append(r)
        return out


@dataclass(slots=True)
class TreeMask:
    """One build's result. ``bitmask`` (unless the caller passed ``out``) is a view of the builder's reused buffer:
    read it (upload, sample) before the next build, and never write into it -- the next build resets only the rows
    this one wrote."""

    bitmask: Optional[torch.Tensor]  # int32 [rows, ceil(vocab/32)] on the CPU, or None if no row is constrained
    timed_out: List[int] = field(default_factory=list)  # batch indices whose non-root rows were not built
    failed: List[Tuple[int, str]] = field(default_factory=list)  # (batch index, error) whose grammar raised
    build_s: float = 0.0
    valid_nodes: int = 0
    guidance_walked: bool = False  # llguidance rows took the batched walk


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class BuildPlan:
    """One build between :meth:`TreeMaskBuilder.prepare` and :meth:`TreeMaskBuilder.finish` (the native walk may run
    on another thread in between: it reads only this). ``mask`` None: no row is constrained. ``native`` / ``generic``:
    batch rows of plain xgrammar matchers / of host grammars; ``handles`` (the native rows' matchers) is set when the
    native walk applies; ``feed_input`` holds a ledger plan's waiting runs packed for the same native call;
    ``forced_ok`` (with ``forced`` and the native walk): per native row, whether its matcher may be asked for its
    forced text (the call then records it, and ``forced`` was begun in the preparation)."""

    requests: Sequence[MaskRequest]
    n: int
    vocab_size: int
    t0: float
    limit: Optional[float] = None
    forced: Optional[ForcedDrafts] = None
    feeds: Optional[LedgerPlan] = None
    mask: Optional[torch.Tensor] = None
    stale: List[int] = field(default_factory=list)
    own_buffer: bool = False
    native: List[int] = field(default_factory=list)
    generic: List[int] = field(default_factory=list)
    handles: Optional[List[Any]] = None
    threads: int = 1
    feed_input: Optional[Tuple[List[Any], List[int], List[Tuple[Any, Any, int]]]] = None
    native_t0: float = 0.0
    forced_ok: List[int] = field(default_factory=list)


def _tree_nodes(requests: Sequence[MaskRequest], nxt: torch.Tensor, sib: torch.Tensor, draft: torch.Tensor) -> int:
    """Nodes per request of a verify tree, after checking the tree's tensors against the batch."""
    bs = len(requests)
    if bs == 0:
        return 0  # an empty batch has no rows: nothing reads its node count (or its tensors)
    if nxt.dim() != 2 or nxt.shape[0] != bs:
        raise ValueError(f"retrieve_next_token must be [batch={bs}, nodes], got {tuple(nxt.shape)}")
    n = int(nxt.shape[1])
    if tuple(sib.shape) != (bs, n) or draft.numel() != bs * n:
        raise ValueError(
            f"verify tree tensors disagree: retrieve_next_token {tuple(nxt.shape)}, retrieve_next_sibling "
            f"{tuple(sib.shape)}, draft_tokens {tuple(draft.shape)}; expected [{bs}, {n}] each (draft tokens may be "
            f"flat [{bs * n}])"
        )
    return n


class TreeMaskBuilder:
    """Builds the per-node bitmask of a verify tree. One per worker; reuses its host bitmask buffer.

    ``clock`` is the time source of the time limit (monotonic seconds; ``time.perf_counter`` unless a test injects
    one): the deadline is ``clock() + time_limit_s`` taken after one-time set-up, and checked before each round of the
    walk. ``TreeMask.build_s`` is always measured with ``time.perf_counter``."""

    def __init__(
        self,
        strategy: MaskStrategy = "auto",
        threads: Optional[int] = None,
        time_limit_s: Optional[float] = None,
        pin_memory: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        native: Optional[NativeGrammar] = None,
    ) -> None:
        if strategy not in ("auto", "lockstep"):
            raise ValueError(f"unknown mask strategy {strategy!r}; expected auto or lockstep")
        self.threads = threads if threads is not None else 1  # the plugin passes Settings.mask_threads
        if strategy == "auto":
            strategy = "lockstep"
        self.strategy: MaskStrategy = strategy
        self.time_limit_s = time_limit_s
        self.pin_memory = pin_memory
        self.clock = clock
        self.native = native  # the native walk (core/native.py), used where it applies (``build``); None: Python's
        self._batch_matcher: Optional[xgr.BatchGrammarMatcher] = None
        self._serial_matcher: Optional[xgr.BatchGrammarMatcher] = None
        # Lockstep thread policy: waking xgrammar's C++ pool costs ~0.1 ms on an idle host and up to several ms on a
        # busy 2-core one, more than a round of cheap fills (most JSON states fill in a few us). A round goes to the
        # pool only if it has >= ``parallel_min_fills`` fills and its estimated serial cost (fills x running average
        # cost per fill) is >= ``parallel_min_work_s``.
        self.parallel_min_fills = 2
        self.parallel_min_work_s = 2e-3
        self._fill_cost_s = 20e-6
        # The native walk's thread policy: its helpers are persistent (a wake-up, not a thread start), and a request
        # is the unit of work; below this many requests the calling thread does them alone.
        self.parallel_min_requests = 8
        self._buf: Optional[torch.Tensor] = None
        self._buf_shape = (0, 0)  # ``_buf``'s shape as ints (read every build without a torch call)
        self._head: Optional[Tuple[int, torch.Tensor]] = None  # the last build's ``_buf[:rows]``, reused
        # Sparse, deferred reset of the reused buffer (measured: a full reset of bs x n rows was ~1/4 of the scheduler
        # thread's grammar time at bs 64). Between builds, rows [0, _clean_rows) hold all-allowed words except the rows
        # in ``_dirty``, which the last build wrote; rows from ``_clean_rows`` on are unknown. A build resets, when it
        # ends, only the rows of ``_dirty`` it did not write itself: a fill overwrites a whole row, and the walk reads
        # a row only after this build filled it (a node's children are checked against its row once it was filled),
        # so a stale row is never read and never returned. ``_dirty`` is None while a build is in progress (a build
        # that raised leaves it None: the next one resets every row it uses first).
        self._clean_rows = 0
        self._dirty: Optional[List[int]] = []
        self.allocations = 0  # observable: host bitmask buffer (re)allocations
        self.reset_rows = 0  # observable: rows set back to all-allowed (new rows, stale rows not refilled) since creation
        self.timeouts = 0  # observable: requests that hit the time limit since creation
        # observable: CPU time of the calling thread inside GIL-free native calls (batched fills) since creation; a
        # grammar thread's CPU time minus this bounds the GIL time it took from the scheduler thread.
        self.native_cpu_s = 0.0
        self.native_walks = 0  # observable: builds whose walk went through the native module in one call
        self.guidance_walks = 0  # observable: builds whose llguidance rows took the batched lockstep walk
        self._guidance_pool: Optional[Any] = None  # the llguidance fill threads (``LLExecutor``), made on first use

    # -- buffers -------------------------------------------------------------------------------------------------
    def _bitmask(self, rows: int, width: int) -> Tuple[torch.Tensor, List[int]]:
        """The first ``rows`` rows of the reused host buffer, and the rows of it the previous build wrote (stale).
        Every other row is all-allowed: rows never handed out before are reset here. Call order: once per build, which
        must then call :meth:`_settle` with the rows it wrote."""
        buf = self._buf
        if buf is None or self._buf_shape[0] < rows or self._buf_shape[1] != width:
            # Grow to the next power of two: a batch that grows step by step allocates (pinned: a slow, serialising
            # driver call) O(log rows) times, not once per new batch size.
            cap = 1 << max(rows - 1, 0).bit_length()
            buf = torch.empty((cap, width), dtype=torch.int32, pin_memory=self.pin_memory)
            self.allocations += 1
            self._buf, self._buf_shape, self._head = buf, (cap, width), None
            self._clean_rows, self._dirty = 0, []
        stale = self._dirty
        if stale is None:  # the last build did not finish: nothing it used is known
            self._clean_rows, stale = 0, []
        clean = self._clean_rows
        if rows > clean:
            buf.numpy()[clean:rows] = -1
            self._clean_rows = rows
            self.reset_rows += rows - clean
        self._dirty = None
        head = self._head
        if head is None or head[0] != rows:  # a new view only when the batch size (or the buffer) changed
            head = self._head = (rows, buf[:rows])
        return head[1], stale

    def _settle(self, stale: List[int], written: List[int]) -> None:
        """End of a build on the own buffer: reset the stale rows this build did not overwrite, remember the ones it
        wrote for the next build."""
        if stale:
            done = set(written)
            rest = [r for r in stale if r not in done]
            if rest:
                assert self._buf is not None
                self._buf.numpy()[rest] = -1
                self.reset_rows += len(rest)
        self._dirty = written

    def _ensure_batch_matchers(self) -> Tuple[xgr.BatchGrammarMatcher, xgr.BatchGrammarMatcher]:
        """The (threaded, serial) fill matchers, created on first use; the same object when ``threads`` is 1."""
        if self._batch_matcher is None or self._serial_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(self.threads)
            self._serial_matcher = xgr.BatchGrammarMatcher(1) if self.threads > 1 else self._batch_matcher
        return self._batch_matcher, self._serial_matcher

    # -- entry point ---------------------------------------------------------------------------------------------
    def build(
        self,
        requests: Sequence[MaskRequest],
        retrieve_next_token: torch.Tensor,
        retrieve_next_sibling: torch.Tensor,
        draft_tokens: torch.Tensor,
        vocab_size: int,
        out: Optional[torch.Tensor] = None,
        allow_timeout: bool = True,
        forced: Optional[ForcedDrafts] = None,
        feeds: Optional[LedgerPlan] = None,
    ) -> TreeMask:
        """Fill the tree mask. Tensors are host tensors shaped ``[bs, n]`` (draft tokens may be flat ``[bs * n]``).

        Call after the previous batch's accepted tokens were fed to the matchers (the ledger) and after the verify
        tree's host copy resolved. Returns ``TreeMask(bitmask=None)`` when no request is constrained.
        ``allow_timeout=False`` builds without the time limit, for callers that cannot neutralise drafts.
        ``forced``: record every valid node's grammar-forced continuation into its table (lockstep walk only; rows
        of other paths stay empty).

        ``feeds``: the previous batch's accepted runs still waiting in a ledger plan (``GrammarStep``'s barrier): fed
        before any walk, in the same native call as the walk when the build takes the native walk, else by
        ``feeds.feed()`` first. Fed exactly once either way (a build that raises before feeding leaves them to the
        caller's ``feed()``).

        It is :meth:`prepare`, :meth:`walk_native` (when the native walk applies) and :meth:`finish` on one thread.
        """
        n = _tree_nodes(requests, retrieve_next_token, retrieve_next_sibling, draft_tokens)
        plan = self.prepare(requests, n, vocab_size, out=out, allow_timeout=allow_timeout, forced=forced, feeds=feeds)
        res = None
        if plan.handles is not None:
            try:
                res = self.walk_native(plan, retrieve_next_token, retrieve_next_sibling, draft_tokens)
            except Exception as exc:  # a refused call (it touched nothing): the Python walk, request by request
                self.abandon_native(plan, exc)
        return self.finish(plan, res, retrieve_next_token, retrieve_next_sibling, draft_tokens)

    def prepare(self, requests: Sequence[MaskRequest], n: int, vocab_size: int, *, out: Optional[torch.Tensor] = None,
                allow_timeout: bool = True, forced: Optional[ForcedDrafts] = None,
                feeds: Optional[LedgerPlan] = None) -> BuildPlan:
        """First part of a build, on the thread that owns the requests and the ledger (the scheduler thread): sort
        the rows (unconstrained, plain xgrammar matchers, host grammars), take the host bitmask buffer, and decide
        whether the native walk applies (``BuildPlan.handles`` set: the native module, the lockstep strategy, the
        real clock). If it does, ``feeds``' waiting runs are packed for the same native call, and with ``forced`` its
        table is begun here and the call records the forced texts; if not, they are fed here, before anything else
        (:meth:`finish` walks in Python). Needs neither the tree nor the previous upload to be done: it writes only
        rows no upload ever read."""
        t0 = time.perf_counter()
        bs = len(requests)
        plan = BuildPlan(requests=requests, n=n, vocab_size=vocab_size, t0=t0, forced=forced, feeds=feeds,
                         limit=self.time_limit_s if allow_timeout else None)
        rows = requests if type(requests) is MaskBatch else MaskBatch.of(requests)
        native, generic, matchers = rows.native, rows.generic, rows.matchers
        if not native and not generic:
            if feeds is not None:
                feeds.feed()
            return plan
        width = bitmask_width(vocab_size)
        if out is not None:
            if out.shape[0] < bs * n or out.shape[1] != width or out.dtype != torch.int32:
                raise ValueError(f"out must be int32 [>= {bs * n}, {width}], got {out.dtype} {tuple(out.shape)}")
            plan.mask = out[: bs * n]
            _fill_all_allowed(plan.mask)
        else:
            plan.mask, plan.stale = self._bitmask(bs * n, width)
            plan.own_buffer = True
        plan.native, plan.generic = native, generic
        # The native walk (core/native.py): the lockstep walk in one C++ call, for a batch of plain xgrammar matchers
        # on a host mask and on the real clock (an injected clock is Python's).
        if (self.native is not None and native and self.strategy == "lockstep" and self.clock is time.perf_counter
                and plan.mask.is_cpu):
            plan.handles = self.native.handles(matchers)
        if plan.handles is None or self.native is None:
            if feeds is not None:
                feeds.feed()  # the walk is Python's: the runs go first, through the ledger's own native feed
            return plan
        if forced is not None:
            forced.begin(bs * n, n)
            plan.forced_ok = [int(forced.may_ask(m)) for m in matchers]
        threads = self.threads if self.threads > 1 and len(plan.native) >= self.parallel_min_requests else 1
        plan.threads = threads
        if feeds is not None and len(feeds):
            plan.feed_input = feeds.pending()
        return plan

    def walk_native(self, plan: BuildPlan, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                    draft_tokens: torch.Tensor) -> StepResult:
        """Second part, when ``plan.handles`` is set: the waiting runs and the whole walk in one native call
        (``NativeGrammar.step_batch``; the GIL released throughout), with the stale rows of the previous build reset
        in it: :meth:`native_call`, the call, :meth:`native_result`. Raises only if the module refused the call,
        which then touched nothing."""
        call = self.native_call(plan, retrieve_next_token, retrieve_next_sibling, draft_tokens)
        c = time.thread_time()
        raw = call()
        return self.native_result(plan, raw, time.thread_time() - c)

    def native_call(self, plan: BuildPlan, retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                    draft_tokens: torch.Tensor) -> Callable[[], Any]:
        """The native call of ``plan`` (``NativeGrammar.step_call``), not yet made, on the tree tensors given (their
        contents are read when it is called: a grammar thread may make it once the tree's host copy, the waiting runs'
        results and the previous upload of the buffer are done). Marks the start of the native work."""
        nat = self.native
        assert nat is not None and plan.handles is not None and plan.mask is not None
        bs, n = len(plan.requests), plan.n
        if tuple(retrieve_next_token.shape) != (bs, n):
            raise ValueError(f"the tree is {tuple(retrieve_next_token.shape)}, the build was prepared for "
                             f"[{bs}, {n}]")
        handles, packed, results = plan.feed_input if plan.feed_input is not None else ((), (), ())
        plan.native_t0 = time.perf_counter()
        forced = plan.forced
        return nat.step_call(handles, packed, results, plan.handles, plan.native, retrieve_next_token,
                             retrieve_next_sibling, draft_tokens, plan.mask, plan.vocab_size, plan.limit,
                             plan.threads, plan.stale if plan.own_buffer else (), self._buf, plan.forced_ok,
                             forced.keys if forced is not None and plan.forced_ok else ())

    def native_result(self, plan: BuildPlan, raw: Any, cpu_s: float) -> StepResult:
        """The result of ``plan``'s native call (``raw``, which cost its thread ``cpu_s`` of CPU time), read on the
        thread that prepared ``plan``: its feeds are recorded in the ledger plan here, at once -- the call fed those
        matchers, so whatever fails after this (:meth:`finish`, the caller's upload) must find the runs recorded and
        never feed them again. Updates the builder's counters."""
        nat = self.native
        assert nat is not None
        res = nat.step_result(raw, len(plan.feed_input[0]) if plan.feed_input is not None else 0, len(plan.native))
        if plan.feeds is not None and plan.feed_input is not None:
            plan.feeds.record_native(res)
        self.native_cpu_s += cpu_s  # tvm-ffi releases the GIL for the whole call
        self.native_walks += 1
        if res.total:
            per_fill = (time.perf_counter() - plan.native_t0) / res.total * plan.threads
            self._fill_cost_s += 0.25 * (per_fill - self._fill_cost_s)
        return res

    def abandon_native(self, plan: BuildPlan, exc: BaseException) -> None:
        """The native call of ``plan`` was refused or never made (it touched nothing): feed the waiting runs here and
        walk every request in Python in :meth:`finish`, request by request."""
        logger.warning("sglang-eagle-overlap: native tree mask build failed (%s: %s); rebuilding request by request",
                       type(exc).__name__, exc)
        if plan.feeds is not None:
            plan.feeds.feed()
        plan.feed_input = None
        plan.handles = None
        plan.generic = plan.generic + plan.native
        plan.native = []

    def finish(self, plan: BuildPlan, res: Optional[StepResult], retrieve_next_token: torch.Tensor,
               retrieve_next_sibling: torch.Tensor, draft_tokens: torch.Tensor) -> TreeMask:
        """Last part, on the thread that prepared ``plan`` (the native call's feeds are recorded already, by
        :meth:`native_result`): walk in Python what it did not (host grammars, requests whose walk raised; everything
        without the native walk), report failures and time-limit hits, and remember the rows written for the next
        build's sparse reset. ``res`` is :meth:`walk_native`'s result, or None when it did not run."""
        requests, n, vocab_size = plan.requests, plan.n, plan.vocab_size
        mask = plan.mask
        if mask is None:
            return TreeMask(bitmask=None, build_s=time.perf_counter() - plan.t0)
        bs = len(requests)
        result = TreeMask(bitmask=mask)
        written: List[int] = []  # rows this build may leave other than all-allowed (the sparse reset's next input)
        generic = plan.generic
        native = plan.native
        forced = plan.forced
        limit = plan.limit
        clock = self.clock
        lists = None
        # The time limit covers the walk and its fills only: one-time set-up (the bitmask buffer's growth -- a pinned
        # allocation on a GPU host --, the fill thread pool) must never make a request drop its drafts.
        deadline = None if limit is None else clock() + limit
        if res is not None:
            result.valid_nodes += res.total
            self.reset_rows += res.reset
            written.extend(res.written)
            failed: List[int] = []
            status = res.status
            if WALK_TIMED_OUT in status or WALK_FAILED in status:
                for i, st in zip(native, status):
                    if st == WALK_TIMED_OUT:
                        result.timed_out.append(i)
                    elif st == WALK_FAILED:
                        failed.append(i)
                        _fill_all_allowed(mask[i * n : (i + 1) * n])  # the exact walk below finds out why
            if failed:
                logger.warning("sglang-eagle-overlap: native tree walk raised for %d request(s) (%s); walking them "
                               "again one by one", len(failed),
                               "; ".join(e for (kind, _), e in res.errors.items() if kind == "w"))
                generic = generic + failed
            if forced is not None and res.forced:  # (failed walks report none)
                forced.record_found(res.forced, draft_tokens.view(bs, n)[:, 0].tolist())
        elif native:
            lists = _tree_lists(retrieve_next_token, retrieve_next_sibling, draft_tokens)
            self._walk_setup()
            if forced is not None:
                forced.begin(bs * n, n, [t[0] for t in lists[2]])
            deadline = None if limit is None else clock() + limit
            try:
                valid = self._walk_xgrammar(requests, native, lists, (retrieve_next_token, retrieve_next_sibling,
                                                                       draft_tokens), n, vocab_size, mask, deadline,
                                            result.timed_out, forced, written)
                if valid is None:
                    generic = generic + native
                else:
                    result.valid_nodes += valid
            except Exception as exc:  # one matcher broke the batched walk: find it with the per-request walk
                logger.warning("sglang-eagle-overlap: %s tree mask build failed (%s: %s); rebuilding request by "
                               "request", self.strategy, type(exc).__name__, exc)
                for i in native:
                    _fill_all_allowed(mask[i * n : (i + 1) * n])
                    if forced is not None:
                        forced.clear_rows(i * n, (i + 1) * n)
                result.timed_out.clear()
                result.valid_nodes = 0
                generic = generic + native
        elif forced is not None:
            forced.begin(bs * n)
        if generic and lists is None:
            lists = _tree_lists(retrieve_next_token, retrieve_next_sibling, draft_tokens)
        guided = [i for i in generic if requests[i].guidance is not None] if generic else generic
        if guided:
            assert lists is not None
            redo = self._walk_guidance(requests, guided, lists, n, vocab_size, mask, limit, result, written, forced)
            generic = [i for i in generic if requests[i].guidance is None] + redo
            deadline = None if limit is None else clock() + limit
        for i in generic:
            assert lists is not None
            nxt, sib, tok = lists
            written.extend(range(i * n, (i + 1) * n))
            if plan.stale:  # a host grammar's fill need not overwrite its whole row: start it from all-allowed
                _fill_all_allowed(mask[i * n : (i + 1) * n])
            try:
                valid, done = _walk_request(requests[i], nxt[i], sib[i], tok[i], vocab_size, mask, i * n, deadline,
                                            clock)
            except Exception as exc:
                _fill_all_allowed(mask[i * n : (i + 1) * n])
                result.failed.append((i, f"{type(exc).__name__}: {exc}"))
                continue
            result.valid_nodes += valid
            if not done:
                result.timed_out.append(i)
        for i, error in result.failed:
            logger.error("sglang-eagle-overlap: grammar of request %s raised during the tree mask build: %s",
                         requests[i].request_id or f"row {i}", error)
        if result.timed_out:
            self.timeouts += len(result.timed_out)
            for i in result.timed_out:
                logger.warning(
                    "sglang-eagle-overlap: tree mask for request %s exceeded %.1f ms; this step it accepts only the "
                    "grammar-masked bonus token", requests[i].request_id or f"row {i}", (limit or 0) * 1e3,
                )
        if plan.own_buffer:
            # The native call reset the stale rows it did not fill itself; otherwise they are reset here.
            self._settle([] if res is not None else plan.stale, written)
        result.build_s = time.perf_counter() - plan.t0
        return result

    # -- the walk of llguidance rows -------------------------------------------------------------------------------
    def _guidance_fills(self) -> Optional[Any]:
        """The llguidance fill threads (an ``LLExecutor`` of ``threads`` threads), made on first use; None with one
        thread (the calling thread fills, no hand-off)."""
        if self.threads <= 1:
            return None
        if self._guidance_pool is None:
            import llguidance

            self._guidance_pool = llguidance.LLExecutor(self.threads)
        return self._guidance_pool

    def _walk_guidance(self, requests: Sequence[MaskRequest], rows: Sequence[int],
                       lists: Tuple[List[List[int]], List[List[int]], List[List[int]]], n: int, vocab_size: int,
                       mask: torch.Tensor, limit: Optional[float], result: TreeMask, written: List[int],
                       forced: Optional[ForcedDrafts] = None) -> List[int]:
        """The lockstep walk of ``rows`` (requests with an llguidance matcher): each round, every request's walker
        moves to its next node through the host grammar's own ``accept_token`` / ``rollback`` / ``is_terminated``,
        then one batched llguidance fill writes all their rows (GIL-free). Same semantics and time-limit contract as
        the xgrammar lockstep walk (roots first, the deadline checked before each round). A fill that leaves a
        matcher in llguidance's error state, or any grammar call that raises, stops the batched walk: every row is
        put back (all-allowed, grammars rolled back) and returned, for the per-request walk to find the culprit.
        With ``forced``, each filled node's fast-forward tokens (llguidance's ``compute_ff_tokens``) go into its
        table. Only the rows it fills go into ``written``: llguidance overwrites a row whole, so the build's sparse
        reset (:meth:`_settle`) restores every other stale row, as for the native walk. Returns the rows to walk one by
        one (none when the batched walk completed)."""
        nxt, sib, tok = lists
        pool = self._guidance_fills()
        deadline = None if limit is None else self.clock() + limit
        mask_np = mask.numpy()
        row_bytes = int(mask.shape[1]) * 4
        total_rows = int(mask.shape[0])
        base_ptr = mask.data_ptr()

        def fill(ms: List[_GuidanceAsMatcher], rows_: List[int]) -> None:
            c = time.thread_time()
            if pool is not None and len(ms) > 1:
                pool.unsafe_compute_mask_ptr([(m.ll, r) for m, r in zip(ms, rows_)], base_ptr, row_bytes,
                                             total_rows)
            else:
                for m, r in zip(ms, rows_):
                    m.ll.unsafe_compute_mask_ptr(base_ptr + r * row_bytes, row_bytes)
            self.native_cpu_s += time.thread_time() - c  # llguidance releases the GIL inside its fills
            written.extend(rows_)
            for m in ms:
                if m.ll.is_error():
                    raise ValueError(f"llguidance matcher error: {m.ll.get_error()}")
            if forced is not None:  # each matcher is still in its node's state
                for m, r in zip(ms, rows_):
                    forced.record_tokens(m.ll.compute_ff_tokens(), r)

        timed_out: List[int] = []
        try:
            valid = self._walk_from_roots([(i, _GuidanceAsMatcher(requests[i])) for i in rows], fill, nxt, sib, tok,
                                          n, vocab_size, mask_np, deadline, timed_out)
        except Exception as exc:  # noqa: BLE001 - one grammar broke the batch: the per-request walk finds which
            logger.warning("sglang-eagle-overlap: batched llguidance tree walk failed (%s: %s); walking its %d "
                           "request(s) one by one", type(exc).__name__, exc, len(rows))
            for i in rows:
                _fill_all_allowed(mask[i * n : (i + 1) * n])
                if forced is not None:
                    forced.clear_rows(i * n, (i + 1) * n)
            return list(rows)
        result.valid_nodes += valid
        result.timed_out.extend(timed_out)
        result.guidance_walked = True
        self.guidance_walks += 1
        return []

    # -- the walk of plain xgrammar matchers ----------------------------------------------------------------------
    def _walk_setup(self) -> None:
        """One-time set-up of :meth:`_walk_xgrammar`, before the time limit's deadline is taken (the lockstep walk's
        batch matchers)."""
        self._ensure_batch_matchers()

    def _walk_xgrammar(self, requests: Sequence[MaskRequest], rows: Sequence[int],
                       lists: Tuple[List[List[int]], List[List[int]], List[List[int]]],
                       tensors: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], n: int, vocab_size: int,
                       mask: torch.Tensor, deadline: Optional[float], timed_out: List[int],
                       forced: Optional[ForcedDrafts], written: List[int]) -> Optional[int]:
        """Walk ``rows`` (requests with a plain xgrammar matcher) in Python, the tree as lists (``lists``) and as the
        caller's tensors (``tensors``): the lockstep walk. Returns the valid nodes, or None to hand the rows to the
        generic walk instead (a subclass's choice). Rows it may leave other than all-allowed go into ``written``."""
        nxt, sib, tok = lists
        return self._lockstep(requests, rows, nxt, sib, tok, n, vocab_size, mask, deadline, timed_out, forced,
                              written)

    def _lockstep(self, requests: Sequence[MaskRequest], rows: Sequence[int], nxt: Sequence[Sequence[int]],
                  sib: Sequence[Sequence[int]], tok: Sequence[Sequence[int]], n: int, vocab_size: int,
                  mask: torch.Tensor, deadline: Optional[float], timed_out: List[int],
                  forced: Optional[ForcedDrafts], written: List[int]) -> int:
        """The batched walk; every row it fills is appended to ``written`` (the deferred reset's input)."""
        threaded, serial = self._ensure_batch_matchers()
        min_fills, min_work = self.parallel_min_fills, self.parallel_min_work_s

        def fill(matchers: List[xgr.GrammarMatcher], rows_: List[int]) -> None:
            k = len(matchers)
            pooled = threaded is not serial and k >= min_fills and k * self._fill_cost_s >= min_work
            t = time.perf_counter()
            c = time.thread_time()
            written.extend(rows_)
            (threaded if pooled else serial).batch_fill_next_token_bitmask(matchers, mask, rows_)
            self.native_cpu_s += time.thread_time() - c  # xgrammar releases the GIL inside batched fills
            per_fill = (time.perf_counter() - t) / k * (self.threads if pooled else 1)
            self._fill_cost_s += 0.25 * (per_fill - self._fill_cost_s)
            if forced is not None:  # each matcher is still in its node's state
                for m, r in zip(matchers, rows_):
                    forced.record(m, r)
        mask_np = mask.numpy()
        # Round 0: every root whose grammar is not terminated (a terminated one keeps its rows all-allowed).
        return self._walk_from_roots([(i, _native_matcher(requests[i])) for i in rows], fill, nxt, sib, tok, n,
                                     vocab_size, mask_np, deadline, timed_out)

    def _walk_from_roots(self, matchers: Sequence[Tuple[int, _M]], fill: Callable[[List[_M], List[int]], None],
                         nxt: Sequence[Sequence[int]], sib: Sequence[Sequence[int]], tok: Sequence[Sequence[int]],
                         n: int, vocab_size: int, mask_np: npt.NDArray[np.int32], deadline: Optional[float],
                         timed_out: List[int]) -> int:
        """Both lockstep walks from their ``(batch index, matcher)`` pairs: round 0 fills every root whose grammar is
        not terminated (a terminated one keeps its rows all-allowed), then :meth:`_lockstep_rounds`. Returns the valid
        nodes. If anything raises, every matcher is put back where it was (a walker whose own rollback fails does not
        keep the others from theirs) and the first error is raised: the caller rebuilds request by request."""
        roots = [(i, m) for i, m in matchers if not m.is_terminated()]
        if not roots:
            return 0
        fill([m for _, m in roots], [i * n for i, _ in roots])
        # Only requests with a draft the root's row allows walk on (with drafts the grammar rejects -- a draft model
        # that ignores the grammar, a random one -- most requests stop here, without a walker).
        walkers = [_Walker(m, nxt[i], sib[i], tok[i], i * n, vocab_size, mask_np, i) for i, m in roots
                   if _root_child_allowed(nxt[i], sib[i], tok[i], mask_np[i * n], vocab_size)]
        try:
            return len(roots) + self._lockstep_rounds(walkers, fill, deadline, timed_out, self.clock)
        except BaseException:
            for w in walkers:
                try:
                    w.abandon()
                except Exception:  # noqa: BLE001 - that grammar is the culprit; the per-request walk reports it
                    pass
            raise

    @staticmethod
    def _lockstep_rounds(walkers: List[_Walker[_M]], fill: Callable[[List[_M], List[int]], None],
                         deadline: Optional[float], timed_out: List[int], clock: Callable[[], float]) -> int:
        """The rounds after the roots': each walker moves to its next node to fill, then one batched fill for all."""
        valid = 0
        active = walkers
        while active:
            if deadline is not None and clock() > deadline:
                for w in active:
                    w.abandon()
                    timed_out.append(w.batch_index)
                break
            fill_matchers: List[_M] = []
            fill_rows = []
            still = []
            for w in active:
                row = w.step()
                if row >= 0:
                    fill_matchers.append(w.matcher)
                    fill_rows.append(row)
                    still.append(w)
            if fill_matchers:
                fill(fill_matchers, fill_rows)
                valid += len(fill_matchers)
            active = still
        return valid


def _tree_lists(nxt: torch.Tensor, sib: torch.Tensor, tok: torch.Tensor) -> Tuple[List[List[int]], List[List[int]],
                                                                                List[List[int]]]:
    """The tree as nested lists (``[bs][n]`` each), for the Python walks."""
    return nxt.tolist(), sib.tolist(), tok.reshape(nxt.shape).tolist()


def _root_child_allowed(nxt: Sequence[int], sib: Sequence[int], tok: Sequence[int], root_row: npt.NDArray[np.int32],
                        vocab: int) -> bool:
    """Whether the root of one request's tree has a child whose draft token is in the vocabulary and allowed by the
    root's (filled) row: the first thing :meth:`_Walker.step` would find out, without building the walker."""
    child = nxt[0]
    while child >= 0:
        t = tok[child]
        if 0 <= t < vocab and (int(root_row[t >> 5]) >> (t & 31)) & 1:
            return True
        child = sib[child]
    return False


def _native_matcher(req: MaskRequest) -> xgr.GrammarMatcher:
    """The matcher of a row :meth:`TreeMaskBuilder.build` sent down a native path (it did so because it has one)."""
    if req.matcher is None:
        raise ValueError(f"request {req.request_id!r} has no xgrammar matcher for the native tree walk")
    return req.matcher


def _fill_all_allowed(t: torch.Tensor) -> None:
    """Set every bit. numpy, not ``Tensor.fill_``: torch's intra-op threads make a multi-MB fill 10-100x slower on a
    busy 2-core host (measured 3-46 ms vs 0.3-1 ms for an 8 MB mask)."""
    if t.device.type == "cpu":
        t.numpy().fill(-1)
    else:
        t.fill_(-1)


_M = TypeVar("_M", bound=WalkMatcher)


class _Walker(Generic[_M]):
    """Explicit-stack DFS over one request's tree, paused at every node whose row must be filled."""

    __slots__ = ("matcher", "nxt", "sib", "tok", "base", "vocab", "mask", "batch_index", "stack", "depth")

    def __init__(self, matcher: _M, nxt: Sequence[int], sib: Sequence[int], tok: Sequence[int], base: int, vocab: int,
                 mask_np: npt.NDArray[np.int32], batch_index: int) -> None:
        self.matcher = matcher
        self.nxt = nxt
        self.sib = sib
        self.tok = tok
        self.base = base
        self.vocab = vocab
        self.mask = mask_np
        self.batch_index = batch_index
        # Stack of (node to try next, its parent node, parent depth). The root's row is filled in round 0.
        first = nxt[0]
        self.stack: List[Tuple[int, int, int]] = [(first, 0, 0)] if first >= 0 else []
        self.depth = 0  # tokens accepted beyond the root

    def step(self) -> int:
        """Advance to the next node whose row must be filled; return its mask row, or -1 when the walk is done."""
        nxt, sib, tok, mask, base, vocab, matcher = (self.nxt, self.sib, self.tok, self.mask, self.base,
                                                     self.vocab, self.matcher)
        stack = self.stack
        while stack:
            node, parent, pdepth = stack.pop()
            s = sib[node]
            if s >= 0:
                stack.append((s, parent, pdepth))
            t = tok[node]
            if t < 0 or t >= vocab:
                continue
            if not (int(mask[base + parent, t >> 5]) >> (t & 31)) & 1:
                continue
            if self.depth > pdepth:
                matcher.rollback(self.depth - pdepth)
                self.depth = pdepth
            if not matcher.accept_token(t):
                continue
            self.depth = pdepth + 1
            if matcher.is_terminated():
                continue  # terminating node: row stays all-allowed, children are not visited
            c = nxt[node]
            if c >= 0:
                stack.append((c, node, self.depth))
            return base + node
        if self.depth:
            matcher.rollback(self.depth)
            self.depth = 0
        return -1

    def abandon(self) -> None:
        """Time limit: leave unbuilt rows all-allowed and restore the matcher."""
        rows = self.mask[self.base + 1 : self.base + len(self.nxt)]
        rows[:] = -1
        self.stack.clear()
        if self.depth:
            self.matcher.rollback(self.depth)
            self.depth = 0


class _GrammarAsMatcher:
    """Presents a host grammar object (llguidance, outlines, reasoning wrapper) through the matcher calls
    :class:`_Walker` makes: ``accept_token`` -> bool (a ``ValueError`` or an explicit ``False`` is a rejection)."""

    __slots__ = ("g",)

    def __init__(self, g: HostGrammar) -> None:
        self.g = g

    def accept_token(self, token: int) -> bool:
        try:
            return self.g.accept_token(token) is not False
        except ValueError:
            return False

    def rollback(self, k: int) -> None:
        self.g.rollback(k)

    def is_terminated(self) -> bool:
        return bool(self.g.is_terminated())


class _GuidanceAsMatcher(_GrammarAsMatcher):
    """A host grammar with an llguidance matcher (``MaskRequest.guidance``), for the batched llguidance walk: the walk
    accepts, rolls back and asks termination through the grammar (its termination rule is the host's), and fills
    ``ll`` directly."""

    __slots__ = ("ll",)

    def __init__(self, req: MaskRequest) -> None:
        if req.grammar is None or req.guidance is None:
            raise ValueError(f"request {req.request_id!r} has no llguidance grammar for the batched walk")
        super().__init__(req.grammar)
        self.ll = req.guidance


def _exact_walk(matcher: WalkMatcher, fill_row: Callable[[int], object], nxt: Sequence[int], sib: Sequence[int],
                tok: Sequence[int], vocab: int, mask: torch.Tensor, base: int,
                deadline: Optional[float], clock: Callable[[], float]) -> Tuple[int, bool]:
    """One request's tree walked node by node with :class:`_Walker`, ``fill_row(row)`` filling each reached row.

    Same semantics as the batched paths. Returns (valid nodes, completed). On timeout, non-root rows are reset to
    all-allowed. If a grammar method raises, the matcher is rolled back to its entry state and the exception
    propagates.
    """
    if matcher.is_terminated():
        return 0, True
    fill_row(base)
    walker = _Walker(matcher, nxt, sib, tok, base, vocab, mask.numpy(), -1)
    valid = 1
    try:
        while True:
            if deadline is not None and clock() > deadline:
                walker.abandon()
                return valid, False
            row = walker.step()
            if row < 0:
                return valid, True
            fill_row(row)
            valid += 1
    except BaseException:
        try:  # leave the matcher where it was, then report the original error
            walker.abandon()
        except Exception:  # noqa: BLE001
            pass
        raise


def _walk_request(req: MaskRequest, nxt: Sequence[int], sib: Sequence[int], tok: Sequence[int], vocab: int,
                  mask: torch.Tensor, base: int, deadline: Optional[float],
                  clock: Callable[[], float] = time.perf_counter) -> Tuple[int, bool]:
    """The exact walk for a request's xgrammar matcher or, failing that, its host grammar object."""
    if req.matcher is not None:
        m = req.matcher
        return _exact_walk(m, lambda row: m.fill_next_token_bitmask(mask, row), nxt, sib, tok, vocab, mask, base,
                           deadline, clock)
    g = req.grammar
    if g is None:
        raise ValueError(f"request {req.request_id!r} has neither a matcher nor a grammar: nothing to walk")
    return _exact_walk(_GrammarAsMatcher(g), lambda row: g.fill_vocab_mask(mask, row), nxt, sib, tok, vocab, mask,
                       base, deadline, clock)


def neutralize_timed_out_drafts(draft_tokens: torch.Tensor, timed_out: Sequence[int], num_draft_tokens: int) -> None:
    """Make the non-root draft candidates of timed-out requests unmatchable (-1), in stream order.

    ``draft_tokens`` is the verify input's device tensor, flat ``[bs * n]`` or ``[bs, n]``. Call after the mask is
    built and before sampling/acceptance. The step then accepts only the root-masked bonus token for those requests.
    """
    if not timed_out:
        return
    view = draft_tokens.view(-1, num_draft_tokens)
    # staged in pinned memory and copied non-blocking: this runs on the scheduler thread right after the verify
    # launch, where a synchronous copy would wait for the whole target forward
    idx = tree_copy.host_to_device(torch.tensor(list(timed_out), dtype=torch.long), view.device)
    view[idx, 1:] = -1
