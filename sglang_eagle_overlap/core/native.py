"""The batch's xgrammar calls in one native call per step: the tree walk and the ledger's feed (issue 17).

Why: a constrained EAGLE step makes a few xgrammar calls per request and per tree node (``accept_token``,
``rollback``, ``is_terminated``, ``fill_next_token_bitmask``). Made from Python, each is a Python frame, an argument
conversion and a GIL release and re-acquire in tvm-ffi's call, and at bs 64 that overhead is most of the step's
grammar time on the scheduler thread. ``native/grammar_batch.cc`` makes the same calls from C++ for the whole batch:
:meth:`NativeGrammar.walk_trees` is :class:`~sglang_eagle_overlap.core.mask.TreeMaskBuilder`'s lockstep walk,
:meth:`NativeGrammar.feed_runs` is :class:`~sglang_eagle_overlap.core.ledger.AcceptLedger`'s native feed. The Python
code stays the reference and the fallback; the results are the same bit for bit (``tests/core/test_native.py``).

How: xgrammar 0.2.x exposes its ``GrammarMatcher`` as a tvm-ffi object type with reflected methods. The C++ source
uses only tvm-ffi's headers (shipped in the ``apache-tvm-ffi`` wheel xgrammar depends on), finds the methods by name
at load time (:func:`load_native` fails if they are missing) and is compiled on first use against the installed
tvm-ffi with the system C++ compiler, into a cache outside the package keyed by the source, the tvm-ffi version and
the compiler (:func:`build_native`; a few seconds, once per environment). Loaded with ``tvm_ffi.load_module``; tvm-ffi
releases the GIL for the call, so a native step also leaves the GIL to the scheduler thread.

Only matchers whose type is exactly ``xgrammar.GrammarMatcher`` go native (:meth:`NativeGrammar.handles`): a
subclass may override a method in Python, which C++ would bypass.

Upstream: xgrammar's ``BatchGrammarMatcher`` has batched fills and a one-token ``batch_accept_token``, but no batched
tree walk and no termination report; were it to gain both, this module would shrink to calls of it.

Importing this module imports nothing beyond the standard library; torch, tvm-ffi and xgrammar are imported by the
calls that need them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

__all__ = ["NATIVE_SOURCE", "NativeGrammar", "NativeUnavailable", "build_native", "default_cache_dir", "load_native"]

logger = logging.getLogger(__name__)

NATIVE_SOURCE = Path(__file__).resolve().parents[1] / "native" / "grammar_batch.cc"

# FeedRuns' state codes (grammar_batch.cc).
FED, TERMINATED, REJECTED, TERMINATED_BEFORE = 0, 1, 2, 3


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
    """The loaded module (:func:`load_native`). Thread-safe: it holds no state between calls."""

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
            out.append(getattr(m, "_handle"))  # xgrammar's tvm-ffi object (a private attribute: typed as object)
        return out

    def walk_trees(self, handles: Sequence[Any], rows: Sequence[int], nxt: torch.Tensor, sib: torch.Tensor,
                   tok: torch.Tensor, mask: torch.Tensor, vocab_size: int, budget_s: Optional[float],
                   threads: int = 1) -> Tuple[Sequence[int], Sequence[int], int]:
        """The lockstep walk of ``TreeMaskBuilder`` for the requests at batch ``rows`` (``handles[k]`` is row
        ``rows[k]``'s matcher) over the host tree ``nxt`` / ``sib`` (``[bs, n]``) and ``tok`` (``bs * n`` values; int32
        or int64 each), into ``mask`` (int32, contiguous, ``[>= bs * n, width]``; every row this call may write holds
        all-allowed or a stale fill the walk never reads). ``budget_s`` None: no time limit.

        Returns ``(status, written, valid)``: ``status[k]`` is -1 for a terminated request (rows untouched), its
        valid nodes (root included), or ``-(2 + valid)`` when the time limit cut its walk (its non-root rows are
        then all-allowed again); ``written`` lists the rows filled; ``valid`` sums the valid nodes. No torch call
        is made here: the lists go to C++ as tvm-ffi arrays, the tensors as views."""
        k = len(rows)
        out = self.module.walk_trees(handles, rows, nxt, sib, tok, mask, vocab_size,
                                     -1.0 if budget_s is None else max(budget_s, 0.0), threads)
        return out[1 : k + 1], out[k + 1 :], out[0]

    def feed_runs(self, handles: Sequence[Any], runs: Sequence[Sequence[int]],
                  live: Sequence[bool]) -> List[Tuple[int, int]]:
        """Feed ``runs[k]`` to ``handles[k]``'s matcher as ``AcceptLedger``'s native feed does (``live[k]``: its last
        run left it not terminated). One ``(retained, state)`` per run, state one of ``FED``, ``TERMINATED``,
        ``REJECTED``, ``TERMINATED_BEFORE``."""
        packed: List[int] = []
        for run, lv in zip(runs, live):
            packed.append(1 if lv else 0)
            packed.append(len(run))
            packed.extend(run)
        out = self.module.feed_runs(handles, packed)
        return list(zip(out[0::2], out[1::2]))
