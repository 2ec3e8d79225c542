"""Chat prompts with tools, and parsing tool calls out of model text.

Tool calls use the Hermes / Qwen convention, which most open chat models were
trained on or follow when told::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

When the model's chat template renders tools itself (it reads ``tools`` or
``tool_calls``) the messages go to it as transformers passes them: tools, calls with
their arguments as objects, tool results with their ids, earlier reasoning; the model
then calls tools in its family's own format (parsed by engine/parsers). Otherwise
(SmolLM2's plain ChatML template) the tool signatures are added to the system message
with instructions, assistant tool calls are written back in the format above and tool
results are wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from typing import Any

from engine.parsers import ParsedOutput, ToolCall
from engine.parsers.base import CallScanner
from engine.parsers.formats import HERMES
from engine.tokenizer import Tokenizer

__all__ = ["ToolCall", "content_text", "encode_chat", "format_tool_call", "parse_tool_calls", "render_chat_prompt",
           "template_handles_tools"]

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


def template_handles_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads ``tools`` or ``tool_calls``)."""
    return bool(template) and ("tools" in template or "tool_calls" in template)


_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the object templates expect (transformers' convention); a string that
    is not a JSON object is passed as it is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def native_message(m: dict[str, Any]) -> dict[str, Any]:
    """One message as a tool-aware template reads it, the way transformers passes it: keys that are
    None dropped (an assistant's null content is ""), tool-call arguments as objects, earlier reasoning under ``reasoning_content`` and
    ``thinking`` (gpt-oss reads the latter)."""
    out = {k: v for k, v in m.items() if v is not None}
    if "content" in out or m.get("role") == "assistant":  # null beside calls: "" (Devstral's template reads it)
        out["content"] = content_text(out.get("content"))
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"],
                                                "arguments": _arguments_object(c["function"].get("arguments", {}))}}
                             for c in out["tool_calls"]]
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        out.pop("reasoning", None)
    return out


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
    """Messages as plain ``{"role", "content"}`` dicts for a template that knows nothing of tools:
    the tool signatures in the system message (the Hermes preamble), calls written back in Hermes
    format, results in ``<tool_response>`` tags, earlier reasoning dropped."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            calls = [format_tool_call(c["function"]["name"], c["function"].get("arguments", "{}"))
                     for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + calls)
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools:
        sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = _TOOLS_PREAMBLE.format(tools=sigs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def render_chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                       add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text: through the template as it was written when it handles tools (the same text
    as transformers' ``apply_chat_template``), else with the Hermes preamble. ``template_kwargs``:
    the template's own switches (``enable_thinking``, ``reasoning_effort``...), vLLM's
    ``chat_template_kwargs``."""
    extra = dict(template_kwargs or {})
    if template_handles_tools(tokenizer.chat_template):
        msgs = [native_message(m) for m in messages]
        if tools:
            extra["tools"] = tools
    else:
        msgs = hermes_messages(messages, tools)
    return tokenizer.render_chat(msgs, add_generation_prompt=add_generation_prompt, **extra)


def encode_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    return tokenizer.encode(render_chat_prompt(tokenizer, messages, tools, add_generation_prompt, template_kwargs))


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split Hermes-format model text into (content, tool calls): the streaming parser fed the whole
    text at once (engine/parsers). Malformed closed blocks stay in the content; an unclosed block at
    the end is a call if it is complete JSON, else it is dropped (a partial call is never content)."""
    scanner = CallScanner(HERMES)
    out = ParsedOutput().add(scanner.push(text)).add(scanner.finish())
    return (out.content.strip() if out.tool_calls else out.content), out.tool_calls
