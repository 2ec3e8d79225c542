"""Message conversion every surface shares: request messages to the chat template's dicts
(``message_dicts``), parsed tool calls back to OpenAI's dicts (``tool_call_dicts``), and the
template switches a request may set (``template_kwargs``)."""

from __future__ import annotations

from typing import Any

from engine.chat import ToolCall, content_text

from agentrt.core.errors import bad_request
from agentrt.protocol import ChatMessage

# what the server itself passes to the chat template: a request's chat_template_kwargs may not set them
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as the plain dicts the chat template renders."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if m.role == "developer":
            d["role"] = "system"
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
        try:
            content_text(m.content)
        except ValueError as exc:
            raise bad_request(f"messages[{i}].content: {exc}", param=f"messages.{i}.content") from None
        d.setdefault("content", None)
        out.append(d)
    return out


def template_kwargs(kwargs: dict[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any] | None:
    """A request's ``chat_template_kwargs``: 400 for names the server itself passes to the template."""
    clash = sorted(set(kwargs or {}) & set(_TEMPLATE_VARIABLES))
    if clash:
        raise bad_request(f"{param} may not set {', '.join(clash)} (the server passes them to the chat template)",
                          param=param)
    return kwargs or None


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]
