"""The OpenAI Responses API (``/v1/responses``) over sessions: request models, conversions, the service.

A chain of ``previous_response_id`` s is a session (``agentrt/core/turns.py``): each stored response is
one turn, so the chain's history is the session's, its KV prefix stays pinned between calls, and the
response object lives in the turn record (``TurnRecord.response``) in the session store, in process or
in Redis behind a router. A response id names its session and its turn: ``resp_`` + the session id's
32 hex digits + the turn's 32. A response that continues the last turn of its session is the
session's next turn; one that continues an earlier response (a second child of one parent, or a
continuation while another is running) forks the session at that response
(``SessionManager.fork(at_turn=...)``), so each branch keeps its own pinned prefix. A continuation's
turn key is a hash of the parent id and the request, so a retried request that continued a session
in place replays the recorded response instead of running again. Stored responses expire with their
session (its idle TTL), belong to its tenant (404 for any other), and ``DELETE`` drops a response's
record (the history its children build on stays; a session left with no response is deleted).
``store: false`` runs the same prompt without recording anything: such a response cannot be
retrieved or continued.

Instructions and tools belong to each request, as in OpenAI's API (a continuation does not inherit
them): the prompt is the request's instructions as a system message, the session's history (replies
as the model wrote them, for exact cache reuse), then the new input items. A client that sends the
same instructions and tools on every call, as agent frameworks do, reuses the whole cached prefix.

Nothing here knows about HTTP: routes in ``server.py`` call :class:`ResponsesService` and send
:meth:`ResponseRun.events` as server-sent events named by their ``type``.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.client import SessionHint, StructuredOutput

from agentrt.api.http import ERRORS, Auth, json_reply, placed, sse_response, unless_disconnected
from agentrt.core.affinity import affinity_hint, affinity_key
from agentrt.core.errors import APIError, bad_request, from_exception, not_found
from agentrt.core.generation import Delta, Generation, Result, reasoning_effort
from agentrt.core.request_fields import RESPONSES, check_extra_fields
from agentrt.protocol import ForkRequest, FunctionDef, SessionCreateRequest
from agentrt.api.responses_output import OutputBuilder, content_part, hex_id, replay_events
from agentrt.core.turns import SessionManager, TurnPlan, TurnRun
from agentrt.core.store import SessionRecord, TurnRecord
from agentrt.core.tenants import Tenant

# ``include`` values this server honours: reasoning content is never produced, so asking for it is empty.
SUPPORTED_INCLUDE = ("reasoning.encrypted_content",)


# ------------------------------------------------------------ request


class ResponseCreateRequest(BaseModel):
    """``POST /v1/responses``. Fields OpenAI defines that this server cannot honour are declared so that
    a request using them gets a 400 naming the field (:meth:`ResponsesService.start`) rather than
    being silently ignored; fields it does not declare are checked as on Chat Completions
    (agentrt/core/request_fields.py: vLLM's extensions it does not implement only at their neutral
    values, unknown ones refused)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    stream: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    # extensions vLLM also accepts (the other surfaces take them too): a sampling seed, and EOS not ending the reply
    seed: int | None = None
    ignore_eos: bool | None = None
    # refused unless unset or their "off" value
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > 16:
                raise ValueError("at most 16 metadata pairs")
            for k, v in value.items():
                if len(k) > 64 or len(v) > 512:
                    raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return value


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


def _refuse_unsupported(req: ResponseCreateRequest) -> None:
    """400 naming the first field set to something this server cannot do."""
    check_extra_fields(req.model_extra, RESPONSES)
    reasoning = req.reasoning or {}
    if any(reasoning.get(k) is not None for k in ("summary", "generate_summary")):
        raise bad_request("reasoning summaries are not supported (the reasoning itself comes as a reasoning item)",
                          param="reasoning")
    if req.background:
        raise bad_request("background responses are not supported; send background: false", param="background")
    for i, value in enumerate(req.include or []):
        if value not in SUPPORTED_INCLUDE:
            raise bad_request(f"include value '{value}' is not supported (supported: {list(SUPPORTED_INCLUDE)})",
                              param=f"include.{i}")
    if req.conversation is not None:
        raise bad_request("conversations are not supported; chain responses with previous_response_id",
                          param="conversation")
    if req.prompt is not None:
        raise bad_request("prompt templates are not supported; send input and instructions", param="prompt")
    if req.truncation not in (None, "disabled"):
        raise bad_request("truncation 'auto' is not supported: a prompt over the context window is refused",
                          param="truncation")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if req.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported; use parallel_tool_calls: false for one call",
                          param="max_tool_calls")
    if req.service_tier not in (None, "auto", "default"):
        raise bad_request(f"service_tier '{req.service_tier}' is not supported (only 'auto' or 'default')",
                          param="service_tier")
    verbosity = (req.text or {}).get("verbosity")
    if verbosity not in (None, "medium"):
        raise bad_request("text.verbosity other than 'medium' is not supported", param="text.verbosity")


# ------------------------------------------------------------ conversions


def _text_parts(content: Any, allowed: tuple[str, ...], where: str) -> tuple[str, list[dict[str, Any]]]:
    """A message's content (a string or a list of text parts) as one string and as stored parts."""
    part_type = allowed[0]
    if isinstance(content, str):
        return content, [content_part(part_type, content)]
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of content parts", param=where)
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise bad_request(f"{where}.{j}: content part type {kind!r} is not supported (this model reads text "
                              f"only: {', '.join(allowed)})", param=f"{where}.{j}.type")
        text = part.get("text") if kind != "refusal" else part.get("refusal")
        if not isinstance(text, str):
            raise bad_request(f"{where}.{j}: a {kind} part needs a string "
                              f"{'refusal' if kind == 'refusal' else 'text'}", param=f"{where}.{j}")
        texts.append(text)
        parts.append(content_part(kind, text))
    return "".join(texts), parts


def _string_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}: '{name}' must be a non-empty string", param=f"{where}.{name}")
    return value


def convert_input(value: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The request's ``input`` as chat messages (what the template renders) and as stored input items
    (each with an id). Messages (text content), ``function_call``, ``function_call_output`` and
    ``reasoning`` items are taken (a reasoning item is the next assistant message's
    ``reasoning_content``); anything else is a 400 naming the item."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [
            {"id": "msg_" + hex_id(), "type": "message", "role": "user", "status": "completed",
             "content": [content_part("input_text", value)]}]
    if not value:
        raise bad_request("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(value):
        where = f"input.{i}"
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise bad_request(f"{where}: 'id' must be a string", param=f"{where}.id")
        kind = item.get("type", "message" if "role" in item else None)
        convert = _INPUT_ITEMS.get(kind)
        if convert is None:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (messages, function_call "
                              "and function_call_output are)", param=f"{where}.type")
        stored, reasoning = convert(item, where, messages, reasoning)
        items.append(stored)
    return messages, items


# Each input item kind: (item, where, messages so far, pending reasoning) -> (the stored item, pending
# reasoning), appending what the item says to ``messages``.
def _message_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]], reasoning: str | None):
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"{where}: role must be user, system, developer or assistant, got {role!r}",
                          param=f"{where}.role")
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    text, parts = _text_parts(item.get("content"), allowed, f"{where}.content")
    messages.append({"role": "system" if role == "developer" else role, "content": text})
    if role == "assistant" and reasoning is not None:
        messages[-1]["reasoning_content"], reasoning = reasoning, None
    return {"id": item.get("id") or "msg_" + hex_id(), "type": "message", "role": role,
            "status": "completed", "content": parts}, reasoning


def _function_call_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]], reasoning: str | None):
    call_id, name = _string_field(item, "call_id", where), _string_field(item, "name", where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise bad_request(f"{where}: 'arguments' must be a JSON string", param=f"{where}.arguments")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text, then its calls
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    if reasoning is not None:
        messages[-1]["reasoning_content"], reasoning = reasoning, None
    return {"id": item.get("id") or "fc_" + hex_id(), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}, reasoning


def _function_call_output_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]],
                               reasoning: str | None):
    call_id = _string_field(item, "call_id", where)
    output = item.get("output")
    if isinstance(output, str):
        text = output
    else:
        text, _ = _text_parts(output, ("input_text",), f"{where}.output")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
    return {"id": item.get("id") or "fco_" + hex_id(), "type": "function_call_output", "call_id": call_id,
            "output": output, "status": "completed"}, reasoning


def _reasoning_item(item: dict[str, Any], where: str, messages: list[dict[str, Any]], reasoning: str | None):
    """An earlier turn's reasoning: the next assistant message carries it."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or any(not isinstance(p, dict) or p.get("type") != "reasoning_text"
                                          or not isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"{where}: a reasoning item's content must be reasoning_text parts",
                          param=f"{where}.content")
    reasoning = "".join(p["text"] for p in parts)
    return {"id": item.get("id") or "rs_" + hex_id(), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}]}, reasoning


_INPUT_ITEMS = {"message": _message_item, "function_call": _function_call_item,
                "function_call_output": _function_call_output_item, "reasoning": _reasoning_item}


def convert_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat completions shape the template renders; any other tool type is a 400."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools.{i}: {tool.get('type')!r} tools are not supported; only function tools "
                              "(built-in tools such as web_search or file_search run on OpenAI's servers)",
                              param=f"tools.{i}.type")
        try:
            function = FunctionDef.model_validate({k: tool[k] for k in ("name", "description", "parameters",
                                                                        "strict") if k in tool})
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise bad_request(f"tools.{i}.{field}: {first['msg']}", param=f"tools.{i}.{field}") from None
        out.append({"type": "function", "function": function.model_dump(exclude_none=True)})
    return out


def convert_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
                        ) -> str | dict[str, Any] | None:
    if choice is None or (not tools and choice in ("auto", "none")):
        return None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                              param="tool_choice")
        choice_out: str | dict[str, Any] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice in ("auto", "none", "required"):
        choice_out = choice
    else:
        raise bad_request(f"tool_choice {choice!r} is not one of 'auto', 'none', 'required'", param="tool_choice")
    if not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools, and none were given", param="tool_choice")
    return choice_out


def convert_text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None: free text)."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("text.format.name is required for json_schema", param="text.format.name")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format type {kind!r} is not supported (text, json_object, json_schema)",
                      param="text.format.type")


def usage_of(result: Result) -> dict[str, Any]:
    """OpenAI's usage: ``cached_tokens``, the input read from the prefix cache; ``cache_write_tokens``, the
    rest, which this response computed (the prefix cache keeps their whole pages)."""
    details = {"cached_tokens": result.cached_tokens,
               "cache_write_tokens": result.prompt_tokens - result.cached_tokens}
    return {"input_tokens": result.prompt_tokens, "input_tokens_details": details,
            "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


# ------------------------------------------------------------ ids


def response_id(session_id: str, key: str) -> str:
    """``resp_`` + the session id's hex + the turn key (32 hex digits each)."""
    return "resp_" + session_id.removeprefix("sess_") + key


def parse_response_id(rid: str) -> str | None:
    """The session id a response id names (None: not one of this server's ids)."""
    body = rid.removeprefix("resp_")
    if not rid.startswith("resp_") or len(body) != 64 or any(c not in "0123456789abcdef" for c in body):
        return None
    return "sess_" + body[:32]


def _continuation_key(req: ResponseCreateRequest) -> str:
    """What makes a retried continuation the same turn: its parent and its request (streamed or not)."""
    body = json.dumps(req.model_dump(exclude={"stream", "stream_options"}), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


# ------------------------------------------------------------ output items and their events


# ------------------------------------------------------------ one response


class ResponseRun:
    """One ``POST /v1/responses``: a stored turn running in its session (``turn``), an unstored
    generation (``generation``), or a recorded response replayed (``recorded``). Iterate
    :meth:`events` (streaming) or await :meth:`collect` (the response object), once; :meth:`close`
    ends it however it went (idempotent)."""

    def __init__(self, service: "ResponsesService", base: dict[str, Any], input_items: list[dict[str, Any]],
                 tenant: Tenant) -> None:
        self.service = service
        self.base = base
        self.input_items = input_items
        self.tenant = tenant
        self.output = OutputBuilder()
        self.turn: TurnRun | None = None
        self.generation: Generation | None = None
        self.recorded: dict[str, Any] | None = None
        self.new_session: str | None = None  # a session made for this response: deleted if it is not recorded
        self.final: dict[str, Any] = {}  # the response object, once complete
        self._closed = False

    @property
    def running(self) -> Generation | None:
        """The generation this response runs (None: a recorded response, replayed)."""
        return self.turn.generation if self.turn is not None else self.generation

    def describe(self, result: Result) -> dict[str, Any]:
        """The stored record of this response, made when its turn is recorded."""
        return {"response": self._final(result), "input_items": self.input_items}

    def _final(self, result: Result) -> dict[str, Any]:
        incomplete = result.finish_reason == "length"
        output = self.output.finish("incomplete" if incomplete else "completed")
        return {**self.base, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "output": output, "usage": usage_of(result), "completed_at": int(time.time())}

    async def _deltas(self) -> AsyncIterator[Delta]:
        source = self.turn.deltas() if self.turn is not None else self.generation.deltas()
        async for delta in source:
            yield delta

    async def _item_events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The output items' events as they come; then ``self.final`` is the response object."""
        if self.recorded is not None:
            yield replay_events(self.recorded["output"])
            self.final = self.recorded
            return
        async for delta in self._deltas():
            self.output.feed(delta)
            yield self.output.take()
        if self.turn is not None:  # as recorded (by this turn, or by a retry of it that ended first)
            response = self.turn.turn.response if self.turn.turn is not None else None
            if response is None:
                raise APIError(503, "the response ended before it was recorded", type="server_error")
            self.final = response["response"]
        else:
            self.final = self._final(self.generation.result)
        yield self.output.take()

    async def collect(self) -> dict[str, Any]:
        """The response object, once complete."""
        try:
            async for _ in self._item_events():
                pass
        finally:
            await self.close()
        return self.final

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The stream: ``response.created``, ``response.in_progress``, the items' events, then
        ``response.completed`` (or ``response.incomplete``); a failure ends it with an ``error`` event."""
        seq = 0

        def numbered(event: dict[str, Any]) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            return {**event, "sequence_number": seq - 1}

        start = {**self.base, "status": "in_progress", "output": [], "usage": None}
        yield numbered({"type": "response.created", "response": start})
        yield numbered({"type": "response.in_progress", "response": start})
        try:
            async for events in self._item_events():
                for event in events:
                    yield numbered(event)
            kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
            yield numbered({"type": kind, "response": self.final})
        except Exception as exc:
            error = from_exception(exc, self.service.sessions.config.retry_after_s)
            yield numbered({"type": "error", "code": error.code or error.type, "message": error.message,
                            "param": error.param})
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.turn is not None:
            await self.turn.close()
        elif self.generation is not None:
            await self.generation.close()
        if self.new_session is not None and (self.turn is None or self.turn.turn is None):
            await self.service.drop_session(self.new_session, self.tenant)


# ------------------------------------------------------------ the service


class ResponsesService:
    """``/v1/responses`` over ``sessions``: :meth:`start` a response (or replay a recorded one),
    :meth:`retrieve`, :meth:`input_items` and :meth:`delete` stored ones, each for its tenant only."""

    def __init__(self, sessions: SessionManager) -> None:
        self.sessions = sessions
        self.gen = sessions.gen

    async def start(self, req: ResponseCreateRequest, tenant: Tenant, affinity: str | None = None) -> ResponseRun:
        """Validate and start (or replay) a response; errors (400/404/409/429) are raised here, before
        any byte is streamed. ``affinity``: the client's affinity key (``prompt_cache_key`` or a session
        header), which routes an unstored call with no ``previous_response_id`` as one conversation."""
        _refuse_unsupported(req)
        model = self.gen.check_model(req.model)
        template_kwargs = self._effort(req.reasoning)
        new_messages, input_items = convert_input(req.input)
        tools = convert_tools(req.tools)
        options = StructuredOutput(convert_text_format(req.text), tools, convert_tool_choice(req.tool_choice, tools),
                                   req.parallel_tool_calls)
        self.gen.constraint(options)  # 400 now for options no request could run with
        fields = {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": req.max_output_tokens,
                  "seed": req.seed, "ignore_eos": req.ignore_eos}
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        store = req.store is not False

        parent: tuple[SessionRecord, TurnRecord] | None = None
        if req.previous_response_id is not None:
            parent = await self._find(req.previous_response_id, tenant, param="previous_response_id")

        def new_run(rid: str) -> ResponseRun:
            return ResponseRun(self, self._base(rid, model, req, store), input_items, tenant)

        def plan_for(run: ResponseRun) -> Callable[[SessionRecord], TurnPlan]:
            def plan(record: SessionRecord) -> TurnPlan:
                return TurnPlan(new_messages, system + self.sessions.history(record) + new_messages, fields,
                                options, run.describe, template_kwargs)
            return plan

        if not store:  # run once, record nothing
            run = new_run(response_id("sess_" + hex_id(), hex_id()))
            # a stateless call (the client resends the history) routes by its affinity key, if it has one
            messages, hint = system + new_messages, affinity_hint(tenant, affinity)
            if parent is not None:
                record, turn = parent
                messages = system + self.sessions.history(record, upto=turn) + new_messages
                hint = SessionHint(record.id, record.last_worker, continuing=True)
            run.generation = await self.gen.start_chat(messages, fields, options, session=hint, tenant=tenant,
                                                       template_kwargs=template_kwargs)
            return run

        if parent is None:
            record = await self.sessions.create(SessionCreateRequest(model=model), tenant)
            return await self._in_new_session(new_run(response_id(record.id, hex_id())), record, plan_for)

        record, turn = parent
        key = _continuation_key(req)
        done = record.find_turn(response_id(record.id, key))
        if done is not None and done.response is None:  # that response was deleted: this request is a new one
            key, done = hex_id(), None
        if done is not None or record.last_turn.turn_id == turn.turn_id:
            run = new_run(response_id(record.id, key))
            started = await self.sessions.begin_turn(record.id, tenant, run.base["id"], plan_for(run),
                                                     after=turn.turn_id)
            if started is not None:
                return self._started(run, started)
        # Another response continues this one already, or is running after it: a branch of its own.
        fork = await self.sessions.fork(record.id, ForkRequest(), tenant, at_turn=turn.turn_id)
        return await self._in_new_session(new_run(response_id(fork.id, key)), fork, plan_for)

    def _effort(self, reasoning: dict[str, Any] | None) -> dict[str, Any] | None:
        """``reasoning.effort`` as the chat template's switches (``reasoning_effort``)."""
        return reasoning_effort((reasoning or {}).get("effort"), self.gen.tokenizer.chat_template, "reasoning.effort")

    async def _in_new_session(self, run: ResponseRun, record: SessionRecord,
                              plan_for: Callable[[ResponseRun], Callable[[SessionRecord], TurnPlan]]) -> ResponseRun:
        """``run``'s turn, the first of ``record``, a session made for it (deleted unless the turn is recorded)."""
        run.new_session = record.id
        try:
            started = await self.sessions.begin_turn(record.id, run.tenant, run.base["id"], plan_for(run))
        except BaseException:
            await self.drop_session(record.id, run.tenant)
            raise
        return self._started(run, started)

    @staticmethod
    def _started(run: ResponseRun, started: TurnRun | TurnRecord) -> ResponseRun:
        if isinstance(started, TurnRun):
            run.turn = started
        elif started.response is None:  # deleted while this retry looked it up
            raise not_found(f"response '{started.turn_id}' was deleted", param="response_id",
                            code="response_not_found")
        else:  # a retry of a recorded request: its response, nothing run
            run.recorded = started.response["response"]
        return run

    def _base(self, rid: str, model: str, req: ResponseCreateRequest, store: bool) -> dict[str, Any]:
        """The response object's fields that echo the request."""
        text = {"format": (req.text or {}).get("format") or {"type": "text"}, "verbosity": "medium"}
        return {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None}, "safety_identifier": req.safety_identifier,
            "service_tier": "default", "store": store,
            "temperature": 1.0 if req.temperature is None else req.temperature, "text": text,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_logprobs": 0, "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None, "user": req.user, "metadata": req.metadata or {}}

    async def _find(self, rid: str, tenant: Tenant, param: str = "response_id") -> tuple[SessionRecord, TurnRecord]:
        """The session and turn of a stored response of ``tenant``; 404 otherwise."""
        missing = not_found(f"response '{rid}' does not exist (never stored, deleted, expired, or not yours)",
                            param=param, code="response_not_found")
        session_id = parse_response_id(rid)
        if session_id is None:
            raise missing
        try:
            record = await self.sessions.get(session_id, tenant)
        except APIError as exc:
            if exc.status == 404:
                raise missing from None
            raise
        turn = record.find_turn(rid)
        if turn is None or turn.response is None:
            raise missing
        return record, turn

    async def retrieve(self, rid: str, tenant: Tenant) -> dict[str, Any]:
        _, turn = await self._find(rid, tenant)
        return turn.response["response"]

    async def input_items(self, rid: str, tenant: Tenant, *, limit: int = 20, order: str = "desc",
                          after: str | None = None, before: str | None = None) -> dict[str, Any]:
        """A page of the response's input items (``order``: desc, the newest first, or asc; ``after`` /
        ``before``: item ids the page starts after / ends before)."""
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", param="limit")
        _, turn = await self._find(rid, tenant)
        items = list(turn.response["input_items"])
        if order == "desc":
            items.reverse()
        ids = [item["id"] for item in items]
        for name, cursor in (("after", after), ("before", before)):
            if cursor is not None and cursor not in ids:
                raise bad_request(f"{name}: no input item '{cursor}' in response '{rid}'", param=name)
        start = ids.index(after) + 1 if after is not None else 0
        end = ids.index(before) if before is not None else len(items)
        page = items[start:end][:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}

    async def delete(self, rid: str, tenant: Tenant) -> dict[str, Any]:
        """Drop the response's record (the history its children build on stays); a session left with
        no response (and no turn running) is deleted, its pin released."""
        record, _ = await self._find(rid, tenant)
        updated = await self.sessions.store.update_turn(record.id, rid, response=None)
        if updated is not None and not any(t.response for t in updated.turns) \
                and not await self.sessions.store.turn_locked(record.id):
            await self.drop_session(record.id, tenant)
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def drop_session(self, session_id: str, tenant: Tenant) -> None:
        """Delete a session made for responses (already gone: nothing to do)."""
        try:
            await self.sessions.delete(session_id, tenant)
        except APIError as exc:
            if exc.status != 404:
                raise


def routes(svc: ResponsesService, auth: Auth, retry_after_s: int) -> APIRouter:
    """OpenAI's Responses API over ``svc``; ``auth``: the API-key check."""
    api = APIRouter(responses=ERRORS)

    @api.post("/v1/responses")
    async def create_response(body: ResponseCreateRequest, request: Request, response: Response,
                              tenant: Tenant = Depends(auth)) -> Any:
        """OpenAI's Responses API; a ``previous_response_id`` chain is a session. Streaming sends typed
        events. Like a chat completion, a response that runs answers once placed, naming its worker behind a
        router."""
        run = await svc.start(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
        generation = run.running
        if body.stream:
            headers = {} if generation is None else await placed(request, generation, run.close)
            if isinstance(headers, Response):
                return headers
            return sse_response(run.events(), run.close, retry_after_s, headers, named=True)
        if generation is None:
            return await unless_disconnected(request, run.collect(), run.close)
        return await json_reply(request, response, generation, run.collect(), run.close)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, tenant: Tenant = Depends(auth), stream: bool = Query(False)) -> dict:
        if stream:
            raise APIError(400, "streaming a stored response again is not supported; GET it without stream",
                           param="stream")
        return await svc.retrieve(response_id, tenant)

    @api.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
    async def delete_response(response_id: str, tenant: Tenant = Depends(auth)) -> dict:
        return await svc.delete(response_id, tenant)

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, tenant: Tenant = Depends(auth), limit: int = Query(20),
                                   order: str = Query("desc"), after: str | None = None,
                                   before: str | None = None) -> dict:
        return await svc.input_items(response_id, tenant, limit=limit, order=order, after=after, before=before)

    return api
