"""The surfaces' HTTP plumbing (``agentrt/api``): the body limit every request passes
(:class:`BodyLimitMiddleware`: 413 past ``max_body_bytes``, and the request counts), the API-key check, replies that start once a generation
is placed (JSON, or a server-sent event stream that ends with ``data: [DONE]``, a ``: ping`` comment
every 15 s; the Responses API's typed events named by their type, the Anthropic Messages API's too with
``ping`` events), and a client that disconnects cancelling its request. Each surface module builds its
routes from these with its service (``routes(...)``); ``agentrt/server.py`` includes them. Not a
surface: it imports none."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from agentrt.core.errors import APIError, from_exception
from agentrt.core.generation import Generation
from agentrt.core.tasks import cancel_and_wait
from agentrt.core.tenants import Tenant, TenantRegistry
from agentrt.metrics import Metrics
from agentrt.protocol import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 500, 503)}
"""The error responses every OpenAI-shaped route may give, for the OpenAPI schema."""

WORKER_HEADER = "x-agentrt-worker"
"""Response header naming the worker that served a generation (behind a router only)."""

Auth = Callable[[Request], Tenant]
"""The API-key check, a FastAPI dependency returning the caller's tenant (:func:`authenticator`)."""


def authenticator(tenants: TenantRegistry) -> Auth:
    """The request's tenant, from its key (``default`` on an open server); 401 otherwise. The key comes
    in ``x-api-key`` (as Anthropic's clients send it) or else as ``Authorization: Bearer``."""
    def auth(request: Request) -> Tenant:
        key = request.headers.get("x-api-key")
        if not key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            key = token.strip() if scheme.lower() == "bearer" else None
        tenant = tenants.authenticate(key)
        if tenant is None:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    return auth


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any], cleanup: Callable[[], Awaitable]) -> Any:
    """Await ``work``; if the client goes away first, cancel it and run ``cleanup``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        # again until it ends: with a cancellation lost inside it (Python 3.11, agentrt/core/tasks.py) the
        # request ran on to its end for nobody, its turn recorded; what it ended with has nobody to go to
        await cancel_and_wait(task, log_exception=False)
        await cleanup()
        return Response(status_code=499)
    return task.result()


def sse_response(chunks: AsyncIterator[dict], close: Callable[[], Awaitable], retry_after_s: int,
                 headers: dict[str, str] | None = None, *, named: bool = False,
                 anthropic: bool = False) -> EventSourceResponse:
    """``chunks`` as ``data: {json}`` events, then ``data: [DONE]``. An exception from ``chunks`` becomes an
    error event (the headers are sent, as OpenAI does). ``close`` runs when the stream ends, however it
    ends: also when the client disconnects before the first chunk. ``headers``: more response headers.
    ``named``: each event also carries ``event: <the chunk's type>`` (an error, ``event: error``) and no
    ``[DONE]`` ends the stream, as the Responses API sends its typed events. ``anthropic``: named, with
    Anthropic's error body and ``event: ping`` keep-alives (the Messages API)."""
    named = named or anthropic

    def event(chunk: dict, name: str) -> str | ServerSentEvent:
        data = json.dumps(chunk, ensure_ascii=False)
        return ServerSentEvent(data, event=name, sep="\n") if named else data

    async def events() -> AsyncIterator[str | ServerSentEvent]:
        try:
            async for chunk in chunks:
                yield event(chunk, chunk.get("type", "message"))
        except Exception as exc:
            error = from_exception(exc, retry_after_s)
            yield event(error.anthropic_body() if anthropic else error.body(), "error")
        finally:
            await close()
        if not named:
            yield "[DONE]"

    ping = (lambda: event({"type": "ping"}, "ping")) if anthropic else None
    return EventSourceResponse(events(), sep="\n", background=BackgroundTask(close), ping_message_factory=ping,
                               headers={"Cache-Control": "no-cache", **(headers or {})})


async def placed(request: Request, generation: Generation, close: Callable[[], Awaitable]
                 ) -> dict[str, str] | Response:
    """Wait until ``generation`` is placed; the response headers that name its worker (none in one
    process), or a 499 response if the client went away first (``close`` has then run). An error
    before placement runs ``close`` and is raised, so the client gets it as a JSON error."""
    try:
        worker = await unless_disconnected(request, generation.placed(), close)
    except BaseException:
        await close()
        raise
    if isinstance(worker, Response):
        return worker
    return {WORKER_HEADER: worker} if worker else {}


async def sse_reply(request: Request, generation: Generation, chunks: AsyncIterator[dict],
                    close: Callable[[], Awaitable], retry_after_s: int, anthropic: bool = False) -> Response:
    """``chunks`` as a stream that starts once ``generation`` is placed (``sse_response``)."""
    headers = await placed(request, generation, close)
    if isinstance(headers, Response):
        return headers
    return sse_response(chunks, close, retry_after_s, headers, anthropic=anthropic)


async def json_reply(request: Request, response: Response, generation: Generation, body: Awaitable[Any],
                     close: Callable[[], Awaitable]) -> Any:
    """``body`` (cancelled, and ``close`` run, if the client goes away first), with the header that names
    the generation's worker set on ``response`` (the route's, whose headers FastAPI sends)."""
    result = await unless_disconnected(request, body, close)
    if not isinstance(result, Response):
        worker = await generation.placed()  # at once: the reply is complete
        if worker:
            response.headers[WORKER_HEADER] = worker
    return result


async def reply(request: Request, response: Response, generation: Generation, stream: bool,
                chunks: Callable[[], AsyncIterator[dict]], whole: Callable[[], Awaitable[Any]],
                retry_after_s: int, anthropic: bool = False) -> Any:
    """A generation's reply on a surface: its event stream (``chunks()``) or its whole body (``whole()``),
    whichever the request asked for (only that one is built)."""
    if stream:
        return await sse_reply(request, generation, chunks(), generation.close, retry_after_s, anthropic=anthropic)
    return await json_reply(request, response, generation, whole(), generation.close)


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes`` (checked on Content-Length, then while reading), and request counts."""

    def __init__(self, app: Any, max_bytes: int, metrics: Metrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is None:
                too_big = APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes",
                                   code="request_too_large")
                return await too_big.response(scope.get("path", ""))(scope, receive, counting_send)
            await self.app(scope, _replay(body, receive), counting_send)
        finally:
            route = scope.get("route")
            self.metrics.count_request(getattr(route, "path", "unmatched"), status["code"])

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b""
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable[[], Awaitable[dict]]:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for the client to disconnect

    return replay
