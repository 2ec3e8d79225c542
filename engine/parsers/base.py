"""What every output parser shares: the parsed tool call, events, and the streaming call scanner.

A parser turns model text into a sequence of events: ``("content", text)``, ``("reasoning", text)``
and ``("call", ToolCall)``. It is fed text in pieces (``push``) and settled at the end (``finish``);
the whole-text result is one ``push`` and a ``finish``, so streamed and whole-text parsing agree
by construction, whatever the chunking.

:class:`CallScanner` is the one streaming scanner behind the tool-call formats that mark a call
with delimiters (:class:`CallFormat`): it holds back text that might be the start of a marker,
and ends a call at the first end marker before which the call's body parses, so arguments may
hold the format's own delimiters. A call cut by ``max_tokens`` (``finish(truncated=True)``) is
never a call: its text is dropped, like a call that never closed and does not parse.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable, Union

# (name, arguments as a JSON string, id or None for a fresh one)
ParsedCall = tuple[str, str, Union[str, None]]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI returns it


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


Event = tuple[str, Union[str, ToolCall]]  # ("content" | "reasoning", text) or ("call", ToolCall)


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for tag in markers:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class CallFormat:
    """How one family marks its tool calls.

    ``starts``: markers that open a call (``keep``: those that are also the start of the body,
    as ``{"name"`` is for Llama's bare JSON); ``end``: the marker that closes one, or None when the
    body closes itself (``close(body)``: the length of a complete body at its start, None while
    incomplete); ``parse(body)``: the calls in a body, None if it is not one (yet);
    ``noise``: section markers dropped wherever they appear; ``separators``: characters skipped
    between consecutive calls."""

    starts: tuple[str, ...]
    end: str | None
    parse: Callable[[str], list[ParsedCall] | None]
    close: Callable[[str], int | None] | None = None
    keep: tuple[str, ...] = ()
    noise: tuple[str, ...] = ()
    separators: str = ""


class CallScanner:
    """Streaming tool-call scanner for one :class:`CallFormat`; ``push``/``finish`` return events."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.marker: str | None = None  # the start marker of the call being read (None: in content)
        self._scanned = 0               # in a call: end markers before this offset did not close it
        self._after_call = False
        self._markers = fmt.starts + fmt.noise

    def push(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self, truncated: bool = False) -> list[Event]:
        events = self.push("")
        if self.marker is not None:
            events += self._settle_open_call(truncated)
        rest, self.buf = self.buf, ""
        if rest and not (len(rest) >= 2 and partial_suffix(rest, self._markers) == len(rest)):
            events.append(("content", rest))
        return [e for e in events if e[1] != ""]

    # ------------------------------------------------------------ internals

    def _step(self, events: list[Event]) -> bool:
        """One move of the scanner; False when it needs more text."""
        if self.marker is not None:
            return self._read_call(events)
        if self._after_call:
            stripped = self.buf.lstrip(self.fmt.separators)
            if not stripped:
                self.buf = ""
                return False
            self.buf, self._after_call = stripped, False
        found = [(i, m) for m in self._markers if (i := self.buf.find(m)) >= 0]
        if found:
            i, m = min(found, key=lambda f: (f[0], -len(f[1])))
            events.append(("content", self.buf[:i]))
            self.buf = self.buf[i + (0 if m in self.fmt.keep else len(m)):]
            if m in self.fmt.starts:
                self.marker, self._scanned = m, 0
            return True
        keep = partial_suffix(self.buf, self._markers)
        events.append(("content", self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _read_call(self, events: list[Event]) -> bool:
        fmt = self.fmt
        if fmt.end is None:
            n = fmt.close(self.buf)
            if n is None:
                return False
            calls = fmt.parse(self.buf[:n])
            if calls is None:  # a complete body that is not a call: text
                events.append(("content", self._shown_marker() + self.buf[:n]))
            else:
                events.extend(("call", _tool_call(c)) for c in calls)
                self._after_call = True
            self.buf, self.marker = self.buf[n:], None
            return True
        end = self.buf.find(fmt.end, self._scanned)
        while end >= 0:
            calls = fmt.parse(self.buf[:end])
            if calls is not None:
                events.extend(("call", _tool_call(c)) for c in calls)
                self.buf, self.marker = self.buf[end + len(fmt.end):], None
                self._after_call = True
                return True
            end = self.buf.find(fmt.end, end + len(fmt.end))
        self._scanned = max(self._scanned, len(self.buf) - len(fmt.end) + 1)
        return False

    def _shown_marker(self) -> str:
        return "" if self.marker in self.fmt.keep else self.marker

    def _settle_open_call(self, truncated: bool) -> list[Event]:
        """At the end: a closed block that never parsed is text (scanning resumes after it); an
        unclosed one is a call if its body parses and it was not cut by max_tokens, else dropped."""
        fmt, body = self.fmt, self.buf
        first = body.find(fmt.end) if fmt.end else -1
        if first >= 0:
            events: list[Event] = [("content", self._shown_marker() + body[:first + len(fmt.end)])]
            self.buf, self.marker = body[first + len(fmt.end):], None
            events += self.push("")
            if self.marker is not None:
                events += self._settle_open_call(truncated)
            return events
        self.buf, self.marker = "", None
        calls = None if truncated or fmt.end is None else fmt.parse(body)
        return [("call", _tool_call(c)) for c in calls or []]


def _tool_call(parsed: ParsedCall) -> ToolCall:
    name, arguments, call_id = parsed
    return ToolCall(id=call_id or new_tool_call_id(), name=name, arguments=arguments)
