"""Grammar-forced continuations as drafts, engine-agnostic.

A JSON schema decides much of the output (keys, quotes, colons, brackets). While step N's tree mask is built, every
valid node's matcher state is at hand, so the grammar's forced continuation after each node is cheap to ask for:
xgrammar's ``find_jump_forward_string``, tokenized the way the model writes it alone (``encode``); its tail tokens
that could merge with what follows (a key's ``'":"'``, which ``'":'`` + ``'""'`` spells when the value starts with a
quote) are drafted too, with the merged spellings as that position's alternatives (``draft_tail``; else held back);
llguidance's fast-forward tokens (``compute_ff_tokens``) as they are.
Which node step N accepts is known only on the device after the verify, so the per-node table goes up with the
mask and the device picks the accepted node's row (a gather, no host sync). Step N+1's draft tree then gets those
tokens on its top path (the first-child chain from the root), in place of what the draft model proposed, before the
target verify reads them -- except from the first position where the draft model's token spells a prefix of the
forced text in other tokens, or the tail merged with what follows (a draft trained on the target's outputs has learned
how the target tokenizes the forced text; replacing its token there would cut a path the target accepts).

Where the accepted node forces nothing itself -- inside a string value -- the text forced next depends on the token
the target writes there, step N+1's root: after a value's closing quote comes the next key. So each such node also
gets, for a few learned bonus keys (tokens that began forced text as roots before, most frequent first) that its
grammar allows, the text forced after the key (``accept_token``, ask, ``rollback(1)`` on the node's matcher), and
step N+1 takes the slot whose first token is its root (:class:`ForcedDrafts`).

Call order per verify step (one process, the host's scheduler thread unless noted)::

    forced.admit(matcher, compiled_grammar)   # per request, before its first build (a lookup once decided)
    forced.apply(draft_token, next_token, rids, draft_probs_used)   # step N+1, before the verify prepares its input
    ... tree copy, grammar job: forced.begin(rows, n, roots), then forced.record(matcher, row) per valid node (the
        Python walk), or forced.begin(rows, n) before the native walk and forced.record_found(texts, roots) after
        it (the walk asked the same texts in C++, on the grammar thread) ...
    forced.upload(device)                                            # with the mask, after the join
    forced.after_verify(accept_index, rids)                          # right after the host's verify sampling

Exact by construction: a forced draft is a draft like any other, checked by the target verify under the grammar
mask; one the target does not choose is rejected. The override is used only when the root of step N+1's tree (the
token step N committed last) equals the first forced token, i.e. the target wrote the forced text the way ``encode``
does; after a retraction, a new request or a changed batch the request's row is simply absent (no override).
Tokens stay within the vocabulary (they come from the model's tokenizer). Not used when the host verifies with the
draft's own probabilities (rejection sampling: a replaced draft would carry the wrong probability).

Bounded: a grammar with a rule that matches no finite string (a JSON schema whose object requires itself) can force
text forever, and xgrammar's search for it then allocates until the process runs out of memory. ``admit`` reads the
grammar once (:func:`forcing_is_bounded`); such a request's matcher is never asked (no forced drafts for it), and with
``require_admission`` (the integration's) neither is a matcher never admitted.

Invariants: ``record`` only writes rows of the current build's table; ``after_verify`` consumes the uploaded table
of the same step; ``apply`` consumes what the previous ``after_verify`` kept, at most once. Counters (``proposed``:
drafts replaced; ``changed``: of those, where the draft model had proposed another token; ``accepted``; ``changed_accepted``:
accepted where the draft model had proposed another token, the only drafts the replacement itself won: an accepted
unchanged token was the draft model's own proposal) accumulate on the device and are copied to the host without a
sync; a reader sees the newest copy whose event has completed (they may lag a few steps on a GPU), never one still in
flight. Host-to-device copies (the table, the row map, the cached positions) go through pinned memory, non-blocking:
the scheduler thread never waits for the device's queue on this path.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sglang_eagle_overlap.core import tree_copy
from sglang_eagle_overlap.core.protocols import ForcingMatcher, JumpForward

if TYPE_CHECKING:
    import numpy.typing as npt
    from torch.types import Device

__all__ = ["ALTERNATIVES", "BatchEncoder", "Decoder", "Encoder", "ForcedDrafts", "ForcedTokens",
           "forcing_is_bounded", "prefix_alternatives", "stable_tokens", "tokenize_forced"]

Encoder = Callable[[str], Sequence[int]]
BatchEncoder = Callable[[Sequence[str]], Sequence[Sequence[int]]]  # the same tokenization, many strings per call
Decoder = Callable[[Sequence[int]], str]
_CACHE_MAX = 8192
ALTERNATIVES = 4  # other tokenizations kept per forced position (the table's last axis holds 1 + this many ids)
_ALT_CHARS = 16  # longest prefix of the forced text looked up as one token
_COUNT_COPIES = 4  # counter copies to the host in flight at most; past that the oldest (long done) is waited for
BONUS_KEYS = 3  # bonus tokens tried per node whose own continuation is empty (the table's slots 1..this)
_KEYS_MAX = 256  # bonus-key candidates counted at most; past that the rarest half is forgotten


# What may follow a forced string: a letter, a digit, a space, a quote, a bracket. A token of ``encode(s)`` that
# ``encode(s + probe)`` does not keep for some probe could merge with what the model writes next: held back.
_PROBES = ("a", "A", "1", " ", '"', "{", "[", "}", "]", ",", "\n")


def _encoder_many(encode: Encoder, encode_batch: Optional[BatchEncoder]) -> BatchEncoder:
    """The batch encoder to use: ``encode_batch`` (one native call for many strings) or ``encode`` per string."""
    if encode_batch is not None:
        return encode_batch
    return lambda texts: [encode(t) for t in texts]


class ForcedTokens(NamedTuple):
    """A forced string as the model's tokenizer writes it alone (:func:`tokenize_forced`)."""

    tokens: Tuple[int, ...]  # ``encode(s)``
    stable: int  # how many of them ``encode(s + probe)`` keeps for every probe: the rest could merge with what follows
    merges: Tuple[Tuple[int, ...], ...]  # per token: what the probes put at its place instead (empty before ``stable``)


def tokenize_forced(encode: Encoder, s: str, encode_batch: Optional[BatchEncoder] = None) -> ForcedTokens:
    """``encode(s)``, how long a prefix of it every probe ``p`` (letters, digits, space, quote, brackets, comma,
    newline) keeps in ``encode(s + p)``, and, per token past that prefix, the tokens the probes put there instead (the
    tail merged with what follows, e.g. ``'":"'`` written ``'":'`` then ``'""'``). ``encode_batch`` (same
    tokenization, many strings per call) tokenizes ``s`` and its probes in one call."""
    first, *longer = _encoder_many(encode, encode_batch)([s] + [s + probe for probe in _PROBES])
    toks = tuple(int(t) for t in first)
    keep = len(toks)
    merged: Dict[int, Dict[int, None]] = {}
    for ids in longer:
        k = 0
        while k < len(toks) and k < len(ids) and int(ids[k]) == toks[k]:
            k += 1
        keep = min(keep, k)
        if k < len(toks) and k < len(ids):
            merged.setdefault(k, {})[int(ids[k])] = None
    return ForcedTokens(toks, keep, tuple(tuple(merged.get(i, ())) for i in range(len(toks))))


def stable_tokens(encode: Encoder, s: str, encode_batch: Optional[BatchEncoder] = None) -> Tuple[int, ...]:
    """``encode(s)`` without its tail tokens that could merge with what follows: the longest prefix that
    ``encode(s + p)`` keeps for every probe ``p`` (:func:`tokenize_forced`)."""
    t = tokenize_forced(encode, s, encode_batch)
    return t.tokens[: t.stable]


def prefix_alternatives(encode: Encoder, decode: Decoder, s: str, toks: Sequence[int],
                        limit: int = ALTERNATIVES,
                        encode_batch: Optional[BatchEncoder] = None,
                        first: bool = False) -> Tuple[Tuple[int, ...], ...]:
    """Per forced token ``toks[i]`` of the text ``s``: up to ``limit`` other single tokens whose text is a prefix of
    ``s`` from token ``i``'s offset on (the same characters, tokenized otherwise), shortest first; position 0 gets
    none (it is the root check) unless ``first`` (``s`` follows a bonus token, so its first token is a draft too).
    Stops where ``decode`` of a token does not spell ``s`` (positions past it get none). Every prefix looked up is
    tokenized in one ``encode_batch`` call when given."""
    offsets: List[int] = []  # where each position's text starts in ``s``, up to the first token that does not spell it
    off = 0
    for t in toks:
        offsets.append(off)
        piece = decode([int(t)])
        if not piece or not s.startswith(piece, off):
            break
        off += len(piece)
    skip = 0 if first else 1
    prefixes = list(dict.fromkeys(s[o : o + n] for o in offsets[skip:]
                                  for n in range(1, min(len(s) - o, _ALT_CHARS) + 1)))
    ids_of = dict(zip(prefixes, _encoder_many(encode, encode_batch)(prefixes))) if prefixes else {}
    out: List[Tuple[int, ...]] = [()] * skip
    for o, t in zip(offsets[skip:], toks[skip:]):
        found: List[int] = []
        for n in range(1, min(len(s) - o, _ALT_CHARS) + 1):
            ids = ids_of[s[o : o + n]]
            if len(ids) == 1 and int(ids[0]) != int(t) and int(ids[0]) not in found:
                found.append(int(ids[0]))
                if len(found) == limit:
                    break
        out.append(tuple(found))
    return tuple(out) if offsets else ()


# One lexical element of a grammar's EBNF text (xgrammar's ``str(grammar)``): a string literal, a character class, a
# rule name, a repetition range, a lookahead opener, a bracket or an operator. Anything else makes the text unknown.
_EBNF_TOKEN = re.compile(r'\s*(?:("(?:[^"\\]|\\.)*")|(\[(?:[^\]\\]|\\.)*\])|([A-Za-z_][A-Za-z0-9_.-]*)'
                         r'|(\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(\(=)|([()|*+?]))')
# xgrammar's regex element, ``Regex("...", json_string=true)``: a terminal (it matches some string), read as one.
_EBNF_REGEX = re.compile(r'Regex\(\s*"(?:[^"\\]|\\.)*"(?:\s*,\s*\w+\s*=\s*\w+)*\s*\)')
_Expr = Union[bool, str, Tuple[str, Any]]  # True (a terminal), a rule name, ("seq"|"alt", parts) or ("opt"|"rep", e)


class _UnknownGrammar(ValueError):
    """The EBNF text holds a construct this reader does not model (it then vouches for nothing)."""


def _parse_body(text: str) -> _Expr:
    """A rule body as nested tuples, lookaheads dropped (they only narrow what the body matches)."""
    toks: List[Tuple[int, str]] = []
    pos = 0
    text = _EBNF_REGEX.sub('"r"', text).rstrip()
    while pos < len(text):
        m = _EBNF_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise _UnknownGrammar(text[pos : pos + 40])
        toks.append((m.lastindex or 0, m.group(m.lastindex or 0)))
        pos = m.end()
    at = 0

    def alt() -> _Expr:
        nonlocal at
        parts = [seq()]
        while at < len(toks) and toks[at] == (6, "|"):
            at += 1
            parts.append(seq())
        return parts[0] if len(parts) == 1 else ("alt", parts)

    def seq() -> _Expr:
        nonlocal at
        parts: List[_Expr] = []
        while at < len(toks) and toks[at] not in ((6, "|"), (6, ")")):
            kind, tok = toks[at]
            at += 1
            if kind == 5:  # lookahead: parsed, then dropped
                alt()
                close()
                continue
            if kind in (1, 2):
                item: _Expr = True
            elif kind == 3:
                if at < len(toks) and toks[at] == (6, "("):  # a call such as TagDispatch(...): not modelled
                    raise _UnknownGrammar(tok)
                item = tok
            elif tok == "(":
                item = alt()
                close()
            else:
                raise _UnknownGrammar(tok)
            while at < len(toks) and (toks[at][0] == 4 or toks[at][1] in ("*", "+", "?")):
                op = toks[at][1]
                at += 1
                least = int(op.strip("{} ").split(",")[0]) if op.startswith("{") else (1 if op == "+" else 0)
                item = ("rep", item) if least else ("opt", item)
            parts.append(item)
        return parts[0] if len(parts) == 1 else ("seq", parts)

    def close() -> None:
        nonlocal at
        if at >= len(toks) or toks[at] != (6, ")"):
            raise _UnknownGrammar("unbalanced brackets")
        at += 1

    out = alt()
    if at != len(toks):
        raise _UnknownGrammar(toks[at][1])
    return out


def _productive(e: _Expr, rules: "set[str]") -> bool:
    """Whether ``e`` matches some finite string, given the rules known to (``rules``)."""
    if isinstance(e, bool):
        return e
    if isinstance(e, str):
        return e in rules
    kind, inner = e
    if kind == "opt":
        return True
    if kind == "rep":
        return _productive(inner, rules)
    if kind == "seq":
        return all(_productive(x, rules) for x in inner)
    return any(_productive(x, rules) for x in inner)


def _names(e: _Expr) -> "set[str]":
    """The rule names ``e`` refers to."""
    if isinstance(e, bool):
        return set()
    if isinstance(e, str):
        return {e}
    kind, inner = e
    if kind in ("opt", "rep"):
        return _names(inner)
    return set().union(*(_names(x) for x in inner))


def forcing_is_bounded(grammar: object) -> bool:
    """Whether every rule of ``grammar`` (an xgrammar grammar or compiled grammar; its EBNF text is read) matches some
    finite string. Then from every matcher state some finite completion exists, and the forced text -- a prefix of
    every continuation, ending where the grammar may end -- is no longer than it: ``find_jump_forward_string`` ends.
    A rule without a finite match (``node ::= "{\"next\": " node "}"``) may force text forever, and xgrammar's
    search then allocates until the process runs out of memory. False also where the text holds a construct not
    modelled here: the caller then does not ask for forced text at all."""
    text = str(getattr(grammar, "grammar", grammar))
    bodies: Dict[str, _Expr] = {}
    try:
        for line in text.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition("::=")
            if not sep or not name.strip():
                return False
            bodies[name.strip()] = _parse_body(body)
    except _UnknownGrammar:
        return False
    # least fixpoint: a rule is productive once one of its alternatives is; a rule found productive re-checks only
    # the rules that name it (linear in the grammar's size, not quadratic in a long chain of definitions)
    users: Dict[str, List[str]] = {}
    for rule, expr in bodies.items():
        for name in _names(expr):
            users.setdefault(name, []).append(rule)
    done: "set[str]" = set()
    todo = [rule for rule, expr in bodies.items() if _productive(expr, done)]
    while todo:
        rule = todo.pop()
        if rule in done:
            continue
        done.add(rule)
        todo.extend(u for u in users.get(rule, ()) if u not in done and _productive(bodies[u], done))
    return bool(bodies) and len(done) == len(bodies)


class _IdMap:
    """A bool per live object, keyed by identity (for unhashable objects): an entry goes when its object is freed."""

    def __init__(self) -> None:
        self._d: Dict[int, Tuple[weakref.ref[Any], bool]] = {}

    def get(self, obj: object) -> Optional[bool]:
        e = self._d.get(id(obj))
        return e[1] if e is not None and e[0]() is obj else None

    def set(self, obj: object, value: bool) -> None:
        key, d = id(obj), self._d

        def drop(r: weakref.ref[Any]) -> None:
            e = d.get(key)
            if e is not None and e[0] is r:
                del d[key]

        d[key] = (weakref.ref(obj, drop), value)

    def __len__(self) -> int:
        return len(self._d)


def _forced_text(matcher: JumpForward) -> Optional[str]:
    """``matcher``'s forced text, or None where it is not whole UTF-8 characters: a matcher in the middle of a
    multi-byte character forces the rest of its bytes first, which xgrammar's Python API cannot return as a str
    (``UnicodeDecodeError``) and no tokenizer's ``encode`` could take (the native walk leaves such texts out too)."""
    try:
        return matcher.find_jump_forward_string()
    except UnicodeDecodeError:
        return None


class ForcedDrafts:
    """Per-process forced-draft state: the encoder and its cache, this step's host table, the previous step's picked
    rows on the device, and the counters. ``width`` is the table's columns (tokens kept per node). The table is
    ``[rows, 1 + bonus_keys, width, 1 + ALTERNATIVES]``: per node, slot 0 holds the node's own forced continuation
    and slots 1.. the continuations keyed by a bonus token (below); in each, at ``[..., 0]`` the tokens (the first is
    the one the next step's root must equal), after them each position's alternatives: the spellings a following
    character merged a tail token into (:func:`tokenize_forced`), then its :func:`prefix_alternatives` (-1 padded;
    the latter none without ``decode``). ``draft_tail``: the forced text's tail that could merge with what follows is
    drafted too (the verify keeps it where the target writes it so, and a draft model that wrote a merge keeps its
    token); off, it is held back.

    Bonus keys: where a node's own continuation is empty (inside a string value, say), what the grammar forces next
    depends on the token the target writes there, the next step's root -- after a value's closing quote, the next
    key. For up to ``bonus_keys`` tokens the grammar allows at that node, the slot holds ``[token, its forced
    continuation...]``; the next step picks the slot whose first token is its root. The tokens tried are those that
    most often began a forced continuation as a root so far (a count per token, learned from the builds' roots:
    ``'",'`` and ``'"'`` in JSON), so the set adapts to the grammars served without naming any. ``bonus_keys=0``:
    slot 0 only."""

    def __init__(self, width: int = 8, require_admission: bool = False, bonus_keys: int = BONUS_KEYS,
                 draft_tail: bool = False) -> None:
        if width < 2:
            raise ValueError(f"forced-draft width must be >= 2 (the root check and one draft), got {width}")
        if bonus_keys < 0:
            raise ValueError(f"forced-draft bonus keys must be >= 0, got {bonus_keys}")
        self.width = width
        self.bonus_keys = bonus_keys
        self.draft_tail = draft_tail  # the forced text's unstable tail is drafted too (see _tokens_of)
        self.encode: Optional[Encoder] = None
        self.decode: Optional[Decoder] = None
        # optional: ``encode`` for many strings in one call (a forced string seen first costs two calls, not ~20)
        self.encode_batch: Optional[BatchEncoder] = None
        # forced string -> (tokens, table rows); keyed (string, True) for a continuation after a bonus token, whose
        # first token gets alternatives too
        self._cache: Dict[Tuple[str, bool], Tuple[Tuple[int, ...], npt.NDArray[np.int32]]] = {}
        # [rows, 1 + bonus_keys, width, 1 + ALTERNATIVES] of the build in progress
        self._host: Optional[npt.NDArray[np.int32]] = None
        self._rows = 0
        self._n = 0  # this build's nodes per request (row // n is the request, row % n == 0 its root)
        self._roots: Sequence[int] = ()  # this build's root tokens, one per request
        self._keys: Tuple[int, ...] = ()  # this build's bonus tokens to try, most frequent first
        self._key_counts: Dict[int, int] = {}  # root token -> builds where it began a forced continuation
        self._table: Optional[torch.Tensor] = None  # this step's table on the device, until after_verify
        # (rids, [bs, 1 + bonus_keys, width, 1 + A], depth)
        self._picked: Optional[Tuple[Tuple[str, ...], torch.Tensor, int]] = None
        # [2, bs * n] bool, until after_verify: the nodes apply() replaced, and of those the ones it changed
        self._written: Optional[torch.Tensor] = None
        # device int64 [4]: proposed, changed, accepted, changed_accepted
        self._counts: Optional[torch.Tensor] = None
        self._mirror = torch.zeros(4, dtype=torch.int64)  # the newest host copy of _counts known to be complete
        # host copies of _counts still possibly in flight, oldest first, each with the event recorded after it
        self._copies: Deque[Tuple[torch.Tensor, Any]] = deque()  # events with query() and synchronize()
        # the stream API of a device (tree_copy.device_streams; tests pass a stand-in): None for the CPU
        self.streams: Callable[[torch.device], Any] = tree_copy.device_streams
        self.recorded_nodes = 0  # host: nodes with a non-empty continuation since start
        self.recorded_keyed = 0  # host: nodes with an empty one but a continuation after some bonus key
        # matcher -> whether its grammar's forced text always ends (forcing_is_bounded), set by admit(); a matcher
        # marked False is never asked for its forced text, nor an unmarked one while require_admission is set
        # (xgrammar's objects are not hashable: keyed by id, each entry dropped when its object is freed)
        self._bounded: _IdMap = _IdMap()
        self._verdicts: _IdMap = _IdMap()  # per grammar object
        self.require_admission = require_admission
        self._pos_cache: Dict[Tuple[int, int, int, str], torch.Tensor] = {}

    # -- counters ------------------------------------------------------------------------------------------------
    @property
    def proposed(self) -> int:
        """Draft tokens replaced by forced tokens since start."""
        return int(self._host_counts()[0])

    @property
    def changed(self) -> int:
        """Of those, tokens that differ from what the draft model had proposed there."""
        return int(self._host_counts()[1])

    @property
    def accepted(self) -> int:
        """Of the replaced tokens, those the target verify accepted."""
        return int(self._host_counts()[2])

    @property
    def changed_accepted(self) -> int:
        """Of the replaced tokens that differ from the draft model's proposal, those the target verify accepted."""
        return int(self._host_counts()[3])

    def _host_counts(self) -> torch.Tensor:
        """The counters of the newest host copy whose event has completed (``query``: no wait); copies still in
        flight are not read."""
        copies = self._copies
        while copies and copies[0][1].query():
            self._mirror = copies.popleft()[0]
        return self._mirror

    def _add(self, counts: torch.Tensor) -> None:
        if self._counts is None or self._counts.device != counts.device:
            self._counts = torch.zeros(4, dtype=torch.int64, device=counts.device)
        self._counts += counts
        api = self.streams(self._counts.device)
        if api is None:  # the CPU: the sum is on the host already
            self._mirror = self._counts.clone()
            return
        host = tree_copy.pinned_host((4,), torch.int64)
        host.copy_(self._counts, non_blocking=True)
        event = api.Event()
        event.record()
        self._copies.append((host, event))
        if len(self._copies) > _COUNT_COPIES:  # bounded: the oldest copy is steps old, its wait is normally free
            self._copies[0][1].synchronize()
            self._host_counts()

    # -- host side: the table, during the mask build -----------------------------------------------------------
    def admit(self, matcher: JumpForward, grammar: object) -> bool:
        """Before a request's first build (the scheduler thread): whether ``matcher``'s grammar (its compiled
        grammar, ``grammar``) has forced text that always ends; only then does :meth:`record` ask for it. Decided once
        per grammar object, then a dictionary lookup per call."""
        ok = self._bounded.get(matcher)
        if ok is None:
            ok = self._verdicts.get(grammar)
            if ok is None:
                ok = forcing_is_bounded(grammar)
                self._verdicts.set(grammar, ok)
            self._bounded.set(matcher, ok)
        return ok

    def continuation(self, matcher: JumpForward) -> Tuple[int, ...]:
        """The tokens the grammar forces after the matcher's state (the tail that could merge with what follows
        only with ``draft_tail``), at most ``width``."""
        entry = self._entry(matcher)
        return entry[0] if entry is not None else ()

    def may_ask(self, matcher: JumpForward) -> bool:
        """Whether ``matcher``'s forced text may be asked for: an encoder is set and its grammar was admitted (or
        admission is not required and it was not refused)."""
        if self.encode is None:
            return False
        ok = self._bounded.get(matcher)
        return not (ok is False or (ok is None and self.require_admission))

    def _entry(self, matcher: JumpForward) -> Optional[Tuple[Tuple[int, ...], npt.NDArray[np.int32]]]:
        """(continuation, its table rows ``[len, 1 + ALTERNATIVES]``), cached per forced string; None if empty."""
        if not self.may_ask(matcher):  # its forced text may never end: not asked
            return None
        return self._tokens_of(_forced_text(matcher) or "", False, self.width)

    def _tokens_of(self, s: str, first: bool,
                   limit: int) -> Optional[Tuple[Tuple[int, ...], npt.NDArray[np.int32]]]:
        """The tokens of the forced string ``s`` (at most ``limit``; with ``draft_tail`` also the tail that could
        merge with what follows, else the stable ones only) and their table rows, cached per string; ``first``: ``s``
        follows a bonus token (its first token gets alternatives). A position's alternatives are the tokens the
        probes merged there (a draft model that writes the merge keeps its token), then its prefix alternatives.
        None if there are no tokens."""
        if not s:
            return None
        entry = self._cache.get((s, first))
        if entry is None:
            assert self.encode is not None
            t = tokenize_forced(self.encode, s, self.encode_batch)
            toks = (t.tokens if self.draft_tail else t.tokens[: t.stable])[:limit]
            rows = np.full((len(toks), 1 + ALTERNATIVES), -1, dtype=np.int32)
            rows[:, 0] = toks
            prefixes: Sequence[Tuple[int, ...]] = ()
            if self.decode is not None and toks:
                prefixes = prefix_alternatives(self.encode, self.decode, s, toks, encode_batch=self.encode_batch,
                                               first=first)
            for i in range(len(toks)):  # neither list holds the position's own token
                alts = list(dict.fromkeys(t.merges[i] + (prefixes[i] if i < len(prefixes) else ())))[:ALTERNATIVES]
                rows[i, 1 : 1 + len(alts)] = alts
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            entry = self._cache[(s, first)] = (toks, rows)
        return entry if entry[0] else None

    def _learn_key(self, token: int) -> None:
        """A root ``token`` began a forced continuation: count it as a bonus-key candidate (bounded: past
        ``_KEYS_MAX`` tokens the rarer half is forgotten and the rest halved, so the set follows the traffic)."""
        counts = self._key_counts
        counts[token] = counts.get(token, 0) + 1
        if len(counts) > _KEYS_MAX:
            keep = sorted(counts.items(), key=lambda kv: -kv[1])[: _KEYS_MAX // 2]
            self._key_counts = {t: max(1, c // 2) for t, c in keep}

    @property
    def keys(self) -> Tuple[int, ...]:
        """This build's bonus keys (set by :meth:`begin`), most frequent first."""
        return self._keys

    def begin(self, rows: int, n: int = 0, roots: Sequence[int] = ()) -> None:
        """A new build of ``rows`` tree nodes (``bs * n``): every row starts empty (-1). ``roots``: each request's
        root token (the bonus keys are learned from the roots whose continuation is not empty; without them, or
        without ``n``, nothing is learned this build)."""
        host = self._host
        if host is None or host.shape[0] < rows:
            host = self._host = np.empty((max(rows, 64), 1 + self.bonus_keys, self.width, 1 + ALTERNATIVES),
                                         dtype=np.int32)
        host[:rows] = -1
        self._rows = rows
        self._n = n
        self._roots = roots
        counts = self._key_counts
        self._keys = tuple(sorted(counts, key=lambda t: (-counts[t], t))[: self.bonus_keys])

    def record(self, matcher: ForcingMatcher, row: int) -> None:
        """The matcher is in the state after node ``row``'s path (a valid, not terminated node); it is left there.
        Writes the node's own continuation, or, where that is empty, the continuation after each bonus key the
        grammar allows there (``accept_token`` then ``rollback(1)``)."""
        if self._host is None or row >= self._rows or not self.may_ask(matcher):
            return
        own = _forced_text(matcher)
        if own is None or own:  # forced bytes that are no whole characters: nothing to draft, no key tried
            if own:
                self._write(row, own, ())
            return
        keyed: List[Tuple[int, str]] = []
        for key in self._keys:
            if not matcher.accept_token(key):
                continue
            try:
                after = _forced_text(matcher)
            finally:
                matcher.rollback(1)
            if after:
                keyed.append((key, after))
        self._write(row, "", keyed)

    def record_found(self, found: Sequence[Tuple[int, int, str]], roots: Sequence[int]) -> None:
        """What the native walk found for this build (``StepResult.forced``: ``(row, key, text)``, ``key`` -1 for a
        node's own text, a row's keyed texts in key order, as :meth:`record` would ask for them), written as
        :meth:`record` writes; ``roots``: each request's root token (for the bonus keys' counts)."""
        self._roots = roots
        for (row, own), group in itertools.groupby(found, key=lambda f: (f[0], f[1] < 0)):
            texts = list(group)
            if own:  # at most one per row: a row with its own text has no keyed ones
                self._write(row, texts[0][2], ())
            else:
                self._write(row, "", [(key, text) for _, key, text in texts])

    def _write(self, row: int, own: str, keyed: Sequence[Tuple[int, str]]) -> None:
        """Row ``row`` of this build: its own forced text ``own`` in slot 0, or (``own`` empty) each bonus key's
        text in the next slot, in order, where it tokenizes to something. A root with its own text counts as a bonus
        key."""
        host = self._host
        if host is None or row >= self._rows:
            return
        if own:
            entry = self._tokens_of(own, False, self.width)
            if entry is not None:
                host[row, 0, : len(entry[0])] = entry[1]
                self.recorded_nodes += 1
                n = self._n
                if n and row % n == 0 and row // n < len(self._roots):
                    self._learn_key(int(self._roots[row // n]))
            return
        slot = 1
        for key, text in keyed:
            if slot > self.bonus_keys:
                break
            entry = self._tokens_of(text, True, self.width - 1)
            if entry is not None:
                host[row, slot, 0, 0] = key
                host[row, slot, 1 : 1 + len(entry[0])] = entry[1]
                slot += 1
        if slot > 1:
            self.recorded_keyed += 1

    def record_tokens(self, tokens: Sequence[int], row: int) -> None:
        """Node ``row``'s forced continuation as the grammar itself gives it in tokens (llguidance's fast-forward
        tokens, computed for the model's tokenizer and already cut where a token could merge with what follows): at
        most ``width`` of them, without alternatives. Unlike :meth:`record` it needs no encoder and no admission
        (llguidance bounds its own search)."""
        if tokens and self._host is not None and row < self._rows:
            k = min(len(tokens), self.width)
            self._host[row, 0, :k, 0] = tokens[:k]
            self.recorded_nodes += 1

    def clear_rows(self, start: int, stop: int) -> None:
        """Forget rows ``[start, stop)`` (a request whose build failed)."""
        if self._host is not None:
            self._host[start:stop] = -1

    def upload(self, device: Device) -> None:
        """After the build: the table to the device (non-blocking), for :meth:`after_verify` of this step."""
        if self._host is None or self._rows == 0:
            self._table = None
            return
        host = torch.from_numpy(self._host[: self._rows])
        # a copy either way: the host buffer is refilled by the next build while this table waits for after_verify
        self._table = tree_copy.host_to_device(host, torch.device("cpu") if device is None else torch.device(device))

    # -- device side -----------------------------------------------------------------------------------------------
    def _positions(self, bs: int, n: int, levels: int, dev: torch.device) -> torch.Tensor:
        """Flat draft positions: ``[bs * levels]`` of nodes 1..levels of each request (a chain), or with
        ``levels == 0`` the ``[bs, 1]`` row starts ``b * n``. Cached per shape and device."""
        key = (bs, n, levels, str(dev))
        t = self._pos_cache.get(key)
        if t is None:
            start = torch.arange(bs, dtype=torch.long).unsqueeze(1) * n
            t = (start + torch.arange(1, levels + 1, dtype=torch.long)).view(-1) if levels else start
            t = tree_copy.host_to_device(t, dev)
            if len(self._pos_cache) > 256:
                self._pos_cache.clear()
            self._pos_cache[key] = t
        return t

    def discard(self) -> None:
        """A verify step that is not a plugin-owned grammar step: the picked rows of the previous one are dropped
        (never applied to a later step)."""
        self._picked = None
        self._written = None

    def after_verify(self, accept_index: torch.Tensor, rids: Sequence[str]) -> None:
        """Right after the verify's acceptance: ``accept_index`` ``[bs, depth + 1]`` holds the accepted nodes' flat
        rows (``b * n + node``), -1 padded. Keeps, per request, the table row of its last accepted node (device
        gather, no sync), and counts the replaced drafts that were accepted."""
        table, self._table = self._table, None
        written, self._written = self._written, None
        bs = len(rids)
        if accept_index.dim() != 2 or accept_index.shape[0] != bs or bs == 0:
            self._picked = None
            return
        valid = accept_index >= 0
        flat = accept_index.to(torch.long).clamp(min=0)
        if written is not None:
            # this step's (proposed, changed) from apply() and the accepted ones of each, in one add
            hits = (written[:, flat.clamp(max=written.shape[1] - 1)] & valid).sum(dim=(1, 2))
            self._add(torch.cat([written.sum(dim=1), hits]))
        if table is None or table.shape[0] == 0:
            self._picked = None
            return
        last = flat.gather(1, (valid.sum(dim=1, keepdim=True) - 1).clamp(min=0)).view(-1)
        self._picked = (tuple(rids), table[last.clamp(max=table.shape[0] - 1)], int(accept_index.shape[1]) - 1)

    def apply(self, draft_token: torch.Tensor, next_token: torch.Tensor, rids: Sequence[str],
              draft_probs_used: bool = False, chain: bool = False) -> None:
        """Step N+1, before the target verify reads its input: replace the top path's drafts with the forced tokens
        of step N's accepted node, where the tree's root equals the first forced token (of the node's own
        continuation or of a bonus-keyed one: the first slot whose first token is the root). ``draft_token`` is the
        verify input's device tensor (flat ``[bs * n]`` or ``[bs, n]``), ``next_token`` its ``[bs, n]`` first-child
        links. ``chain``: the tree is a chain (topk 1: node ``d`` is at depth ``d``), so the top path needs no pointer
        chase. The replacement is a contiguous prefix of the top path; it ends at the first position without a forced
        token, past the tree, or whose draft token is one of that position's prefix alternatives (the draft model's
        own tokenization of the forced text is kept from there on). Consumes the previous step's rows (at most
        once). A fixed number of device ops per step, no host sync."""
        picked, self._picked = self._picked, None
        self._written = None
        bs = len(rids)
        if picked is None or draft_probs_used or bs == 0 or next_token.dim() != 2 or next_token.shape[0] != bs:
            return
        prev_rids, rows, depth = picked
        n = next_token.shape[1]
        levels = min(depth, n - 1, self.width - 1)
        if levels < 1:
            return
        dev = draft_token.device
        if tuple(rids) == prev_rids:  # steady decoding: the same batch in the same order
            slots = rows
        else:
            where = {rid: i for i, rid in enumerate(prev_rids)}
            row_map: List[int] = [where.get(rid, -1) for rid in rids]
            if all(i < 0 for i in row_map):
                return
            idx = tree_copy.host_to_device(torch.tensor(row_map, dtype=torch.long), dev)
            slots = torch.where((idx >= 0).view(-1, 1, 1, 1), rows.index_select(0, idx.clamp(min=0)), -1)
        flat = draft_token.view(-1)
        root = flat.view(bs, n)[:, :1]
        # the slot whose first token is the root (argmax: the first match; none matches -> slot 0, checked below)
        pick = (slots[:, :, 0, 0] == root.to(slots.dtype)).to(torch.int8).argmax(dim=1)
        forced = slots.gather(1, pick.view(bs, 1, 1, 1).expand(bs, 1, *slots.shape[2:])).squeeze(1)
        toks = forced[:, 1 : levels + 1, 0].to(flat.dtype)
        ok = (forced[:, :1, 0] == root) & (toks >= 0)
        if chain:
            pos = self._positions(bs, n, levels, dev)
        else:
            # the first-child path below the root: node ids per level, -1 past the tree's end
            nxt = next_token.to(torch.long)
            path = []
            node = torch.zeros((bs, 1), dtype=torch.long, device=dev)
            for _ in range(levels):
                node = torch.where(node >= 0, nxt.gather(1, node.clamp(min=0)), node)
                path.append(node)
            nodes = torch.cat(path, dim=1)  # [bs, levels]
            ok = ok & (nodes >= 0)
            pos = (self._positions(bs, n, 0, dev) + nodes.clamp(min=0)).view(-1)
        old = flat[pos]
        alts = forced[:, 1 : levels + 1, 1:].to(flat.dtype)  # [bs, levels, ALTERNATIVES]
        own = (old.view(bs, levels, 1) == alts).any(dim=2) & (old.view(bs, levels) != toks)
        ok = (ok & ~own).cumprod(dim=1).bool()  # a contiguous prefix of the top path only
        okf = ok.view(-1)
        new = toks.reshape(-1)
        flat[pos] = torch.where(okf, new, old)  # positions past the tree's end point at the root: written unchanged
        written = torch.zeros((2, bs * n), dtype=torch.bool, device=dev)
        written[:, pos] = torch.stack([okf, okf & (old != new)])  # the root's repeats are all False
        self._written = written
