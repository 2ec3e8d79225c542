"""Closing a constrained output: the short text and tokens that complete it from a matcher state.

Budget-aware closing (``XGrammarConstraint.fit_budget``) needs, at every step, a valid
way to end the output from the current state and its length in tokens. This module
finds one on a fork of the matcher, so the request's own matcher never moves:

1. **Text** (:func:`closing_text`). Repeat until the grammar may end (``is_completed``):
   take xgrammar's jump-forward string (text the grammar forces, e.g. ``, "city": "``
   after a value when ``city`` is the next required property) if there is one; else
   choose one character by a fixed preference, checked by the matcher itself. Where a
   free string is open (``~`` is allowed: in compact JSON it appears only inside
   strings) the first of ``"`` (a JSON string), ``</parameter>`` (a Qwen3-Coder XML value)
   and ``</arg_value>`` (a GLM one) that the matcher accepts *and* that leaves the string
   ends it, else a filler letter; elsewhere
   it is ``}`` ``]`` (close), ``,`` (end a number, go on to a required property),
   ``0`` (the shortest number), ``"`` (a string, closed next), other digits, then any
   printable ASCII character and finally any byte (the rest of a multi-byte character).
   Where the printable fallback decides (``null`` / ``true`` / ``false`` / ``[`` / ``{``,
   a tool name, an enum value), each accepted character is tried (up to six of them) and
   the one whose greedy completion is shortest is taken. Every choice is one the matcher
   accepted, so the text is always a valid continuation. A grammar
   whose shortest completion is longer than ``max_bytes`` (``minItems: 1000``) gives
   None.
2. **Tokens** (:func:`closing_tokens`): the engine tokenizer's encoding of that text
   (a valid tokenization, as xgrammar matches bytes), or failing that one token per
   byte; either is verified token by token on another fork, which must end completed.

The plan is a short valid completion, not a proven shortest one: the greedy choice
may take a longer branch of an ``anyOf``. It is exact where it matters: the engine
only ever commits to a plan that was verified and fits the budget.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Callable, Sequence

import xgrammar as xgr

MAX_CLOSING_BYTES = 4096  # give up beyond this: the grammar cannot be closed within any sane budget

_IN_STRING_PROBE = "~"
_STRING_CLOSERS = ('"', "</parameter>", "</arg_value>")  # JSON, qwen_xml and glm_xml values
_STRING_FILLERS = ("a", "0", "A")
_STRUCTURAL_PREFERENCE = ("}", "]", ",", "0", '"', "1", "2", "3", "4", "5", "6", "7", "8", "9", "-")
_ANY_ASCII = tuple(string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation + " ")
_ANY_BYTE = tuple(bytes([b]) for b in range(256))
_MAX_BRANCHES = 6


@dataclass(frozen=True)
class TokenCodec:
    """What the closer needs of the tokenizer: ``encode(text) -> ids`` (no special tokens) and,
    for the byte fallback, the token id of each single byte (missing bytes: no fallback)."""

    encode: Callable[[str], list[int]]
    byte_tokens: dict[int, int]


def _probe(m: xgr.GrammarMatcher, candidates: Sequence[str | bytes]) -> str | bytes | None:
    """The first candidate the matcher accepts (and has now accepted), or None."""
    for c in candidates:
        if m.accept_string(c):
            return c
    return None


def _in_free_string(m: xgr.GrammarMatcher) -> bool:
    if m.accept_string(_IN_STRING_PROBE):
        m.rollback(1)
        return True
    return False


def _leave_string(m: xgr.GrammarMatcher) -> str | None:
    """The first of ``_STRING_CLOSERS`` after which no free string is open (accepted), or None: in
    an XML value ``"`` is text, so acceptance alone does not say the string ended."""
    for closer in _STRING_CLOSERS:
        fork = m.fork()
        if fork.accept_string(closer) and not _in_free_string(fork):
            m.accept_string(closer)
            return closer
    return None


def _shortest_branch(m: xgr.GrammarMatcher, max_bytes: int) -> str | None:
    """Of the printable characters ``m`` accepts, the one whose greedy closing is shortest (a tool
    name, an enum value: ``celsius`` rather than ``fahrenheit``); accepted, or None. Past
    ``_MAX_BRANCHES`` candidates (a character class such as ``[A-Z]``, whose members close
    alike) the first is taken, which keeps the cost linear."""
    accepted = []
    for c in _ANY_ASCII:
        if m.accept_string(c):
            m.rollback(1)
            accepted.append(c)
    if len(accepted) > _MAX_BRANCHES:
        accepted = accepted[:1]
    best, best_len = None, max_bytes + 1
    for c in accepted:
        fork = m.fork()
        fork.accept_string(c)
        rest = _close(fork, max_bytes, branch=False) if len(accepted) > 1 else b""
        if rest is not None and len(rest) < best_len:
            best, best_len = c, len(rest)
    if best is not None:
        m.accept_string(best)
    return best


def _choose(m: xgr.GrammarMatcher, max_bytes: int, branch: bool) -> bytes | None:
    """Accept one preferred character (see the module docstring) and return its bytes."""
    if _in_free_string(m):
        c = _leave_string(m) or _probe(m, _STRING_FILLERS)
    else:
        c = _probe(m, _STRUCTURAL_PREFERENCE)
    if c is None:
        c = _shortest_branch(m, max_bytes) if branch else _probe(m, _ANY_ASCII)
    c = c or _probe(m, _ANY_BYTE)
    if c is None:
        return None
    return c.encode() if isinstance(c, str) else c


def _close(m: xgr.GrammarMatcher, max_bytes: int, branch: bool) -> bytes | None:
    """Advance ``m`` itself to a state where the grammar may end; the bytes it took."""
    out = bytearray()
    while not m.is_completed():
        if len(out) > max_bytes:
            return None
        forced = m.find_jump_forward_string()
        if forced and m.accept_string(forced):
            out += forced.encode()
            continue
        chosen = _choose(m, max_bytes, branch)
        if chosen is None:
            return None
        out += chosen
    return bytes(out)


def closing_text(matcher: xgr.GrammarMatcher, max_bytes: int = MAX_CLOSING_BYTES) -> bytes | None:
    """Bytes that take ``matcher``'s state to one where the grammar may end (b"" if it already
    may), found on a fork; None past ``max_bytes`` or if no byte is accepted. Where only the
    printable fallback decides (a name, an enum value), every candidate is tried and the one
    with the shortest greedy completion taken."""
    return _close(matcher.fork(), max_bytes, branch=True)


def completes(matcher: xgr.GrammarMatcher, ids: Sequence[int]) -> bool:
    """Whether a fork of ``matcher`` accepts ``ids`` and may end after them."""
    m = matcher.fork()
    return all(m.accept_token(t) for t in ids) and m.is_completed()


def closing_tokens(matcher: xgr.GrammarMatcher, codec: TokenCodec,
                   max_bytes: int = MAX_CLOSING_BYTES) -> list[int] | None:
    """Token ids that complete ``matcher``'s output (``[]`` if it may end now), verified on a
    fork; None when no closing text was found or neither tokenization of it is accepted."""
    text = closing_text(matcher, max_bytes)
    if text is None:
        return None
    if not text:
        return []
    try:
        ids = codec.encode(text.decode("utf-8"))
        if completes(matcher, ids):
            return ids
    except UnicodeDecodeError:  # the state is inside a multi-byte character: bytes only
        pass
    if all(b in codec.byte_tokens for b in text):
        ids = [codec.byte_tokens[b] for b in text]
        if completes(matcher, ids):
            return ids
    return None
