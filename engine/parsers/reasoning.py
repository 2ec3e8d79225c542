"""Reasoning in ``<think>`` ... ``</think>`` (vLLM's ``qwen3`` and ``deepseek_r1`` parsers).

A reply opens its reasoning with ``<think>`` at its very start (leading whitespace aside), or is
already inside it when the prompt ended with the open tag (Qwen3-Thinking, DeepSeek-R1 and V3.1
in thinking mode put ``<think>`` into the generation prompt: ``starts_inside``). Reasoning ends at
``</think>``; the newlines right after it are dropped; everything after is content. A reply cut
inside its reasoning is all reasoning.
"""

from __future__ import annotations

from engine.parsers.base import Event, partial_suffix

THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str, start: str = THINK_START) -> bool:
    """Whether the rendered prompt leaves the reply inside a reasoning block."""
    return prompt_text.rstrip().endswith(start)


class ThinkParser:
    """Splits ``<think>`` reasoning from content; ``push``/``finish`` return events."""

    def __init__(self, starts_inside: bool = False, start: str = THINK_START, end: str = THINK_END) -> None:
        self.start, self.end = start, end
        self.state = "inside" if starts_inside else "opening"  # opening, inside, after, content
        self.buf = ""

    def push(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return [e for e in events if e[1]]

    def finish(self, truncated: bool = False) -> list[Event]:
        events = self.push("")
        rest, self.buf = self.buf, ""
        if self.state == "inside":
            events.append(("reasoning", rest))
        elif self.state != "after":
            events.append(("content", rest))
        return [e for e in events if e[1]]

    def _step(self, events: list[Event]) -> bool:
        if self.state == "opening":
            head = self.buf.lstrip()
            if head.startswith(self.start):
                self.buf, self.state = head[len(self.start):], "inside"
                return True
            if self.start.startswith(head):  # empty, or a prefix of the open tag: wait
                return False
            self.state = "content"
            return True
        if self.state == "inside":
            i = self.buf.find(self.end)
            if i >= 0:
                events.append(("reasoning", self.buf[:i]))
                self.buf, self.state = self.buf[i + len(self.end):], "after"
                return True
            keep = partial_suffix(self.buf, (self.end,))
            events.append(("reasoning", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        if self.state == "after":
            self.buf = self.buf.lstrip("\n")
            if not self.buf:
                return False
            self.state = "content"
            return True
        events.append(("content", self.buf))
        self.buf = ""
        return False
