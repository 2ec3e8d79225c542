"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat path.

A request is converted to what ``/v1/chat/completions`` would submit: the system prompt and the
messages become OpenAI-style message dicts (an assistant's ``tool_use`` blocks its ``tool_calls``,
a user's ``tool_result`` blocks ``tool`` messages with ``tool_call_id``), ``tools`` become
function tools, ``tool_choice`` a :class:`StructuredOutput` (``any`` → ``"required"``, ``tool`` →
the named function, ``none`` → ``"none"``, ``disable_parallel_tool_use`` → at most one call),
and :meth:`Generator.start_chat` runs it. The reply is turned back into content blocks (text,
then ``tool_use`` with the parsed arguments as ``input``) or, streamed, into Anthropic's events:
``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta``
(``text_delta``, or one ``input_json_delta`` with a tool call's whole arguments) /
``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``.

Usage follows Anthropic: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those that were (the engine's cache is automatic, so a repeated prefix
is read whether or not the request marks it), ``cache_creation_input_tokens`` is always 0 (writing
the cache costs nothing extra here). ``count_tokens`` gives the whole prompt, the sum of the three.

``cache_control`` breakpoints (on blocks, tools, or the request): a request with any breakpoint
acquires a KV lease (agentrt/core/leases.py), so when it finishes its whole sequence (prompt and reply,
which holds the prefix up to the last breakpoint) stays in the engine's cache, like a session turn's,
for the TTL ``LeasePolicy.cache_control_ttl`` gives: the server's ``pin_ttl_s`` for ``{"type":
"ephemeral"}`` (or ``ttl: "5m"``), an hour capped by ``max_pin_ttl_s`` for ``ttl: "1h"``. Nothing
releases it early; it expires, or the engine drops it under memory pressure.

A model with a reasoning parser (engine/parsers) answers with a ``thinking`` block first (streamed as
``thinking_delta`` events; its ``signature`` is empty: nothing here signs reasoning); ``thinking``
blocks sent back in assistant messages are that message's reasoning, which the template keeps or drops.

What the server cannot do is refused with a 400 naming the field: content blocks other than text,
``thinking``, ``tool_use`` and ``tool_result`` (images, documents...), server tools, a last message from
the assistant (prefill), and every top-level field the models below do not declare (extended
``thinking``, ``mcp_servers``, ``container``, ``output_config``, ``speed``...), except ``thinking:
{"type": "disabled"}``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, AsyncIterator, Literal, Union

from fastapi import APIRouter, Depends, Request, Response

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from engine.tokenizer import ToolCall, format_tool_call
from engine.client import StructuredOutput

from agentrt.api.http import Auth, reply
from agentrt.core.affinity import affinity_hint, affinity_key
from agentrt.core.errors import bad_request
from agentrt.core.generation import Generation, Generator, Result
from agentrt.core.tenants import Tenant

# ---------------------------------------------------------------- protocol models


class _Part(BaseModel):
    """A nested object: fields it does not know are ignored (clients send back response blocks as they
    got them, ``citations: null`` included)."""

    model_config = ConfigDict(extra="ignore")


class CacheControl(_Part):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Part):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Content | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Part):
    """An earlier reply's reasoning, sent back: the assistant message's ``reasoning_content``."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class UnsupportedBlock(BaseModel):
    """A block of any other type (image, document, thinking...): parsed so that it can be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(json_schema_extra={"not": {"enum": list(_BLOCK_TYPES)}})


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _BLOCK_TYPES else "other"


Block = Annotated[Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
                        Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
                        Annotated[UnsupportedBlock, Tag("other")]],
                  Discriminator(_block_tag)]


def _content_tag(value: Any) -> str:
    return "string" if isinstance(value, str) else "blocks"


# A string or a list of blocks (tagged, so that a bad block reports its own error, not also "not a string").
Content = Annotated[Union[Annotated[str, Tag("string")], Annotated[list[Block], Tag("blocks")]],
                    Discriminator(_content_tag)]
ToolResultBlock.model_rebuild()


class Message(_Part):
    role: Literal["user", "assistant"]
    content: Content


class CustomTool(_Part):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ServerTool(BaseModel):
    """A tool Anthropic runs itself (web search, code execution...): parsed so that it can be refused."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(json_schema_extra={"not": {"enum": ["custom"]}})


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom" if kind in (None, "custom") else "server"


Tool = Annotated[Union[Annotated[CustomTool, Tag("custom")], Annotated[ServerTool, Tag("server")]],
                 Discriminator(_tool_tag)]


class ToolChoiceAuto(_Part):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Part):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Part):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Part):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class Metadata(_Part):
    user_id: str | None = None


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``. Top-level fields this model does not declare are kept so
    that the service can refuse them by name (as Anthropic refuses unknown fields)."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Content | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # a breakpoint at the end of the prompt


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``metadata`` and ``service_tier`` are accepted and not used."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    stream: bool = False
    # extensions vLLM also accepts (the other surfaces take them too): a sampling seed, and EOS not ending the reply
    seed: int | None = None
    ignore_eos: bool | None = None


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


# What to add when refusing some top-level fields (any field not declared above is refused).
_REFUSAL_HINTS = {
    "thinking": " (extended thinking; omit it, or send {\"type\": \"disabled\"})",
    "output_format": "; for JSON output, give a tool and tool_choice {\"type\": \"tool\", \"name\": ...}",
    "output_config": "; for JSON output, give a tool and tool_choice {\"type\": \"tool\", \"name\": ...}",
}

# ---------------------------------------------------------------- conversion


@dataclass
class ChatRequest:
    """A Messages request as the chat path takes it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    options: StructuredOutput
    cache_ttls: list[str | None]   # each cache_control breakpoint's ttl (None: ephemeral's default)


def _param(where: str) -> str:
    """``messages[0].content[1]`` as the error's ``param``, ``messages.0.content.1``."""
    return where.replace("[", ".").replace("]", "")


def _text_of(blocks: list[Any], where: str, sep: str = "") -> str:
    """Text blocks' text, joined by ``sep``; 400 for a block of another type."""
    for k, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise bad_request(f"{where}[{k}].type: only text blocks are allowed here, not '{block.type}'",
                              param=_param(f"{where}[{k}].type"))
    return sep.join(block.text for block in blocks)


class _Converter:
    """One request's conversion; collects the ``cache_control`` breakpoints it passes."""

    def __init__(self) -> None:
        self.breakpoints: list[CacheControl] = []
        self.tool_use_ids: set[str] = set()

    def mark(self, item: Any) -> None:
        if isinstance(getattr(item, "cache_control", None), CacheControl):
            self.breakpoints.append(item.cache_control)

    def system(self, system: str | list[Any] | None) -> list[dict[str, Any]]:
        if system is None or isinstance(system, str):
            return [{"role": "system", "content": system}] if system else []
        text = _text_of(system, "system", sep="\n")
        for block in system:
            self.mark(block)
        return [{"role": "system", "content": text}] if text else []

    def tools(self, tools: list[Any] | None) -> list[dict[str, Any]] | None:
        if not tools:
            return None
        out = []
        for i, tool in enumerate(tools):
            if isinstance(tool, ServerTool):
                raise bad_request(f"tools[{i}].type: server tools ('{tool.type}') are not supported by this "
                                  "server; give custom tools with name and input_schema", param=f"tools.{i}.type")
            if tool.input_schema.get("type") != "object":
                raise bad_request(f"tools[{i}].input_schema: must be a JSON schema of type 'object'",
                                  param=f"tools.{i}.input_schema")
            self.mark(tool)
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description is not None:
                function["description"] = tool.description
            out.append({"type": "function", "function": function})
        return out

    def messages(self, messages: list[Message]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "assistant":
                out.append(self._assistant(message.content, f"messages[{i}].content"))
            else:
                out.extend(self._user(message.content, f"messages[{i}].content"))
        if messages[-1].role != "user":
            raise bad_request(f"messages[{len(messages) - 1}]: the last message must be from the user "
                              "(continuing an assistant message, prefill, is not supported)",
                              param=f"messages.{len(messages) - 1}.role")
        return out

    def _refuse(self, block: Any, where: str, allowed: str) -> None:
        raise bad_request(f"{where}.type: content blocks of type '{block.type}' are not supported here "
                          f"(supported: {allowed})", param=_param(where + ".type"))

    def _assistant(self, blocks: list[Any], where: str) -> dict[str, Any]:
        text, calls, thinking = [], [], []
        for k, block in enumerate(blocks):
            self.mark(block)
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                self.tool_use_ids.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name,
                                           "arguments": json.dumps(block.input, ensure_ascii=False)}})
            else:
                self._refuse(block, f"{where}[{k}]", "text, thinking and tool_use in assistant messages")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        return message

    def _user(self, blocks: list[Any], where: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text: list[str] = []
        for k, block in enumerate(blocks):
            self.mark(block)
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append(self._tool_result(block, f"{where}[{k}]"))
            else:
                self._refuse(block, f"{where}[{k}]", "text and tool_result in user messages")
        if text or not out:
            out.append({"role": "user", "content": "".join(text)})
        return out

    def _tool_result(self, block: ToolResultBlock, where: str) -> dict[str, Any]:
        if block.tool_use_id not in self.tool_use_ids:
            raise bad_request(f"{where}.tool_use_id: no earlier assistant tool_use block has id "
                              f"'{block.tool_use_id}'", param=_param(where + ".tool_use_id"))
        if isinstance(block.content, list):
            for part in block.content:
                self.mark(part)
            content = _text_of(block.content, where + ".content")
        else:
            content = block.content or ""
        if block.is_error:
            content = "Error: " + content
        return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _structured_output(req: CountTokensRequest, tools: list[dict[str, Any]] | None) -> StructuredOutput:
    choice = req.tool_choice
    if choice is None:
        return StructuredOutput(tools=tools)
    if choice.type in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice: type '{choice.type}' needs tools", param="tool_choice")
    if not tools:  # auto or none without tools: free output
        return StructuredOutput()
    parallel = False if getattr(choice, "disable_parallel_tool_use", False) else None
    if isinstance(choice, ToolChoiceTool):
        mapped: str | dict[str, Any] = {"type": "function", "function": {"name": choice.name}}
    else:
        mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return StructuredOutput(tools=tools, tool_choice=mapped, parallel_tool_calls=parallel)


def to_chat(req: CountTokensRequest) -> ChatRequest:
    """The chat request for ``req``; 400 naming the field for anything this server does not support."""
    for name, value in (req.model_extra or {}).items():
        if name == "thinking" and isinstance(value, dict) and value.get("type") == "disabled":
            continue
        raise bad_request(f"'{name}' is not supported by this server" + _REFUSAL_HINTS.get(name, ""), param=name)
    convert = _Converter()
    convert.mark(req)
    messages = convert.system(req.system)
    tools = convert.tools(req.tools)
    messages += convert.messages(req.messages)
    return ChatRequest(messages, tools, _structured_output(req, tools), [b.ttl for b in convert.breakpoints])


# ---------------------------------------------------------------- the reply


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def tool_use_block(call: ToolCall) -> dict[str, Any] | None:
    """A parsed tool call as a ``tool_use`` block (``input``: its arguments); None when the arguments
    are not a JSON object, which Anthropic's ``input`` must be."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": arguments}


def thinking_block(reasoning: str) -> dict[str, Any]:
    """The reply's reasoning as a ``thinking`` block (no signature: nothing here signs reasoning)."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def stop_reason(result: Result, tool_use: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished generation."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return "end_turn", None


class AnthropicService:
    """The Messages API over a :class:`Generator`; nothing here knows about HTTP."""

    def __init__(self, generator: Generator) -> None:
        self.gen = generator

    def _chat(self, req: CountTokensRequest) -> ChatRequest:
        self.gen.check_model(req.model)
        return to_chat(req)

    def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        chat = self._chat(req)
        self.gen.constraint(chat.options)  # a tool_choice that /v1/messages would refuse is refused here too
        return {"input_tokens": len(self.gen.chat_prompt(chat.messages, chat.tools))}

    async def start(self, req: MessagesRequest, tenant: Tenant | None = None, affinity: str | None = None) -> Generation:
        """Validate and submit; errors (400/404/429) are raised here, before any byte is streamed.
        ``affinity``: the conversation's affinity key (``X-Claude-Code-Session-Id`` and the like), routed
        as one conversation behind a router."""
        started = time.monotonic()
        chat = self._chat(req)
        fields = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p,
                  "top_k": req.top_k, "stop": req.stop_sequences, "seed": req.seed, "ignore_eos": req.ignore_eos}
        lease_ttl = self.gen.leases.policy.cache_control_ttl(chat.cache_ttls)
        return await self.gen.start_chat(chat.messages, fields, chat.options, lease_ttl_s=lease_ttl,
                                         started_at=started, session=affinity_hint(tenant, affinity), tenant=tenant)

    def _message_id(self, generation: Generation) -> str:
        return "msg_" + generation.request_id.removeprefix("req-")

    async def message(self, generation: Generation) -> dict[str, Any]:
        """The whole reply as a ``message`` object."""
        result = await generation.collect()
        text = result.content or ""
        tool_uses = []
        for call in result.tool_calls:
            block = tool_use_block(call)
            if block is None:  # not a call Anthropic's shape can carry: the model's text as it wrote it
                text += ("\n" if text else "") + format_tool_call(call.name, call.arguments)
            else:
                tool_uses.append(block)
        thinking = [thinking_block(result.reasoning)] if result.reasoning else []
        content = thinking + ([{"type": "text", "text": text}] if text else []) + tool_uses
        reason, sequence = stop_reason(result, bool(tool_uses))
        return {"id": self._message_id(generation), "type": "message", "role": "assistant",
                "model": self.gen.model_name, "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)}

    async def events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        """The reply as Anthropic's stream events (each dict's ``type`` is its event name). ``message_start``
        waits for the engine's first output, which gives the prompt's cached tokens."""
        stream = _BlockStream()
        started = False
        async for delta in generation.deltas():
            if not started:
                started = True
                yield self._message_start(generation)
                yield {"type": "ping"}
            for event in stream.thinking(delta.reasoning) + stream.text(delta.content):
                yield event
            for call in delta.tool_calls:
                for event in stream.tool_call(call):
                    yield event
        result = generation.result
        if not started:
            yield self._message_start(generation)
            yield {"type": "ping"}
        for event in stream.close_thinking() + stream.close_text():
            yield event
        reason, sequence = stop_reason(result, stream.tool_uses > 0)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": usage(result.prompt_tokens, result.cached_tokens, result.completion_tokens)}
        yield {"type": "message_stop"}

    def _message_start(self, generation: Generation) -> dict[str, Any]:
        return {"type": "message_start", "message": {
            "id": self._message_id(generation), "type": "message", "role": "assistant", "model": self.gen.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage(generation.prompt_tokens, generation.cached_tokens, 0)}}


class _BlockStream:
    """Content blocks as stream events: reasoning is a thinking block, text opens a text block
    (whitespace alone waits, so that the newline between parallel tool calls makes no block), a tool
    call closes it and is a block of its own."""

    def __init__(self) -> None:
        self.index = -1
        self.thinking_open = False
        self.text_open = False
        self.pending = ""
        self.tool_uses = 0

    def thinking(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self.close_text()
        if not self.thinking_open:
            self.index += 1
            self.thinking_open = True
            events.append({"type": "content_block_start", "index": self.index,
                           "content_block": thinking_block("")})
        return events + [{"type": "content_block_delta", "index": self.index,
                          "delta": {"type": "thinking_delta", "thinking": text}}]

    def close_thinking(self) -> list[dict[str, Any]]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [{"type": "content_block_delta", "index": self.index, "delta": {"type": "signature_delta",
                                                                            "signature": ""}},
                {"type": "content_block_stop", "index": self.index}]

    def text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if not self.text_open:
            events = self.close_thinking()
            self.pending += text
            if not self.pending.strip():
                return events
            text, self.pending = self.pending, ""
            self.index += 1
            self.text_open = True
            return events + [{"type": "content_block_start", "index": self.index,
                              "content_block": {"type": "text", "text": ""}}, self._text_delta(text)]
        return [self._text_delta(text)]

    def _text_delta(self, text: str) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}}

    def close_text(self) -> list[dict[str, Any]]:
        self.pending = ""
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": self.index}]

    def tool_call(self, call: ToolCall) -> list[dict[str, Any]]:
        block = tool_use_block(call)
        if block is None:  # as in a whole message: the call's text
            return self.text(("\n" if self.text_open else "") + format_tool_call(call.name, call.arguments))
        events = self.close_thinking() + self.close_text()
        self.index += 1
        self.tool_uses += 1
        events += [{"type": "content_block_start", "index": self.index, "content_block": {**block, "input": {}}},
                   {"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"],
                                                                                     ensure_ascii=False)}},
                   {"type": "content_block_stop", "index": self.index}]
        return events


def routes(svc: AnthropicService, auth: Auth, retry_after_s: int) -> APIRouter:
    """Anthropic's Messages API over ``svc``, with Anthropic's error bodies; ``auth``: the API-key check."""
    api = APIRouter(responses={code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)})

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request, response: Response,
                       tenant: Tenant = Depends(auth)) -> Any:
        """Anthropic's Messages API (``anthropic-version`` and ``anthropic-beta`` headers are accepted and
        not read); streaming sends Anthropic's named events. Session headers route as affinity keys."""
        generation = await svc.start(body, tenant, affinity_key(request.headers))
        return await reply(request, response, generation, body.stream, lambda: svc.events(generation),
                           lambda: svc.message(generation), retry_after_s, anthropic=True)

    @api.post("/v1/messages/count_tokens", response_model=TokenCount, dependencies=[Depends(auth)])
    async def count_tokens(body: CountTokensRequest) -> dict:
        """The ``input_tokens`` of this request: its prompt as ``/v1/messages`` would submit it."""
        return svc.count_tokens(body)

    return api
