"""The Responses API's output: items built from generation deltas, and the stream events announcing them.

Reasoning becomes a ``reasoning`` item (its text in a ``reasoning_text`` part, streamed as
``response.reasoning_text.delta`` events), text ``message`` items, tool calls ``function_call`` items,
in the order the model wrote them.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from engine.tokenizer import ToolCall

from agentrt.core.generation import Delta


def hex_id() -> str:
    return uuid.uuid4().hex


def content_part(kind: str, text: str) -> dict[str, Any]:
    """A content part of a stored message item."""
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": kind, "text": text}


class OutputBuilder:
    """Builds a response's output items from generation deltas, and the stream events that announce
    them. Text becomes message items (text between tool calls: one item each; whitespace-only text
    next to a tool call makes none), tool calls ``function_call`` items. Events are queued and
    taken with :meth:`take`; they lack ``sequence_number``, which the stream adds."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._queue: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message item text goes into
        self._thinking: dict[str, Any] | None = None  # the reasoning item reasoning goes into
        self._pending = ""  # whitespace not yet in an item
        self.finished = False

    def take(self) -> list[dict[str, Any]]:
        events, self._queue = self._queue, []
        return events

    def feed(self, delta: Delta) -> None:
        if delta.reasoning:
            self._reason(delta.reasoning)
        if delta.content:
            self._close_reasoning("completed")
            self._text(delta.content)
        for call in delta.tool_calls:
            self._close_reasoning("completed")
            self._close_message("completed")
            self._pending = ""
            self._call(call)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the output (``status``: completed or incomplete); returns the items. Idempotent."""
        if not self.finished:
            self.finished = True
            self._close_reasoning(status)
            if not self.items:  # every response says something, if only an empty text
                self._open_message(self._pending)
                self._pending = ""
            self._close_message(status)
        return copy.deepcopy(self.items)

    def _reason(self, text: str) -> None:
        item = self._thinking
        if item is None:
            self._close_message("completed")
            item = {"id": "rs_" + hex_id(), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
            self.items.append(item)
            self._thinking = item
            self._queue.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                                "item": {**copy.deepcopy(item), "content": []}})
        item["content"][0]["text"] += text
        self._queue.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                            "output_index": self.items.index(item), "content_index": 0, "delta": text})

    def _close_reasoning(self, status: str) -> None:
        item, self._thinking = self._thinking, None
        if item is not None:
            item["status"] = status
            self._queue.extend(reasoning_done_events(item, self.items.index(item)))

    def _text(self, text: str) -> None:
        if self._open is None:
            text, self._pending = self._pending + text, ""
            if not text.strip():
                self._pending = text
                return
            self._open_message(text)
        else:
            self._add_text(text)

    def _open_message(self, text: str) -> None:
        item = {"id": "msg_" + hex_id(), "type": "message", "role": "assistant", "status": "in_progress",
                "content": []}
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        self._queue.append({"type": "response.output_item.added", "output_index": index, "item": copy.deepcopy(item)})
        text_part = content_part("output_text", "")
        item["content"].append(text_part)
        self._queue.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "part": copy.deepcopy(text_part)})
        if text:
            self._add_text(text)

    def _add_text(self, text: str) -> None:
        item = self._open
        item["content"][0]["text"] += text
        self._queue.append({"type": "response.output_text.delta", "item_id": item["id"],
                            "output_index": len(self.items) - 1, "content_index": 0, "delta": text, "logprobs": []})

    def _close_message(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        self._queue.extend(message_done_events(item, len(self.items) - 1))

    def _call(self, call: ToolCall) -> None:
        item = {"id": "fc_" + hex_id(), "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": call.arguments}
        self.items.append(item)
        self._queue.extend(function_call_events(item, len(self.items) - 1))


def message_done_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    part = item["content"][0]
    base = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [{"type": "response.output_text.done", **base, "text": part["text"], "logprobs": []},
            {"type": "response.content_part.done", **base, "part": copy.deepcopy(part)},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


def reasoning_done_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
             "content_index": 0, "text": item["content"][0]["text"]},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


def function_call_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """A finished function call, announced: added (no arguments yet), its arguments, done."""
    base = {"item_id": item["id"], "output_index": index}
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **base, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **base, "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


def replay_events(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The item events of a recorded response, as its stream sent them (each text in one delta)."""
    events: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        if item["type"] == "function_call":
            events.extend(function_call_events(item, index))
            continue
        if item["type"] == "reasoning":
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "status": "in_progress", "content": []}},
                       {"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "delta": item["content"][0]["text"]},
                       *reasoning_done_events(item, index)]
            continue
        part = item["content"][0]
        base = {"item_id": item["id"], "output_index": index, "content_index": 0}
        events += [{"type": "response.output_item.added", "output_index": index,
                    "item": {**item, "status": "in_progress", "content": []}},
                   {"type": "response.content_part.added", **base, "part": {**part, "text": ""}},
                   {"type": "response.output_text.delta", **base, "delta": part["text"], "logprobs": []},
                   *message_done_events(item, index)]
    return events
