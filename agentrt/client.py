"""Python client for the session API: :class:`Client` (blocking) and :class:`AsyncClient`.

    client = agentrt.Client("http://127.0.0.1:8000")
    session = client.sessions.create(system="You are terse.", tools=[...])
    reply = session.send("What is 2+2?")            # a Reply
    for delta in session.send("And 3+3?", stream=True):  # TurnDelta objects
        print(delta.content, end="")
    child = session.fork(); session.close()

HTTP errors raise typed exceptions (:class:`NotFoundError`, :class:`ConflictError`, ...)
that carry the server's OpenAI-shaped error fields.

One implementation: the async classes make every request and decode every answer (streams
through httpx-sse). The blocking classes are a thin layer over them: each call runs the async
one to completion on a private event loop, kept by one daemon thread for all blocking clients
of the process, and waits for it; a blocking stream fetches each delta that way. So both
clients send the same requests and return and raise the same things.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Iterator, TypeVar

import httpx
from httpx_sse import aconnect_sse

T = TypeVar("T")

# ------------------------------------------------------------ errors


class AgentRTError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(AgentRTError):
    """The server could not be reached or the connection broke."""


class APIStatusError(AgentRTError):
    """The server answered with an error status; fields come from its error body."""

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


class BadRequestError(APIStatusError): ...
class AuthenticationError(APIStatusError): ...
class NotFoundError(APIStatusError): ...
class ConflictError(APIStatusError): ...
class RequestTooLargeError(APIStatusError): ...


class RateLimitError(APIStatusError):
    @property
    def retry_after(self) -> float | None:
        value = self.headers.get("retry-after")
        return float(value) if value is not None else None


class InternalServerError(APIStatusError): ...


_BY_STATUS = {400: BadRequestError, 401: AuthenticationError, 404: NotFoundError, 409: ConflictError,
              413: RequestTooLargeError, 422: BadRequestError, 429: RateLimitError}


def _error(status: int, body: Any, headers: dict[str, str] | None = None) -> APIStatusError:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(body)[:500] or "no error body"}
    cls = _BY_STATUS.get(status, InternalServerError if status >= 500 else APIStatusError)
    return cls(status, str(err.get("message")), err.get("type"), err.get("param"), err.get("code"), headers)


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = response.text
    raise _error(response.status_code, body, {k.lower(): v for k, v in response.headers.items()})

# ------------------------------------------------------------ results


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def args(self) -> Any:
        """The arguments parsed; raises ``ValueError`` if the model wrote invalid JSON."""
        return json.loads(self.arguments) if self.arguments.strip() else {}


@dataclass(frozen=True)
class Usage:
    """A turn's token usage. ``cached_tokens_by_tier``: how many of the cached tokens came from the
    device pool and how many were loaded back from the host or disk KV tier (docs/kv_tiers.md)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    total_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Usage":
        """Fields this client knows; a newer server's extra fields are ignored, not an error."""
        return cls(**{k: v for k, v in d.items() if k in _USAGE_FIELDS})


_USAGE_FIELDS = frozenset(f.name for f in fields(Usage))


@dataclass(frozen=True)
class Reply:
    """One recorded turn: the assistant's reply and its token usage."""

    id: str
    session_id: str
    index: int
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    usage: Usage
    replayed: bool
    message: dict[str, Any]

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Reply":
        msg = d["message"]
        calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in msg.get("tool_calls") or []]
        return cls(id=d["id"], session_id=d["session_id"], index=d["index"], content=msg.get("content"),
                   tool_calls=calls, finish_reason=d["finish_reason"], usage=Usage.from_json(d["usage"]),
                   replayed=d.get("replayed", False), message=msg)


@dataclass(frozen=True)
class TurnDelta:
    """A streamed piece of a reply: content text, or one complete tool call."""

    content: str = ""
    tool_call: ToolCall | None = None


@dataclass(frozen=True)
class SessionInfo:
    id: str
    model: str
    system: str | None
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]]
    turns: int
    usage: Usage
    metadata: dict[str, str]
    parent_id: str | None
    expires_at: float
    pin: dict[str, Any] | None
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "SessionInfo":
        return cls(id=d["id"], model=d["model"], system=d.get("system"), tools=d.get("tools"),
                   messages=d["messages"], turns=d["turns"], usage=Usage.from_json(d["usage"]),
                   metadata=d.get("metadata", {}), parent_id=d.get("parent_id"), expires_at=d["expires_at"],
                   pin=d.get("pin"), raw=d)


def tool_result(tool_call_id: str, content: Any) -> dict[str, Any]:
    """A ``role: tool`` message answering the tool call ``tool_call_id``."""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": tool_call_id, "content": text}


def _messages(messages: str | dict | list[dict]) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        return [messages]
    return list(messages)


def _turn_body(messages: Any, stream: bool, turn_id: str | None, options: dict[str, Any]) -> dict[str, Any]:
    return {"messages": _messages(messages), "stream": stream, "turn_id": turn_id or "turn_" + uuid.uuid4().hex,
            **{k: v for k, v in options.items() if v is not None}}


def _create_body(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


# ------------------------------------------------------------ async client: the implementation


class AsyncSessionStream:
    """``async for`` over :class:`TurnDelta`; ``reply`` holds the recorded turn once the stream ends.
    The request is sent when the iteration starts."""

    def __init__(self, http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        self._http, self._path, self._body = http, path, body
        self._reply: Reply | None = None
        self._deltas: AsyncGenerator[TurnDelta, None] | None = None

    @property
    def reply(self) -> Reply | None:
        return self._reply

    def __aiter__(self) -> AsyncIterator[TurnDelta]:
        self._deltas = self._read()
        return self._deltas

    async def _read(self) -> AsyncGenerator[TurnDelta, None]:
        try:
            async with aconnect_sse(self._http, "POST", self._path, json=self._body) as source:
                if source.response.status_code >= 400:
                    await source.response.aread()
                    _raise_for(source.response)
                async for event in source.aiter_sse():
                    delta = self._decode(event.data)
                    if delta is not None:
                        yield delta
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc

    def _decode(self, data: str) -> TurnDelta | None:
        if not data or data == "[DONE]":
            return None
        event = json.loads(data)
        if "error" in event:
            status = {"invalid_request_error": 400, "not_found_error": 404, "conflict_error": 409}
            raise _error(status.get(event["error"].get("type"), 500), event)
        kind = event.get("type")
        if kind == "turn.delta":
            return TurnDelta(content=event["content"])
        if kind == "turn.tool_call":
            return TurnDelta(tool_call=ToolCall(event["id"], event["name"], event["arguments"]))
        if kind == "turn.completed":
            self._reply = Reply.from_json(event["turn"])
        return None

    async def aclose(self) -> None:
        """Stop reading and close the connection (the server then aborts the turn if it still runs)."""
        if self._deltas is not None and not self._deltas.ag_running:  # running: a cancelled read that closes it
            await self._deltas.aclose()

    async def __aenter__(self) -> "AsyncSessionStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


class AsyncSession:
    def __init__(self, client: "AsyncClient", info: SessionInfo) -> None:
        self._client = client
        self.id = info.id
        self.info = info

    async def send(self, messages: str | dict | list[dict], *, stream: bool = False, turn_id: str | None = None,
                   **options: Any) -> Reply | AsyncSessionStream:
        """Append messages and get the reply (or a stream of deltas). Retrying with the same ``turn_id`` is safe."""
        body = _turn_body(messages, stream, turn_id, options)
        path = f"/v1/sessions/{self.id}/turns"
        if stream:
            return AsyncSessionStream(self._client._http, path, body)
        return Reply.from_json(await self._client._request("POST", path, json=body))

    async def refresh(self) -> SessionInfo:
        self.info = SessionInfo.from_json(await self._client._request("GET", f"/v1/sessions/{self.id}"))
        return self.info

    async def fork(self, metadata: dict[str, str] | None = None) -> "AsyncSession":
        data = await self._client._request("POST", f"/v1/sessions/{self.id}/fork", json=_create_body(metadata=metadata))
        return AsyncSession(self._client, SessionInfo.from_json(data))

    async def close(self) -> None:
        """Delete the session on the server (its pinned cache is released)."""
        await self._client._request("DELETE", f"/v1/sessions/{self.id}")


class AsyncSessions:
    def __init__(self, client: "AsyncClient") -> None:
        self._client = client

    async def create(self, *, system: str | None = None, tools: list[dict] | None = None, model: str | None = None,
                     sampling: dict[str, Any] | None = None, metadata: dict[str, str] | None = None,
                     idle_ttl_s: float | None = None, pin_ttl_s: float | None = None) -> AsyncSession:
        body = _create_body(system=system, tools=tools, model=model, sampling=sampling, metadata=metadata,
                            idle_ttl_s=idle_ttl_s, pin_ttl_s=pin_ttl_s)
        return AsyncSession(self._client, SessionInfo.from_json(
            await self._client._request("POST", "/v1/sessions", json=body)))

    async def get(self, session_id: str) -> AsyncSession:
        data = await self._client._request("GET", f"/v1/sessions/{session_id}")
        return AsyncSession(self._client, SessionInfo.from_json(data))

    async def list(self) -> list[SessionInfo]:
        return [SessionInfo.from_json(d) for d in (await self._client._request("GET", "/v1/sessions"))["data"]]


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.sessions = AsyncSessions(self)

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise APIConnectionError(str(exc)) from exc
        _raise_for(response)
        return response.json()

    async def health(self) -> dict[str, Any]:
        return await self._request("GET", "/health")

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._request("GET", "/v1/models"))["data"]]

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

# ------------------------------------------------------------ blocking client: the async one, run to completion

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _forget_loop() -> None:
    """In a forked child: the loop's thread did not come along, so the child starts its own."""
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _run(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` on the blocking clients' event loop (started on first use) and wait for its result."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="agentrt-client", daemon=True).start()
    future = asyncio.run_coroutine_threadsafe(_await(awaitable), _loop)
    try:
        return future.result()
    except BaseException:  # interrupted while waiting (Ctrl-C): stop the call too
        future.cancel()
        raise


class SessionStream:
    """Iterate for :class:`TurnDelta`; ``reply`` holds the recorded turn once the stream ends."""

    def __init__(self, stream: AsyncSessionStream) -> None:
        self._stream = stream

    @property
    def reply(self) -> Reply | None:
        return self._stream.reply

    def __iter__(self) -> Iterator[TurnDelta]:
        deltas = aiter(self._stream)
        try:
            while (delta := _run(anext(deltas, None))) is not None:
                yield delta
        finally:
            self.close()

    def close(self) -> None:
        _run(self._stream.aclose())

    def __enter__(self) -> "SessionStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session:
    """A session of a :class:`Client`: :class:`AsyncSession`'s methods, blocking."""

    def __init__(self, session: AsyncSession) -> None:
        self._async = session

    @property
    def id(self) -> str:
        return self._async.id

    @property
    def info(self) -> SessionInfo:
        return self._async.info

    def send(self, messages: str | dict | list[dict], *, stream: bool = False, turn_id: str | None = None,
             **options: Any) -> Reply | SessionStream:
        """Append messages and get the reply (or a stream of deltas). Retrying with the same ``turn_id`` is safe."""
        result = _run(self._async.send(messages, stream=stream, turn_id=turn_id, **options))
        return SessionStream(result) if stream else result

    def refresh(self) -> SessionInfo:
        return _run(self._async.refresh())

    def fork(self, metadata: dict[str, str] | None = None) -> "Session":
        return Session(_run(self._async.fork(metadata)))

    def close(self) -> None:
        """Delete the session on the server (its pinned cache is released)."""
        _run(self._async.close())


class Sessions:
    def __init__(self, sessions: AsyncSessions) -> None:
        self._async = sessions

    def create(self, *, system: str | None = None, tools: list[dict] | None = None, model: str | None = None,
               sampling: dict[str, Any] | None = None, metadata: dict[str, str] | None = None,
               idle_ttl_s: float | None = None, pin_ttl_s: float | None = None) -> Session:
        return Session(_run(self._async.create(system=system, tools=tools, model=model, sampling=sampling,
                                               metadata=metadata, idle_ttl_s=idle_ttl_s, pin_ttl_s=pin_ttl_s)))

    def get(self, session_id: str) -> Session:
        return Session(_run(self._async.get(session_id)))

    def list(self) -> list[SessionInfo]:
        return _run(self._async.list())


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self._async = AsyncClient(base_url, api_key, timeout)
        self.sessions = Sessions(self._async.sessions)

    def health(self) -> dict[str, Any]:
        return _run(self._async.health())

    def models(self) -> list[str]:
        return _run(self._async.models())

    def close(self) -> None:
        _run(self._async.close())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
