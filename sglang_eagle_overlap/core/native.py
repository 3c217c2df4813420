"""The batch's xgrammar calls in one native call per step: the ledger's feed and the tree walk.

Why: a constrained EAGLE step makes a few xgrammar calls per request and per tree node (``accept_token``,
``rollback``, ``is_terminated``, ``fill_next_token_bitmask``). Made from Python, each is a Python frame, an argument
conversion and a GIL release and re-acquire in tvm-ffi's call, and at bs 64 that overhead is most of the step's
grammar time on the scheduler thread. ``native/grammar_batch.cc`` makes the same calls from C++ for the whole batch,
in ONE call (:meth:`NativeGrammar.step_batch`): the previous batch's runs are fed as
:class:`~sglang_eagle_overlap.core.ledger.AcceptLedger`'s native feed feeds them (read from the result's token tensors
when the ledger queued them by row), then :class:`~sglang_eagle_overlap.core.mask.TreeMaskBuilder`'s lockstep walk
fills the tree mask, and the previous build's stale rows are reset. Each request's matcher is handled by one thread
from its first feed to the end of its walk; requests are spread over the calling thread and persistent helper threads
of the module; an error stays with its request. The call holds no Python object and never takes the GIL, so
``GrammarStep``'s grammar thread can make it while the scheduler thread runs Python (:meth:`NativeGrammar.step_call`
binds it without making it). The Python code stays the reference and the fallback; the results are the same bit for
bit (``tests/core/test_native.py``).

How: xgrammar 0.2.x exposes its ``GrammarMatcher`` as a tvm-ffi object type with reflected methods. The C++ source
uses only tvm-ffi's headers (shipped in the ``apache-tvm-ffi`` wheel xgrammar depends on), finds the methods by name
at load time (:func:`load_native` fails if they are missing) and is compiled on first use against the installed
tvm-ffi with the system C++ compiler, into a cache outside the package keyed by the source, the tvm-ffi version and
the compiler (:func:`build_native`; a few seconds, once per environment). Loaded with ``tvm_ffi.load_module``; tvm-ffi
releases the GIL for the call, so a native step also leaves the GIL to the scheduler thread. The error messages of a
call are fetched only when it reports some (``step_errors``), on the thread that made the call, right after it: the
module keeps them per calling thread until that thread's next call.

Only matchers whose type is exactly ``xgrammar.GrammarMatcher`` go native (:meth:`NativeGrammar.handles`): a
subclass may override a method in Python, which C++ would bypass.

Upstream: xgrammar's ``BatchGrammarMatcher`` has batched fills and a one-token ``batch_accept_token``, but no batched
tree walk and no termination report; were it to gain both, this module would shrink to calls of it.

Importing this module imports nothing beyond the standard library; torch, tvm-ffi and xgrammar are imported by the
calls that need them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

__all__ = ["NATIVE_SOURCE", "ForcedText", "NativeGrammar", "NativeUnavailable", "StepResult", "build_native",
           "default_cache_dir", "load_native"]

logger = logging.getLogger(__name__)

NATIVE_SOURCE = Path(__file__).resolve().parents[1] / "native" / "grammar_batch.cc"

# StepBatch's feed states and walk statuses (grammar_batch.cc).
FED, TERMINATED, REJECTED, TERMINATED_BEFORE, FEED_ERROR, NOT_FED = 0, 1, 2, 3, 4, 5
WALKED, WALK_TERMINATED, WALK_TIMED_OUT, WALK_FAILED = 0, 1, 2, 3


class NativeUnavailable(RuntimeError):
    """The native module could not be built or loaded (no C++ compiler, no tvm-ffi headers, another xgrammar)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/sglang-eagle-overlap/native`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sglang-eagle-overlap" / "native"


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def build_native(cache_dir: Optional[Path] = None) -> Path:
    """The shared library of ``grammar_batch.cc`` for the installed tvm-ffi: compiled into ``cache_dir`` unless a
    build with the same key is there. Safe to race (each build writes its own temporary file, then renames it into
    place). Raises :class:`NativeUnavailable` with the compiler's output on failure."""
    try:
        import tvm_ffi
        from tvm_ffi import libinfo
    except ImportError as exc:
        raise NativeUnavailable(f"tvm-ffi is not importable: {exc}") from exc
    cxx = _compiler()
    includes = list(libinfo.include_paths())
    lib = libinfo.find_libtvm_ffi()
    source = NATIVE_SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, str(getattr(tvm_ffi, "__version__", "")).encode(),
                                     os.fsencode(shutil.which(cxx) or cxx), *map(os.fsencode, includes),
                                     os.fsencode(lib)])).hexdigest()[:16]
    cache = cache_dir if cache_dir is not None else default_cache_dir()
    target = cache / f"grammar_batch_{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=cache)
    os.close(fd)
    libdir = os.path.dirname(lib)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", *(f"-I{p}" for p in includes),
           str(NATIVE_SOURCE), "-o", tmp, f"-L{libdir}", "-ltvm_ffi", f"-Wl,-rpath,{libdir}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise NativeUnavailable(f"compiling {NATIVE_SOURCE.name} failed ({' '.join(cmd)}):\n"
                                    f"{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("sglang-eagle-overlap: built %s in %.1f s", target, time.perf_counter() - t0)
    return target


def load_native(cache_dir: Optional[Path] = None) -> "NativeGrammar":
    """Build (if needed) and load the native module, and check that this xgrammar's matcher has the methods it calls.
    Raises :class:`NativeUnavailable`."""
    path = build_native(cache_dir)
    try:
        import tvm_ffi
        import xgrammar as xgr

        module = tvm_ffi.load_module(str(path))
        type_key = str(module.check())
    except NativeUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - anything the loader or the method lookup raises means "not usable"
        raise NativeUnavailable(f"loading {path} failed: {type(exc).__name__}: {exc}") from exc
    return NativeGrammar(module=module, path=str(path), type_key=type_key, matcher_type=xgr.GrammarMatcher)


@dataclass(frozen=True)
class NativeGrammar:
    """The loaded module (:func:`load_native`). Calls from several threads do not share state, as long as they do
    not share matchers or buffers: the module keeps a call's error messages per calling thread (``LastErrors`` in
    ``grammar_batch.cc`` is thread-local), and :meth:`step_call`'s callable fetches them on that thread right after
    the call, so a call on another thread cannot replace them before :meth:`step_result` reads them."""

    module: Any
    path: str
    type_key: str
    matcher_type: type

    def handles(self, matchers: Sequence[Any]) -> Optional[List[Any]]:
        """The tvm-ffi objects of ``matchers``, or None if one of them is not exactly ``xgrammar.GrammarMatcher``."""
        t = self.matcher_type
        out: List[Any] = []
        for m in matchers:
            if type(m) is not t:
                return None
            out.append(self.handle(m))
        return out

    @staticmethod
    def handle(matcher: Any) -> Any:
        """The tvm-ffi object of an ``xgrammar.GrammarMatcher`` whose type the caller checked (``matcher_type``):
        xgrammar's ``_handle``, the only place this package reads that private attribute."""
        return getattr(matcher, "_handle")

    def step_batch(self, feed_handles: Sequence[Any], feed_packed: Sequence[int],
                   sources: Sequence[Tuple[torch.Tensor, Optional[torch.Tensor], int]], walk_handles: Sequence[Any],
                   rows: Sequence[int], nxt: Optional[torch.Tensor], sib: Optional[torch.Tensor],
                   tok: Optional[torch.Tensor], mask: Optional[torch.Tensor], vocab_size: int,
                   budget_s: Optional[float], threads: int = 1, reset: Sequence[int] = (),
                   buffer: Optional[torch.Tensor] = None, forced_ok: Sequence[int] = (),
                   forced_keys: Sequence[int] = ()) -> StepResult:
        """A verify step's xgrammar work in one call (``grammar_batch.cc``: ``StepBatch``).

        1. Feeds, as ``AcceptLedger``'s native feed: run ``f`` goes to ``feed_handles[f]``'s matcher (runs of one
           matcher in order). ``feed_packed`` holds per run ``live`` (1: its last run left the matcher not
           terminated), then ``-1, len, tokens...`` or ``s, row``: the run ``row`` of result ``sources[s] = (ids,
           accept_lens or None for a prefill, stride)``, read in C++ (the results' host copies must be done).
        2. The lockstep walk of ``TreeMaskBuilder`` for the requests at batch ``rows`` (``walk_handles[k]`` is row
           ``rows[k]``'s matcher, fed first when it has runs) over the host tree ``nxt`` / ``sib`` (``[bs, n]``) and
           ``tok`` (``bs * n`` values; int32 or int64 each), into ``mask`` (int32, contiguous, ``[>= bs * n, width]``;
           every row this call may write holds all-allowed or a stale fill the walk never reads). ``budget_s`` None:
           no time limit.
        3. Every row of ``reset`` (rows of ``buffer``, the whole reusable bitmask whose first rows ``mask`` is) that
           this call did not fill is set back to all-allowed.
        4. With ``forced_ok`` (one flag per walk request; empty: none), the forced texts of every row filled for a
           flagged request, as ``ForcedDrafts.record`` asks for them (``forced_keys``: the bonus keys):
           :attr:`StepResult.forced`. Flag only requests whose grammar was admitted (``ForcedDrafts.may_ask``).

        Each matcher is handled by one of ``threads`` threads (the caller's and persistent helpers), all roots before
        any walk; an error stays with its request (:class:`StepResult`). The tree tensors may be None when nothing is
        walked. No torch call is made here: the lists go to C++ as tvm-ffi arrays, the tensors as views."""
        call = self.step_call(feed_handles, feed_packed, sources, walk_handles, rows, nxt, sib, tok, mask, vocab_size,
                              budget_s, threads, reset, buffer, forced_ok, forced_keys)
        return self.step_result(call(), len(feed_handles), len(rows))

    def step_call(self, feed_handles: Sequence[Any], feed_packed: Sequence[int],
                  sources: Sequence[Tuple[torch.Tensor, Optional[torch.Tensor], int]], walk_handles: Sequence[Any],
                  rows: Sequence[int], nxt: Optional[torch.Tensor], sib: Optional[torch.Tensor],
                  tok: Optional[torch.Tensor], mask: Optional[torch.Tensor], vocab_size: int,
                  budget_s: Optional[float], threads: int = 1, reset: Sequence[int] = (),
                  buffer: Optional[torch.Tensor] = None, forced_ok: Sequence[int] = (),
                  forced_keys: Sequence[int] = ()) -> Callable[[], Any]:
        """:meth:`step_batch`'s native call with its arguments bound, not yet made: calling it makes the call (GIL-free
        for its whole length, so another thread can make it while this one runs Python) and returns its raw result
        with the call's error messages and forced texts (fetched on the calling thread, where the module keeps them),
        which
        :meth:`step_result` reads on any thread. The tensors are read when it is called, not before."""
        if nxt is None or sib is None or tok is None or mask is None:
            if walk_handles:
                raise ValueError("a walk needs the tree tensors and the mask")
            nxt = sib = tok = mask = _empty()
        if buffer is None:
            if reset:
                raise ValueError("a reset needs the buffer")
            buffer = _empty()
        ids = [src[0] for src in sources]
        lens = [src[1] if src[1] is not None else _empty() for src in sources]
        strides = [src[2] for src in sources]
        bound = functools.partial(self.module.step_batch, feed_handles, feed_packed, ids, lens, strides, walk_handles,
                                  rows, nxt, sib, tok, mask, vocab_size,
                                  -1.0 if budget_s is None else max(budget_s, 0.0), threads, reset, buffer,
                                  forced_ok, forced_keys)
        fetch_errors, fetch_forced = self.module.step_errors, self.module.step_forced

        def call() -> Tuple[Any, Sequence[str], Sequence[str]]:
            values = bound()
            # Nothing may raise from here on: the call has fed and walked, and a caller that saw an exception would
            # take the call as never made and feed its runs again. Texts are whole UTF-8 (RecordForced checks).
            try:
                messages = list(fetch_errors()) if values[2] else []
            except Exception:  # noqa: BLE001 - the messages only explain errors the values already report
                messages = []
            try:
                texts = [str(t) for t in fetch_forced()] if values[4] else []
            except Exception:  # noqa: BLE001 - a forced text is a hint: without it the step drafts less, exactly
                texts = []
            return values, messages, texts

        return call

    def step_result(self, raw: Tuple[Any, Sequence[str], Sequence[str]], feeds: int, walks: int) -> StepResult:
        """:class:`StepResult` of what a :meth:`step_call` callable returned (the raw values, the call's error
        messages and forced texts) with ``feeds`` runs and ``walks`` walk requests."""
        values, messages, texts = raw
        w, f = walks, feeds
        a = 5 + 2 * w
        b = a + 2 * f
        c = b + f
        d = c + values[3]
        e = d + 2 * values[4]
        pairs = values[d:e]
        forced = [ForcedText(int(pairs[2 * i]), int(pairs[2 * i + 1]), t) for i, t in enumerate(texts)]
        return StepResult(total=values[0], status=values[5 : 5 + w], valid=values[5 + w : a], feeds=values[a:b],
                          written=values[e:], errors=_errors(messages) if values[2] else {}, reset=values[1],
                          run_lens=values[b:c], run_tokens=values[c:d], forced=forced)


class ForcedText(NamedTuple):
    """A forced text the native walk found (``ForcedDrafts.record``'s question, asked in C++): after node ``row``
    (its flat row ``b * n + node``) the grammar forces ``text``; ``key`` -1: from the node's own state, else after the
    bonus key ``key`` (where the node's own text is empty; in key order)."""

    row: int
    key: int
    text: str


class StepResult(NamedTuple):
    """What :meth:`NativeGrammar.step_batch` hands back (immutable; a named tuple: one is made per step, and a frozen
    dataclass costs several times more to build). ``status[k]`` / ``valid[k]``: walk request ``k``'s outcome
    (``WALKED``, ``WALK_TERMINATED`` -- rows untouched --, ``WALK_TIMED_OUT`` -- its non-root rows all-allowed again
    --, ``WALK_FAILED`` -- its rows are the caller's to reset) and its valid nodes, root included; ``total`` sums the
    valid nodes of all but failed requests; ``feeds[2 f]``, ``feeds[2 f + 1]``: run ``f``'s retained tokens and
    state; ``written``: the rows filled; ``reset``: the rows the sparse reset set back to all-allowed; ``errors``:
    ``("f" or "w", index) -> message`` of the runs and walks that raised; ``run_lens[f]``: run ``f``'s length, and
    ``run_tokens`` all runs' tokens in run order, as the call read them (``LedgerPlan.fill`` books the runs queued by
    row from these, without converting their results' tensors to lists); ``forced``: the forced texts found (step 4
    of :meth:`NativeGrammar.step_batch`)."""

    total: int
    status: Sequence[int]
    valid: Sequence[int]
    feeds: Sequence[int]
    written: Sequence[int]
    errors: Dict[Tuple[str, int], str]
    reset: int = 0
    run_lens: Sequence[int] = ()
    run_tokens: Sequence[int] = ()
    forced: Sequence[ForcedText] = ()


def _errors(raw: Sequence[str]) -> Dict[Tuple[str, int], str]:
    out: Dict[Tuple[str, int], str] = {}
    for text in raw:
        head, _, message = str(text).partition(": ")
        out[(head[0], int(head[1:]))] = message
    return out


def _empty() -> torch.Tensor:
    import torch

    return torch.zeros((0, 1), dtype=torch.int32)
