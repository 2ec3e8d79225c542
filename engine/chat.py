"""Chat prompts with tools, and parsing tool calls out of model text.

Tool calls use the Hermes / Qwen convention, which most open chat models were
trained on or follow when told::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

When the model's chat template renders ``tools`` itself we pass them through;
otherwise (SmolLM2's plain ChatML template) the tool signatures are added to the
system message with instructions, assistant tool calls are written back in the
format above and tool results are wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from engine.tokenizer import Tokenizer

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_TOOLS_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures "
    "within <tools></tools> XML tags. You may call one or more functions to assist with "
    "the user query. Don't make assumptions about what values to plug into functions. "
    "Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def content_text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError("message content parts must be {'type': 'text', 'text': str}; "
                                 "other part types are not supported by this model")
        return "".join(parts)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def format_tool_call(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # keep the string: the model sees what was sent
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def _template_handles_tools(tokenizer: Tokenizer) -> bool:
    return bool(tokenizer.chat_template) and "tools" in tokenizer.chat_template


def normalize_messages(messages: list[dict[str, Any]], tools: list[dict] | None,
                       template_handles_tools: bool) -> list[dict[str, Any]]:
    """Messages as plain ``{"role", "content"}`` dicts the template can render."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = [format_tool_call(c["function"]["name"], c["function"].get("arguments", "{}"))
                     for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + calls)
        elif role == "tool" and not template_handles_tools:
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools and not template_handles_tools:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = _TOOLS_PREAMBLE.format(tools=sigs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                       tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    handles = _template_handles_tools(tokenizer)
    msgs = normalize_messages(messages, tools, handles)
    extra = {"tools": tools} if (tools and handles) else {}
    return tokenizer.render_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
    return tokenizer.encode(render_chat_prompt(tokenizer, messages, tools, add_generation_prompt))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI returns it


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args_text = args
    else:
        args_text = json.dumps(args, ensure_ascii=False)
    return ToolCall(id=new_tool_call_id(), name=obj["name"], arguments=args_text)


def _close_block(text: str, body_start: int) -> tuple[ToolCall | None, int]:
    """The tool call whose body starts at ``body_start`` and the index of the end tag that closes it.

    A call's JSON may hold the end tag itself inside a string (a model quoting its own format), so
    the block ends at the first end tag before which the body parses as a call; if none does, it
    ends at the first end tag and is malformed (None). ``-1``: no end tag follows."""
    first = end = text.find(TOOL_CALL_END, body_start)
    while end >= 0:
        call = _parse_block(text[body_start:end].strip())
        if call is not None:
            return call, end
        end = text.find(TOOL_CALL_END, end + len(TOOL_CALL_END))
    return None, first


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model text into (content, tool calls). Malformed closed blocks stay in the content; an
    unclosed block at the end is a call if it is complete JSON, else it is dropped (a partial call,
    cut off by ``max_tokens``, is never content)."""
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            content.append(text[pos:])
            break
        body_start = start + len(TOOL_CALL_START)
        call, end = _close_block(text, body_start)
        if end < 0:  # unclosed: a call if its JSON is complete, else a partial call (dropped)
            call = _parse_block(text[body_start:].strip())
            content.append(text[pos:start])
            if call is not None:
                calls.append(call)
            break
        if call is None:
            content.append(text[pos:end + len(TOOL_CALL_END)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len(TOOL_CALL_END)
    return "".join(content).strip() if calls else "".join(content), calls


class StreamingToolCallParser:
    """Incremental version of :func:`parse_tool_calls` for streamed text.

    ``push(delta)`` returns ``(content_delta, finished_tool_calls)``. Text that might
    be the start of a ``<tool_call>`` tag is held back until it is decided; a tool
    call is emitted once an end tag arrives before which its JSON is complete (an end
    tag inside one of its strings does not end it); a block no end tag has closed
    validly yet is held. ``finish()`` settles the rest as :func:`parse_tool_calls`
    does: a malformed closed block is content, an unterminated block is a call if it
    is complete JSON, else dropped, and so is a held-back start of the tag two
    characters or longer (``<t``, ``<tool_call``): a partial tool call, cut off by
    ``max_tokens``, never reaches the client as content. A lone ``<`` is text.
    """

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self._scanned = 0  # in a call: end tags before this offset of ``buf`` did not close it validly

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buf.find(TOOL_CALL_END, self._scanned)
                if end < 0:
                    self._scanned = max(self._scanned, len(self.buf) - len(TOOL_CALL_END) + 1)
                    break
                call = _parse_block(self.buf[:end].strip())
                if call is None:  # an end tag inside the JSON, or a malformed block: wait for more
                    self._scanned = end + len(TOOL_CALL_END)
                    continue
                calls.append(call)
                self.buf = self.buf[end + len(TOOL_CALL_END):]
                self.in_call, self._scanned = False, 0
            else:
                start = self.buf.find(TOOL_CALL_START)
                if start >= 0:
                    content.append(self.buf[:start])
                    self.buf = self.buf[start + len(TOOL_CALL_START):]
                    self.in_call, self._scanned = True, 0
                    continue
                keep = _partial_tag_suffix(self.buf, TOOL_CALL_START)
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call, self._scanned = False, 0
            return parse_tool_calls(TOOL_CALL_START + rest)
        if len(rest) >= 2 and _partial_tag_suffix(rest, TOOL_CALL_START) == len(rest):
            return "", []
        return rest, []


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
