"""gpt-oss's harmony format (vLLM's ``openai`` tool parser and ``gpt_oss`` reasoning parser in one).

A reply is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

``analysis`` bodies are reasoning; a body addressed ``to=functions.NAME`` is a call of NAME with
that body as its JSON arguments (it ends at the first end marker before which it parses, so the
arguments may hold the markers); other bodies (``final``, a ``commentary`` preamble) are content.
Text before any header is content. A call whose body never closed is a call only if it parses and
the reply was not cut by ``max_tokens``.
"""

from __future__ import annotations

import json
import re

from engine.parsers.base import Event, ToolCall, new_tool_call_id, partial_suffix

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
HEADER_MARKERS = ("<|start|>", "<|channel|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _parses(body: str) -> bool:
    try:
        return isinstance(json.loads(body), dict)
    except json.JSONDecodeError:
        return False


class HarmonyParser:
    """Streaming harmony parser; ``push``/``finish`` return events."""

    def __init__(self) -> None:
        self.buf = ""
        self.kind: str | None = None  # in a body: "reasoning", "content" or "call"; None: between messages
        self.name = ""
        self._scanned = 0

    def push(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return [e for e in events if e[1] != ""]

    def finish(self, truncated: bool = False) -> list[Event]:
        events = self.push("")
        rest, self.buf = self.buf, ""
        if self.kind == "call":
            if not truncated and _parses(rest):
                events.append(("call", ToolCall(new_tool_call_id(), self.name, rest.strip())))
        elif self.kind is not None:
            events.append((self.kind, rest))
        elif rest and not any(m in rest for m in HEADER_MARKERS) and partial_suffix(rest, HEADER_MARKERS) < 2:
            events.append(("content", _unmarked(rest)))
        self.kind = None
        return [e for e in events if e[1] != ""]

    def _step(self, events: list[Event]) -> bool:
        if self.kind is None:
            return self._header(events)
        if self.kind == "call":
            return self._call_body(events)
        found = [(i, m) for m in ENDS if (i := self.buf.find(m)) >= 0]
        if found:
            i, m = min(found)
            events.append((self.kind, self.buf[:i]))
            self.buf, self.kind = self.buf[i + len(m):], None
            return True
        keep = partial_suffix(self.buf, ENDS)
        events.append((self.kind, self.buf[:len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _header(self, events: list[Event]) -> bool:
        starts = [i for m in HEADER_MARKERS if (i := self.buf.find(m)) >= 0]
        if not starts:  # text outside any message (a template that opened the channel itself): content
            keep = partial_suffix(self.buf, HEADER_MARKERS + ENDS)
            events.append(("content", _unmarked(self.buf[:len(self.buf) - keep])))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        first = min(starts)
        events.append(("content", _unmarked(self.buf[:first])))
        self.buf = self.buf[first:]
        i = self.buf.find(MESSAGE)
        if i < 0:
            return False
        header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        if recipient:
            self.kind, self.name, self._scanned = "call", recipient.group(1), 0
        else:
            self.kind = "reasoning" if "<|channel|>analysis" in header else "content"
        return True

    def _call_body(self, events: list[Event]) -> bool:
        ends = sorted((i, m) for m in ENDS for i in _all(self.buf, m, self._scanned))
        for i, m in ends:
            if _parses(self.buf[:i]):
                events.append(("call", ToolCall(new_tool_call_id(), self.name, self.buf[:i].strip())))
                self.buf, self.kind = self.buf[i + len(m):], None
                return True
        self._scanned = max(self._scanned, len(self.buf) - max(map(len, ENDS)) + 1)
        return False


def _unmarked(text: str) -> str:
    """Text between messages without stray end markers."""
    for m in ENDS:
        text = text.replace(m, "")
    return text


def _all(text: str, sub: str, start: int) -> list[int]:
    out, i = [], text.find(sub, start)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out
