"""Request and response models of the HTTP API: the OpenAI-compatible endpoints and sessions.

Fields a request model declares are type-checked, and values the server cannot honour are
rejected by the service with a clear message, never silently dropped. Chat Completions and
Completions also keep the fields they do not declare (``model_extra``): the service accepts the
OpenAI and vLLM fields it does not implement only at their neutral values and refuses any other
field (agentrt/core/request_fields.py). The session API's requests (agentrt's own) refuse a field
they do not declare. Parts of a request (a message, a tool) ignore fields they do not know: clients
send back the assistant messages they were given, with fields such as ``refusal`` or ``annotations``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request of agentrt's own API: a field it does not declare is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message; ``content`` is a string, a list of text parts, or null (assistant tool calls)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier turn's reasoning (vLLM's name; templates that keep it)
    reasoning: str | None = None          # the same, as newer vLLM names it


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling parameters as OpenAI names them; shared by chat, completions and session turns."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extensions vLLM also accepts
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    priority: StrictInt | None = None   # vLLM's: lower is scheduled earlier (--scheduling-policy session)
    stop_token_ids: list[StrictInt] | None = None   # vLLM's: these tokens end the reply too
    # vLLM's: a salt for this request's prefix cache, within its tenant's (only requests that send the same
    # salt share cached blocks); a router sends its tenant's salt so to a vllm-kind worker
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")   # checked by agentrt.core.request_fields

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # the conversation, for routing (agentrt/core/affinity.py)
    # vLLM's extension: the chat template's own switches (enable_thinking, reasoning_effort, ...)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, for reasoning models: the chat template's reasoning_effort switch (gpt-oss's)
    reasoning_effort: str | None = None


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: a ``prompt``, or ``messages`` (+ ``tools``) through the chat template."""

    model_config = ConfigDict(extra="allow")   # checked by agentrt.core.request_fields

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="allow")   # checked by agentrt.core.request_fields

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # as in chat completions
    # vLLM's extension: each choice also carries the reply's token ids (a stream's chunks: the new ones).
    # A router reaching this server as a vllm-kind worker asks for them (router/openai_worker.py).
    return_token_ids: bool = False
    # vLLM's: false keeps the special tokens in the reply's text
    skip_special_tokens: bool = True


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agentrt"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------- sessions


class SessionSampling(_Strict):
    """Per-session sampling defaults; a turn may override any of them."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: list[str] | None = None
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    priority: StrictInt | None = None   # lower is scheduled earlier (--scheduling-policy session)
    # structured-output defaults for every turn; a turn's own value wins
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class SessionCreateRequest(_Strict):
    model: str | None = None
    system: str | None = None
    tools: list[Tool] | None = None
    sampling: SessionSampling = Field(default_factory=SessionSampling)
    metadata: dict[str, str] = Field(default_factory=dict)
    idle_ttl_s: float | None = Field(default=None, gt=0)
    pin_ttl_s: float | None = Field(default=None, gt=0)


class TurnRequest(_Strict):
    """Messages to append (user messages or tool results) and how to generate the reply."""

    messages: list[ChatMessage] = Field(min_length=1)
    turn_id: str | None = Field(default=None, min_length=1, max_length=128)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    priority: StrictInt | None = None   # lower is scheduled earlier (--scheduling-policy session)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # the agent's own estimate of its pause after this turn (a long tool run), in seconds: the server pins
    # the session's KV through it when that pays, else sends it to the KV tiers and reads it back before
    # the pause ends (agentrt/core/leases.py)
    expected_pause_s: float | None = Field(default=None, ge=0.0, le=86_400.0)


class ForkRequest(_Strict):
    metadata: dict[str, str] | None = None
    idle_ttl_s: float | None = Field(default=None, gt=0)


class TurnUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TurnResponse(BaseModel):
    id: str
    object: Literal["session.turn"] = "session.turn"
    session_id: str
    index: int
    message: AssistantMessage
    finish_reason: str
    usage: TurnUsage
    replayed: bool = False
    created_at: float


class SessionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class PinInfo(BaseModel):
    id: str
    expires_at: float
    active: bool


class SessionResponse(BaseModel):
    id: str
    object: Literal["session"] = "session"
    model: str
    system: str | None
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    metadata: dict[str, str]
    idle_ttl_s: float
    pin_ttl_s: float | None
    created_at: float
    last_active_at: float
    expires_at: float
    parent_id: str | None
    turns: int
    messages: list[dict[str, Any]]
    usage: SessionUsage
    pin: PinInfo | None


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionResponse]


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True
