"""The one generation path: admission, submission and one running generation.

Chat completions, completions, session turns and a worker's ``/internal/generate`` all go
through :meth:`Generator.start`: the draining check, the server's and the tenant's admission,
and the submission to the engine client (``engine.client.EngineClient``: the engine in this
process, or the router's fleet of workers), where the request is checked
(``engine.client.check_request``), with the request's trace context when it is traced
(``agentrt/tracing.py``). :class:`Generation` turns the engine's outputs into
content deltas and parsed tool calls (or hands them on as they are, for a worker's wire),
records TTFT and TPOT, and releases its admission slot exactly once, however it ends
(finished, failed, or abandoned by a client that went away). The conversions every surface shares are
here too: request messages to the chat template's dicts (:func:`message_dicts`), the template switches a
request may set (:func:`template_kwargs`), parsed tool calls back to OpenAI's dicts (:func:`tool_call_dicts`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine.tokenizer import ToolCall, content_text, render_chat_prompt
from engine.client import EngineClient, OutputStream, SessionHint, StructuredOutput
from engine.parsers import (OutputParser, constrained_call_format, control_token_texts, detect,
                            needs_special_tokens)
from engine.types import (CLOSED_BY_BUDGET, EngineOverloaded, InvalidRequest, RequestOutput, SamplingParams,
                          SchedulingKey, TokenLogprob)

from agentrt import tracing
from agentrt.config import ServingSettings
from agentrt.core.errors import APIError, bad_request, draining, from_exception, not_found, overloaded
from agentrt.metrics import Metrics
from agentrt.core.leases import KVLeases, LeasePolicy
from agentrt.core.tenants import Tenant, TenantLimiter, TenantLimits, retry_after
from agentrt.protocol import ChatMessage

log = logging.getLogger(__name__)

@dataclass
class Delta:
    """New output of one step: content text, reasoning text, finished tool calls, logprobs of new tokens."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Result:
    """A finished generation (``stop_sequence``: the stop string that ended it, if one did;
    ``closed_by_budget``: constrained output that the engine closed early to fit ``max_tokens``,
    its stop reason ``engine.types.CLOSED_BY_BUDGET``)."""

    text: str
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    stop_sequence: str | None = None
    closed_by_budget: bool = False
    reasoning: str | None = None  # split off by the reasoning parser (None: none)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # {"device", "host", "disk"}
    ttft_s: float | None = None  # from the request parsed to its first token (None: no token)
    tpot_s: float | None = None  # mean time per output token after the first (None: fewer than two)
    in_slo: bool = False  # met the server's latency SLO (``Generator.meets_slo``)


class Generation:
    """One request running in the engine. Iterate :meth:`deltas` (content and tool calls) or
    :meth:`outputs` (the engine's outputs as they are) once, or call :meth:`collect`. ``prompt_tokens``
    and ``cached_tokens`` are the engine's counts as of its latest output (0 before the first)."""

    def __init__(self, generator: "Generator", stream: OutputStream, request_id: str, *,
                 parser: OutputParser | None, parallel_tool_calls: bool, want_logprobs: bool, started_at: float,
                 tenant: Tenant | None = None, reservation: Any = None, affinity_ttl_s: float | None = None,
                 session_id: str | None = None) -> None:
        self.gen = generator
        self.affinity_ttl_s = affinity_ttl_s  # its lease as its conversation's latest turn (Generator.start)
        self.session_id = session_id  # the session or conversation it is a turn of (None: none)
        self.tenant = tenant
        self._reservation = reservation
        self.request_id = request_id
        self._stream = stream
        self._parser = parser
        self._parallel = parallel_tool_calls
        self._want_logprobs = want_logprobs
        self._started_at = started_at
        self._first_token_at: float | None = None
        self._text: list[str] = []
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._closed = False
        self.prompt_tokens = self.cached_tokens = 0
        self.result: Result | None = None

    @property
    def token_ids(self) -> list[int]:
        """The reply's token ids so far (the engine's outputs observed up to now)."""
        return self._token_ids

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs, the last one finished (an error or abort is an output here, not an
        exception: a worker hands them on to its router as they are)."""
        try:
            async for out in self._stream:
                self._observe(out)
                if out.finished and out.finish_reason not in ("error", "abort"):
                    self._record(out)
                elif out.finished and out.finish_reason == "error":  # a failed request missed its SLO
                    self.gen.metrics.observe_slo(False)
                yield out
                if out.finished:
                    return
            raise APIError(503, "the engine stopped before the request finished", type="server_error")
        finally:
            await self.close()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas until the request finishes; raises :class:`APIError` if the engine failed it."""
        async for out in self.outputs():
            delta = self._parse(out)
            if delta.content or delta.reasoning or delta.tool_calls or delta.logprobs:
                yield delta
            if out.finished:
                tail = self._finish(out)
                if tail.content or tail.reasoning or tail.tool_calls:
                    yield tail

    async def collect(self) -> Result:
        async for _ in self.deltas():
            pass
        if self.result is None:
            raise APIError(503, "the engine stopped before the request finished", type="server_error")
        return self.result

    async def placed(self) -> str | None:
        """Wait until where the request runs is settled and return the worker's id behind a router
        (``None`` in one process, at once): ``OutputStream.placed``. Errors before that are raised
        here, and the caller closes the generation."""
        return await self._stream.placed()

    async def close(self) -> None:
        """Abort the request if it is still running and free its admission slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.gen.release()
        if self.result is not None:  # counted here, once the tool calls (if any) are known
            self.gen.metrics.observe_finished(self.result)
            self.gen.metrics.observe_slo(self.result.in_slo)
        try:  # aborts a running request; a finished one's stream lets go of what it holds (a worker's response)
            await self._stream.aclose()
        finally:  # the tenant's share is freed however the abort went (the release may await Redis)
            if self.tenant is not None and self._reservation is not None:
                used = self.result.prompt_tokens + self.result.completion_tokens if self.result else \
                    len(self._token_ids)
                await self.gen.tenant_limits.release(self.tenant, self._reservation, used)

    def _observe(self, out: RequestOutput) -> None:
        if out.token_ids and self._first_token_at is None:
            self._first_token_at = time.monotonic()
            self.gen.metrics.observe_ttft(self._first_token_at - self._started_at)
            # the recompute cost the lease policy weighs: prompt tokens computed before the first token
            self.gen.leases.policy.observe_prefill(out.prompt_tokens - out.cached_tokens,
                                                   self._first_token_at - self._started_at)
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        self._token_ids.extend(out.token_ids)
        self._text.append(out.text)
        if self._want_logprobs and out.logprobs:
            self._logprobs.extend(out.logprobs)

    def _parse(self, out: RequestOutput) -> Delta:
        logprobs = out.logprobs if self._want_logprobs else None
        if self._parser is None:
            self._content.append(out.text)
            return Delta(content=out.text, logprobs=logprobs)
        delta = self._delta(self._parser.push(out.text))
        delta.logprobs = logprobs
        return delta

    def _delta(self, events: list) -> Delta:
        """The parser's events as one delta (content, reasoning, calls), kept for the result."""
        delta = Delta(content="".join(v for k, v in events if k == "content"),
                      reasoning="".join(v for k, v in events if k == "reasoning"),
                      tool_calls=self._take([v for k, v in events if k == "call"]))
        self._content.append(delta.content)
        self._reasoning.append(delta.reasoning)
        return delta

    def _take(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self._parallel:
            calls = calls[:max(0, 1 - len(self._calls))]
        self._calls.extend(calls)
        return calls

    def _finish(self, out: RequestOutput) -> Delta:
        """The parser's tail; raises for a failed request. :meth:`outputs` recorded the result with the
        raw text; its content, tool calls and finish reason are settled here."""
        tail = Delta()
        if self._parser is not None:  # a reply cut by max_tokens: a call it cut is no call
            tail = self._delta(self._parser.finish(truncated=out.finish_reason == "length"))
        if out.finish_reason in ("error", "abort"):
            raise APIError(500 if out.finish_reason == "error" else 503,
                           f"generation {out.finish_reason}ed: {out.error or 'the engine ended the request'}",
                           type="server_error")
        content: str | None = "".join(self._content)
        if self._calls:
            content = content.strip() or None  # OpenAI: content is null next to tool calls
        reason = "tool_calls" if (self._calls and out.finish_reason == "stop") else out.finish_reason
        self.result.content, self.result.tool_calls = content, list(self._calls)
        self.result.reasoning = "".join(self._reasoning) or None
        self.result.finish_reason = reason or "stop"
        if self.affinity_ttl_s is not None:  # its lease over the pause after it (a tool run); a demoted
            # prefix is read back by the conversation's next request itself (no session sweep here)
            self.gen.leases.hold_for_pause(self.request_id, self.session_id, tool_call=reason == "tool_calls",
                                           expected_pause_s=None, ttl_s=self.affinity_ttl_s)
        return tail

    def _record(self, out: RequestOutput) -> None:
        now = time.monotonic()
        ttft = tpot = None
        if self._first_token_at is not None:
            ttft = self._first_token_at - self._started_at
            if out.completion_tokens > 1:
                tpot = (now - self._first_token_at) / (out.completion_tokens - 1)
                self.gen.metrics.observe_tpot(tpot)
        self.gen.metrics.observe_prompt(out.prompt_tokens, out.cached_tokens)
        text = "".join(self._text)
        closed = out.stop_reason == CLOSED_BY_BUDGET
        self.result = Result(
            text=text, content=text, tool_calls=[], finish_reason=out.finish_reason or "stop",
            prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
            cached_tokens_by_tier=dict(out.cached_tokens_by_tier),
            completion_tokens=out.completion_tokens, token_ids=list(self._token_ids),
            logprobs=self._logprobs if self._want_logprobs else None,
            stop_sequence=out.stop_reason if isinstance(out.stop_reason, str) and not closed else None,
            closed_by_budget=closed, ttft_s=ttft, tpot_s=tpot,
            in_slo=self.gen.meets_slo(ttft, tpot))


# ------------------------------------------------------------ messages in, tool calls out
# the conversions every surface shares: request messages to the chat template's dicts (``message_dicts``),
# parsed tool calls back to OpenAI's dicts (``tool_call_dicts``), and the template switches a request may
# set (``template_kwargs``)

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


REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def reasoning_effort(effort: str | None, chat_template: str | None, param: str) -> dict[str, Any] | None:
    """A request's reasoning effort (Chat Completions' ``reasoning_effort``, Responses' ``reasoning.effort``)
    as the chat template's switches; None for none asked.

    * A template with a ``reasoning_effort`` switch (gpt-oss): one of ``REASONING_EFFORTS``; 'none' is a 400
      (such a model always reasons: its template's default is not 'none').
    * A template with an ``enable_thinking`` switch (Qwen3, GLM): 'none' turns reasoning off
      (``enable_thinking: false``); an effort level is a 400 (the switch is on or off).
    * Any other template: 'none' asks for nothing (the model has no switch to turn); a level is a 400."""
    template = chat_template or ""
    if effort is None:
        return None
    if "reasoning_effort" in template:
        if effort == "none":
            raise bad_request(f"{param} 'none': this model always reasons; its efforts are "
                              f"{', '.join(REASONING_EFFORTS)}", param=param)
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"{param} must be {', '.join(REASONING_EFFORTS[:-1])} or {REASONING_EFFORTS[-1]}, "
                              f"got {effort!r}", param=param)
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:
        if effort == "none":
            return {"enable_thinking": False}
        raise bad_request(f"{param} {effort!r}: this model's chat template switches reasoning on or off "
                          "(enable_thinking), with no effort levels: send 'none' to turn it off", param=param)
    if effort == "none":
        return None
    raise bad_request(f"{param} {effort!r}: this model's chat template has no reasoning effort (only 'none')",
                      param=param)


def chat_switches(kwargs: dict[str, Any] | None, effort: str | None, chat_template: str | None) -> dict[str, Any] | None:
    """The chat template's switches of a chat completion: its ``chat_template_kwargs`` (:func:`template_kwargs`)
    with its ``reasoning_effort`` (:func:`reasoning_effort`) added; 400 when the two name different efforts."""
    kwargs = template_kwargs(kwargs)
    switch = reasoning_effort(effort, chat_template, "reasoning_effort")
    if switch is None:
        return kwargs
    for name, value in switch.items():
        if (kwargs or {}).get(name, value) != value:
            raise bad_request(f"reasoning_effort and chat_template_kwargs.{name} differ; send one",
                              param="reasoning_effort")
    return {**(kwargs or {}), **switch}


def request_cache_salt(tenant: Tenant | None, salt: str | None) -> str | None:
    """The engine cache salt of a request that names its own (vLLM's ``cache_salt``): the tenant's salt
    narrowed by it, so a request shares cached blocks only with its tenant's requests of the same salt.
    None when it names none (``Generator.start`` then salts by the tenant alone)."""
    if salt is None:
        return None
    return (tenant.cache_salt if tenant is not None else "") + "\x1frequest:" + salt


def tool_call_dicts(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class Generator:
    """Submits requests to the engine client under the server's admission limit and the tenants'
    (``tenant_limits``: this process's :class:`TenantLimits` unless another :class:`TenantLimiter` is
    given, such as the router's Redis one, shared by its replicas)."""

    def __init__(self, engine: EngineClient, llm: Any, config: ServingSettings, metrics: Metrics,
                 tenant_limits: TenantLimiter | None = None) -> None:
        self.engine = engine
        self.tokenizer = llm.tokenizer
        self.max_model_len = int(llm.max_model_len)
        self.model_name = llm.model_id
        self.config = config
        self.metrics = metrics
        self.in_flight = 0
        self.draining = False  # set by a worker's drain: new generations get 503 worker_draining
        self.tenant_limits = tenant_limits if tenant_limits is not None else TenantLimits()
        # the KV leases of session turns and affinity-keyed conversations, and the policy of their TTLs
        self.leases = KVLeases(engine, LeasePolicy(config, stats=lambda: self.engine.stats()), metrics,
                               config.max_sessions)
        detected = detect(self.tokenizer.chat_template)
        self.tool_parser = config.tool_call_parser or detected[0]
        self.reasoning_parser = config.reasoning_parser or (None if config.tool_call_parser else detected[1])
        # constrained calls (tool_choice required / named, strict schemas) in this syntax
        self.call_format = constrained_call_format(self.tool_parser, control_token_texts(self.tokenizer.hf))
        log.info("tool-call parser %s, reasoning parser %s (%s); constrained calls in %s syntax", self.tool_parser,
                 self.reasoning_parser,
                 "set" if config.tool_call_parser or config.reasoning_parser else "chosen from the chat template",
                 self.call_format)

    def meets_slo(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """A generation met the latency SLO: its first token within ``slo_ttft_s`` and, when it wrote more
        than one, its mean time per output token within ``slo_tpot_s``. No token at all is a miss."""
        return ttft_s is not None and ttft_s <= self.config.slo_ttft_s and \
            (tpot_s is None or tpot_s <= self.config.slo_tpot_s)

    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.model_name:
            raise not_found(f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                            param="model", code="model_not_found")
        return self.model_name

    def sampling_params(self, fields: dict[str, Any], prompt_len: int,
                        logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from OpenAI-named fields (``None`` values mean "not given"). They are checked
        with the prompt when submitted (``engine.client.check_request``), not here."""
        for name in ("presence_penalty", "frequency_penalty"):
            if fields.get(name):
                raise bad_request(f"{name} is not supported by this server (only 0)", param=name)
        max_tokens = fields.get("max_completion_tokens") or fields.get("max_tokens")
        if max_tokens is None:
            max_tokens = max(1, min(self.config.default_max_tokens, self.max_model_len - prompt_len))
        stop = fields.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        temperature = fields.get("temperature")
        top_p = fields.get("top_p")
        priority = fields.get("priority")
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
                              top_p=1.0 if top_p is None else top_p, seed=fields.get("seed"), stop=stop,
                              stop_token_ids=list(fields.get("stop_token_ids") or []),
                              logprobs=logprobs, top_k=fields.get("top_k") or 0,
                              ignore_eos=bool(fields.get("ignore_eos")), priority=0 if priority is None else priority)

    def check_defaults(self, fields: dict[str, Any], options: StructuredOutput) -> None:
        """400 now for sampling defaults or structured-output options no request could run with
        (a session's, checked when it is created rather than at its first turn)."""
        try:
            self.sampling_params(fields, 0).validate()
        except InvalidRequest as exc:
            raise bad_request(str(exc)) from None
        self.constraint(options)

    def constraint(self, options: StructuredOutput) -> Any:
        """What the engine client takes for these options (None: free output); 400 for options it refuses."""
        try:
            return self.engine.constraint(options)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    async def start_chat(self, messages: list[dict[str, Any]], fields: dict[str, Any], options: StructuredOutput, *,
                         logprobs: int | None = None, lease_ttl_s: float | None = None, started_at: float | None = None,
                         session: SessionHint | None = None, tenant: Tenant | None = None,
                         template_kwargs: dict[str, Any] | None = None, cache_salt: str | None = None) -> Generation:
        """A chat request (a chat completion or a session turn): the messages rendered with
        ``options.tools`` (and the template's switches, ``template_kwargs``), sampled by the OpenAI-named
        ``fields``, constrained by ``options``; its tool calls are parsed unless ``tool_choice`` is
        "none", and its reasoning split off when the model has a reasoning parser. ``cache_salt``: as
        :meth:`start` takes it."""
        text = self.chat_text(messages, options.tools, template_kwargs)
        prompt = self.tokenizer.encode(text)
        params = self.sampling_params(fields, len(prompt), logprobs=logprobs)
        options, tool_parser = self._tool_format(options)
        parser = None
        if tool_parser is not None or self.reasoning_parser is not None:
            parser = OutputParser(tool_parser, self.reasoning_parser, prompt_text=text, tools=options.tools)
            params.skip_special_tokens = not needs_special_tokens(tool_parser, self.reasoning_parser)
        constraint = self.constraint(options)
        return await self.start(prompt, params, constraint=constraint, parser=parser,
                                parallel_tool_calls=options.parallel_tool_calls is not False, lease_ttl_s=lease_ttl_s,
                                started_at=started_at, session=session, tenant=tenant, cache_salt=cache_salt)

    def _tool_format(self, options: StructuredOutput) -> tuple[StructuredOutput, str | None]:
        """(the constraint's options, the tool-call parser) for a request. Where the family's call syntax
        is text (``self.call_format`` is its parser: Hermes, Llama 3 JSON, Qwen3-Coder, GLM-4.5), calls
        are constrained in it, forced or ``auto`` (engine/grammar/call_syntax.py). Where its markers are
        control tokens, a forced call (``tool_choice`` required or named) is written and parsed as
        Hermes; with ``auto`` the model writes its own format, unconstrained, and a strict schema, which
        no grammar can then enforce, is refused."""
        if not options.tools or options.tool_choice == "none":
            return options, None
        if self.call_format == (self.tool_parser or "hermes"):
            return dataclasses.replace(options, call_format=self.call_format), self.call_format
        if options.tool_choice not in (None, "auto"):
            return dataclasses.replace(options, call_format="hermes"), "hermes"
        strict = [t for t in options.tools if (t.get("function") or {}).get("strict")]
        if strict:
            raise bad_request(f"strict tool schemas need constrained calls, and this model calls tools in the "
                              f"{self.tool_parser!r} format, whose markers are control tokens a grammar cannot "
                              f"write: set tool_choice to 'required' or a function (written in Hermes syntax)",
                              param="tools")
        return dataclasses.replace(options, tool_choice="none"), self.tool_parser

    def chat_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text :meth:`start_chat` submits for these messages and tools; 400 if they cannot be rendered."""
        try:
            return render_chat_prompt(self.tokenizer, messages, tools, add_generation_prompt, template_kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The token ids :meth:`start_chat` submits for these messages and tools; 400 if they cannot be rendered."""
        return self.tokenizer.encode(self.chat_text(messages, tools, template_kwargs))

    async def start(self, prompt_ids: list[int], params: SamplingParams, *, constraint: Any = None,
                    parser: OutputParser | None = None, parallel_tool_calls: bool = True,
                    lease_ttl_s: float | None = None,
                    request_id: str | None = None, started_at: float | None = None,
                    session: SessionHint | None = None, tenant: Tenant | None = None,
                    cache_salt: str | None = None, key: SchedulingKey | None = None) -> Generation:
        """Admit and submit one request; raises 429 past the server's or the tenant's limits, 400 if the
        engine refuses, 503 ``worker_draining`` once draining. The tenant's cache salt keeps its
        prefix cache apart from other tenants' (``cache_salt``: given by a router for a worker, or
        :func:`request_cache_salt`'s for a request that names its own).

        ``lease_ttl_s``: acquire a KV lease on the finished sequence (agentrt/core/leases.py). A request that
        names its conversation (``session.remember``: an affinity key) and asks for no lease of its own is
        that conversation's latest turn, when ``affinity_turns`` is on: it gets the policy's lease
        (``LeasePolicy.affinity_ttl``; over a tool pause, ``KVLeases.hold_for_pause``), the engine holds
        its next step for the agent's return as it does for a session turn, and the conversation's next
        request releases it.

        ``key``: whom the engine's scheduler serves the request for (a worker passes the router's); by
        default the session (or conversation) and the tenant, with its weight (:meth:`scheduling_key`)."""
        affinity_ttl = self.leases.policy.affinity_ttl(lease_ttl_s, session)
        if affinity_ttl is not None:
            lease_ttl_s = affinity_ttl
        if key is None:
            key = self.scheduling_key(session, tenant)
        reservation = await self._admit(key, tenant, len(prompt_ids) + params.max_tokens)
        request_id = request_id or "req-" + uuid.uuid4().hex
        if cache_salt is None:
            cache_salt = tenant.cache_salt if tenant is not None else ""
        if session is not None:  # the end of a tool pause, if the session's last reply called a tool
            self.leases.policy.turn_started(session.session_id)
        trace = tracing.current()  # the request's server span (None: not traced)
        if trace is not None:
            tracing.annotate(trace, {"agentrt.request_id": request_id,
                                     "agentrt.tenant": tenant.name if tenant else None})
        try:
            stream = self.engine.submit(prompt_ids, params, request_id, constraint=constraint, lease_ttl_s=lease_ttl_s,
                                        cache_salt=cache_salt, session=session, trace=trace, key=key)
        except BaseException as exc:
            self.release()
            if reservation is not None:
                await self.tenant_limits.release(tenant, reservation, 0)
            raise self._submit_error(exc) from None
        if affinity_ttl is not None:  # this request now holds the conversation's prefix: its last lease is done
            self.leases.follow(session.session_id, request_id)
        return Generation(self, stream, request_id, parser=parser,
                          parallel_tool_calls=parallel_tool_calls, want_logprobs=params.logprobs is not None,
                          started_at=started_at if started_at is not None else time.monotonic(),
                          tenant=tenant, reservation=reservation, affinity_ttl_s=affinity_ttl,
                          session_id=session.session_id if session is not None else None)

    async def _admit(self, key: SchedulingKey, tenant: Tenant | None, tokens: int) -> Any:
        """Take a server-wide slot, then the tenant's share of ``tokens`` (its reservation, None without a
        tenant): 503 ``worker_draining`` once draining, 429 past either limit (nothing held then)."""
        if self.draining:  # checked here, next to in_flight, so nothing slips past a drain waiting for 0
            raise draining(self.config.retry_after_s)
        self._admit_concurrency(key)
        # Hold the server-wide slot across the tenant admission (which may await Redis), so requests
        # admitted meanwhile cannot push the server past its limit.
        self.in_flight += 1
        self.metrics.set_in_flight(self.in_flight)
        try:
            return await self._admit_tenant(tenant, tokens)
        except BaseException:
            self.release()
            raise

    def _admit_concurrency(self, key: SchedulingKey) -> None:
        """429 past ``max_concurrent_requests`` generations in flight; a request that does not continue a
        started session (``key.continuing``) only up to ``1 - concurrency_reserve`` of them, so later
        turns of running agents get in before new sessions do."""
        limit, why = self.config.max_concurrent_requests, ""
        reserve = self.config.concurrency_reserve
        if reserve > 0 and not key.continuing:
            limit = max(1, int(limit * (1 - reserve)))
            why = f" for a new session ({reserve:.0%} of them are kept for later turns of started sessions)"
        if self.in_flight >= limit:
            raise overloaded(f"the server is at its limit of {limit} concurrent requests{why}; retry later",
                             self.config.retry_after_s)

    def scheduling_key(self, session: SessionHint | None, tenant: Tenant | None) -> SchedulingKey:
        """The request's session and tenant as the engine's scheduler orders them. A session turn whose
        session has history, or a conversation this server already leased a request of, continues a
        started session."""
        continuing = session is not None and (session.continuing or
                                              (session.remember and self.leases.continues(session.session_id)))
        return SchedulingKey(session=session.session_id if session is not None else "",
                             tenant=tenant.name if tenant is not None else "",
                             weight=tenant.weight if tenant is not None else 1.0, continuing=continuing)

    async def _admit_tenant(self, tenant: Tenant | None, tokens: int) -> Any:
        """Reserve the tenant's share (None: no tenant); 429 with Retry-After past its limits."""
        if tenant is None:
            return None
        reservation, wait_s = await self.tenant_limits.admit(tenant, tokens)
        if reservation is None:
            if tenant.max_concurrent_requests is not None and \
                    await self.tenant_limits.in_flight(tenant.name) >= tenant.max_concurrent_requests:
                message = (f"tenant '{tenant.name}' is at its limit of {tenant.max_concurrent_requests} "
                           "concurrent requests; retry later")
            else:
                message = (f"tenant '{tenant.name}' is over its limit of {tenant.tokens_per_minute} tokens per "
                           f"minute (this request needs up to {tokens}); retry later")
            raise APIError(429, message, code="tenant_rate_limited", headers={"Retry-After": retry_after(wait_s)})
        return reservation

    def _submit_error(self, exc: BaseException) -> BaseException:
        """What the client sees when the engine refused a request at submission."""
        if isinstance(exc, EngineOverloaded):
            return from_exception(exc, self.config.retry_after_s)
        if isinstance(exc, InvalidRequest):
            return bad_request(str(exc), param=exc.param)
        if isinstance(exc, RuntimeError):
            return APIError(503, f"the engine is not accepting requests: {exc}", type="server_error")
        return exc

    def release(self) -> None:
        self.in_flight -= 1
        self.metrics.set_in_flight(self.in_flight)
