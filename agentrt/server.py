"""The HTTP app: thin routes over the services kept in ``app.state``.

``create_app(config, engine=None)`` builds the app around an ``engine.LLMEngine`` (loaded
from ``config`` when not given), runs it in an ``AsyncEngine`` thread, and on shutdown
drains the engine. Streams are server-sent events (sse-starlette) ending with ``data: [DONE]``
(the Responses API's typed events instead go out named by their type, without it), with a
``: ping`` comment every 15 s; a client that disconnects cancels its stream, which aborts the
engine request and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.background import BackgroundTask

from engine.client import EngineClient

from agentrt.config import ServerConfig
from agentrt.debug import install_task_dump
from agentrt.errors import APIError, from_exception, install_handlers
from agentrt.generation import Generator
from agentrt.metrics import CONTENT_TYPE, Metrics
from agentrt.protocol import (ChatCompletionRequest, CompletionRequest, ErrorResponse, ForkRequest, ModelList,
                              SessionCreateRequest, SessionDeleted, SessionList, SessionResponse, TurnRequest,
                              TurnResponse)
from agentrt.responses_api import ResponseCreateRequest, ResponseDeleted, ResponsesService
from agentrt.service import OpenAIService
from agentrt.sessions import SessionManager, TurnRun
from agentrt.store import InMemorySessionStore, SessionStore
from agentrt.tenants import Tenant, TenantLimiter, TenantRegistry

log = logging.getLogger("agentrt.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 500, 503)}


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
                return await too_big.response()(scope, receive, counting_send)
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


def _auth(request: Request) -> Tenant:
    """The request's tenant, from its bearer key (``default`` on an open server); 401 otherwise."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    tenant = request.app.state.tenants.authenticate(token.strip() if scheme.lower() == "bearer" else None)
    if tenant is None:
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return tenant


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any], cleanup: Callable[[], Awaitable]) -> Any:
    """Await ``work``; if the client goes away first, cancel it and run ``cleanup``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        await cleanup()
        return Response(status_code=499)
    return task.result()


def sse_response(chunks: AsyncIterator[dict], close: Callable[[], Awaitable], retry_after_s: int, *,
                 named: bool = False) -> EventSourceResponse:
    """``chunks`` as ``data: {json}`` events, then ``data: [DONE]``. An exception from ``chunks`` becomes an
    error event (the headers are sent, as OpenAI does). ``close`` runs when the stream ends, however it
    ends: also when the client disconnects before the first chunk. ``named``: each event also carries
    ``event: <the chunk's type>`` (the error, ``event: error``), and no ``[DONE]`` ends the stream, as
    the Responses API sends its typed events."""
    def event(data: dict, name: str) -> str | dict[str, str]:
        text = json.dumps(data, ensure_ascii=False)
        return {"data": text, "event": name} if named else text

    async def events() -> AsyncIterator[str | dict[str, str]]:
        try:
            async for chunk in chunks:
                yield event(chunk, chunk.get("type", "message"))
        except Exception as exc:
            yield event(from_exception(exc, retry_after_s).body(), "error")
        finally:
            await close()
        if not named:
            yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", background=BackgroundTask(close),
                               headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------ routes

api = APIRouter(responses=_ERRORS)
open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    if state.stopping:
        return JSONResponse({"status": "stopping"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.generator.model_name})


@open_routes.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


@api.get("/v1/models", response_model=ModelList, dependencies=[Depends(_auth)])
async def models(request: Request) -> dict:
    return request.app.state.openai.models()


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           tenant: Tenant = Depends(_auth)) -> Any:
    svc: OpenAIService = request.app.state.openai
    generation = await svc.start_chat(body, tenant)
    if body.stream:
        return sse_response(svc.chat_chunks(body, generation), generation.close,
                            request.app.state.config.retry_after_s)
    return await _unless_disconnected(request, svc.chat(body, generation), generation.close)


@api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(_auth)) -> Any:
    svc: OpenAIService = request.app.state.openai
    generation = await svc.start_completion(body, tenant)
    if body.stream:
        return sse_response(svc.completion_chunks(body, generation), generation.close,
                            request.app.state.config.retry_after_s)
    return await _unless_disconnected(request, svc.completion(body, generation), generation.close)


@api.post("/v1/sessions", response_model=SessionResponse, status_code=201)
async def create_session(body: SessionCreateRequest, request: Request, tenant: Tenant = Depends(_auth)) -> dict:
    sessions: SessionManager = request.app.state.sessions
    return sessions.view(await sessions.create(body, tenant))


@api.get("/v1/sessions", response_model=SessionList)
async def list_sessions(request: Request, tenant: Tenant = Depends(_auth)) -> dict:
    sessions: SessionManager = request.app.state.sessions
    now = time.time()
    records = [r for r in await sessions.store.list(tenant=tenant.name) if r.expires_at > now]
    return {"object": "list", "data": [sessions.view(r) for r in records]}


@api.get("/v1/sessions/{session_id}", response_model=SessionResponse)
async def get_session(session_id: str, request: Request, tenant: Tenant = Depends(_auth)) -> dict:
    sessions: SessionManager = request.app.state.sessions
    return sessions.view(await sessions.get(session_id, tenant))


@api.delete("/v1/sessions/{session_id}", response_model=SessionDeleted)
async def delete_session(session_id: str, request: Request, tenant: Tenant = Depends(_auth)) -> dict:
    await request.app.state.sessions.delete(session_id, tenant)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@api.post("/v1/sessions/{session_id}/fork", response_model=SessionResponse, status_code=201)
async def fork_session(session_id: str, request: Request, body: ForkRequest | None = None,
                       tenant: Tenant = Depends(_auth)) -> dict:
    sessions: SessionManager = request.app.state.sessions
    return sessions.view(await sessions.fork(session_id, body or ForkRequest(), tenant))


@api.post("/v1/sessions/{session_id}/turns", response_model=TurnResponse)
async def session_turn(session_id: str, body: TurnRequest, request: Request,
                       tenant: Tenant = Depends(_auth)) -> Any:
    """Append messages and generate the reply. Streaming sends ``turn.delta`` events, then ``turn.completed``."""
    sessions: SessionManager = request.app.state.sessions
    started = await sessions.start_turn(session_id, body, tenant)
    if not isinstance(started, TurnRun):  # a retried turn id: the recorded reply, nothing appended
        sessions.gen.metrics.turns.labels("replayed").inc()
        view = sessions.turn_view(session_id, started, replayed=True)
        if body.stream:
            return sse_response(_one_event({"type": "turn.completed", "turn": view}), _nothing, 1)
        return view
    if body.stream:
        return sse_response(_turn_events(session_id, started), started.close,
                            request.app.state.config.retry_after_s)

    async def run() -> dict:
        return sessions.turn_view(session_id, await started.run())

    return await _unless_disconnected(request, run(), started.close)


async def _turn_events(session_id: str, run: TurnRun) -> AsyncIterator[dict]:
    index = 0
    async for d in run.deltas():
        if d.content:
            yield {"type": "turn.delta", "content": d.content}
        for call in d.tool_calls:
            yield {"type": "turn.tool_call", "index": index, "id": call.id, "name": call.name,
                   "arguments": call.arguments}
            index += 1
    yield {"type": "turn.completed", "turn": SessionManager.turn_view(session_id, run.turn)}


@api.post("/v1/responses")
async def create_response(body: ResponseCreateRequest, request: Request, tenant: Tenant = Depends(_auth)) -> Any:
    """OpenAI's Responses API; a ``previous_response_id`` chain is a session. Streaming sends typed events."""
    svc: ResponsesService = request.app.state.responses
    run = await svc.start(body, tenant)
    if body.stream:
        return sse_response(run.events(), run.close, request.app.state.config.retry_after_s, named=True)
    return await _unless_disconnected(request, run.collect(), run.close)


@api.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, tenant: Tenant = Depends(_auth),
                       stream: bool = Query(False)) -> dict:
    if stream:
        raise APIError(400, "streaming a stored response again is not supported; GET it without stream",
                       param="stream")
    return await request.app.state.responses.retrieve(response_id, tenant)


@api.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, request: Request, tenant: Tenant = Depends(_auth)) -> dict:
    return await request.app.state.responses.delete(response_id, tenant)


@api.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request, tenant: Tenant = Depends(_auth),
                               limit: int = Query(20), order: str = Query("desc"), after: str | None = None,
                               before: str | None = None) -> dict:
    return await request.app.state.responses.input_items(response_id, tenant, limit=limit, order=order,
                                                         after=after, before=before)


async def _one_event(event: dict) -> AsyncIterator[dict]:
    yield event


async def _nothing() -> None:
    return None


# ------------------------------------------------------------ app


def create_app(config: ServerConfig, engine: Any = None, store: SessionStore | None = None) -> FastAPI:
    """The app around ``engine`` (an ``engine.LLMEngine``; built from ``config`` when None)."""
    from engine import AsyncEngine, LLMEngine

    llm = engine if engine is not None else LLMEngine(config.engine_config())
    return assemble_app(config, AsyncEngine(llm), llm, store)


def assemble_app(config: ServerConfig, backend: EngineClient, model: Any, store: SessionStore | None = None,
                 title: str = "agentrt", tenant_limits: TenantLimiter | None = None) -> FastAPI:
    """The app over ``backend``, an ``engine.client.EngineClient``: the in-process ``engine.AsyncEngine``
    or the router's remote engine. ``model`` gives ``tokenizer``, ``max_model_len`` and ``model_id``.
    ``tenant_limits``: where tenants' concurrency and tokens per minute are counted (None: in this process)."""
    # A SIGTERM must not cut streams: uvicorn's graceful shutdown lets them finish (sse-starlette's default
    # cancels every stream of the process as soon as any server in it is told to exit).
    AppStatus.disable_automatic_graceful_drain()
    tenants = TenantRegistry.from_config(config.tenants_file, config.api_keys)
    metrics = Metrics()
    metrics.attach_engine(backend.stats)
    generator = Generator(backend, model, config, metrics, tenant_limits)
    sessions = SessionManager(store or InMemorySessionStore(config.max_sessions), generator, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        install_task_dump()
        sweeper = asyncio.create_task(_sweep_forever(sessions, config.sweep_interval_s))
        try:
            yield
        finally:
            app.state.stopping = True
            sweeper.cancel()
            await backend.shutdown(config.shutdown_timeout_s)

    app = FastAPI(title=title, version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat API plus server-side sessions for LLM agents.")
    app.state.config = config
    app.state.stopping = False
    app.state.tenants = tenants
    app.state.engine = backend
    app.state.metrics = metrics
    app.state.generator = generator
    app.state.openai = OpenAIService(generator)
    app.state.sessions = sessions
    app.state.responses = ResponsesService(sessions)
    install_handlers(app, config.retry_after_s)
    app.include_router(open_routes)
    app.include_router(api)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, metrics=metrics)
    return app


async def _sweep_forever(sessions: SessionManager, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sessions.sweep()
        except Exception:  # a failed sweep must not end sweeping
            log.exception("session sweep failed")
