"""The HTTP app: thin routes over the app's ``Services``, which ``assemble_app`` builds once.

``create_app(config, engine=None)`` builds the app around an ``engine.LLMEngine`` (loaded
from ``config`` when not given), runs it in an ``AsyncEngine`` thread, and on shutdown
drains the engine. Streams are server-sent events (sse-starlette) ending with ``data: [DONE]``,
with a ``: ping`` comment every 15 s (the Responses API's typed events instead go out named by their
type, without ``[DONE]``; the Anthropic Messages API's too, with ``ping`` events); a client that
disconnects cancels its stream, which aborts the engine request and frees its pages.

Generations (chat completions, completions, messages, responses, session turns) answer once their request is placed
(``Generation.placed``: behind a router, once a worker produced the first output), so a stream's
errors before that are JSON errors with their status, and a router's responses name the worker
that served them in the ``x-agentrt-worker`` header (``agentrt serve`` sends none). Chat
completions and completions route by the client's affinity key (``agentrt/core/affinity.py``). ``/dashboard`` and the JSON
it polls are ``agentrt/dashboard.py``'s routes.

With tracing on (``--otlp-endpoint``, ``agentrt/tracing.py``) every request but probes gets a server
span (``TracingMiddleware``, outermost, so it times 413s and auth failures too) and the engine's
requests their phase spans.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.background import BackgroundTask

from engine.client import EngineClient

from agentrt.api.messages import (AnthropicErrorResponse, AnthropicService, CountTokensRequest, MessagesRequest,
                                   TokenCount)
from agentrt import tracing
from agentrt.core.affinity import affinity_key
from agentrt.dashboard import LocalStatus, dashboard_routes
from agentrt.config import ServerConfig, ServingSettings
from agentrt.debug import install_task_dump
from agentrt.core.errors import APIError, from_exception, install_handlers
from agentrt.core.generation import Generation, Generator
from agentrt.metrics import CONTENT_TYPE, Metrics
from agentrt.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, ForkRequest,
                              ModelList, TokenizeRequest,
                              SessionCreateRequest, SessionDeleted, SessionList, SessionResponse, TurnRequest,
                              TurnResponse)
from agentrt.api.responses import ResponseCreateRequest, ResponseDeleted, ResponsesService
from agentrt.api.openai import OpenAIService
from agentrt.core.turns import SessionManager, TurnRun
from agentrt.core.store import InMemorySessionStore, SessionStore
from agentrt.core.tenants import Tenant, TenantLimiter, TenantRegistry

log = logging.getLogger("agentrt.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 409, 413, 429, 500, 503)}

WORKER_HEADER = "x-agentrt-worker"
"""Response header naming the worker that served a generation (behind a router only)."""


@dataclass
class Services:
    """The app's parts, built once by ``assemble_app`` (the composition root) and handed to each route by one
    FastAPI dependency (``services``), typed, as ``app.state.services``; beside it ``app.state`` holds only
    ``dashboard``, the status source a router replaces with its fleet's. ``stopping``: set once the app
    shuts down or its worker drains (``/health`` answers 503)."""

    config: ServingSettings
    tenants: TenantRegistry
    engine: EngineClient
    metrics: Metrics
    generator: Generator
    openai: OpenAIService
    anthropic: AnthropicService
    sessions: SessionManager
    responses: ResponsesService
    stopping: bool = False


def services(request: Request) -> Services:
    """The app's :class:`Services` (a FastAPI dependency)."""
    return request.app.state.services


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


def _auth(request: Request) -> Tenant:
    """The request's tenant, from its key (``default`` on an open server); 401 otherwise. The key comes
    in ``x-api-key`` (as Anthropic's clients send it) or else as ``Authorization: Bearer``."""
    key = request.headers.get("x-api-key")
    if not key:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else None
    tenant = services(request).tenants.authenticate(key)
    if tenant is None:
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
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


async def _placed(request: Request, generation: Generation, close: Callable[[], Awaitable]
                  ) -> dict[str, str] | Response:
    """Wait until ``generation`` is placed; the response headers that name its worker (none in one
    process), or a 499 response if the client went away first (``close`` has then run). An error
    before placement runs ``close`` and is raised, so the client gets it as a JSON error."""
    try:
        worker = await _unless_disconnected(request, generation.placed(), close)
    except BaseException:
        await close()
        raise
    if isinstance(worker, Response):
        return worker
    return {WORKER_HEADER: worker} if worker else {}


async def _sse_reply(request: Request, generation: Generation, chunks: AsyncIterator[dict],
                     close: Callable[[], Awaitable], anthropic: bool = False) -> Response:
    """``chunks`` as a stream that starts once ``generation`` is placed (``sse_response``)."""
    headers = await _placed(request, generation, close)
    if isinstance(headers, Response):
        return headers
    return sse_response(chunks, close, services(request).config.retry_after_s, headers, anthropic=anthropic)


async def _json_reply(request: Request, response: Response, generation: Generation, body: Awaitable[Any],
                      close: Callable[[], Awaitable]) -> Any:
    """``body`` (cancelled, and ``close`` run, if the client goes away first), with the header that names
    the generation's worker set on ``response`` (the route's, whose headers FastAPI sends)."""
    result = await _unless_disconnected(request, body, close)
    if not isinstance(result, Response):
        worker = await generation.placed()  # at once: the reply is complete
        if worker:
            response.headers[WORKER_HEADER] = worker
    return result


async def _reply(request: Request, response: Response, generation: Generation, stream: bool,
                 chunks: Callable[[], AsyncIterator[dict]], whole: Callable[[], Awaitable[Any]],
                 anthropic: bool = False) -> Any:
    """A generation's reply on a surface: its event stream (``chunks()``) or its whole body (``whole()``),
    whichever the request asked for (only that one is built)."""
    if stream:
        return await _sse_reply(request, generation, chunks(), generation.close, anthropic=anthropic)
    return await _json_reply(request, response, generation, whole(), generation.close)


# ------------------------------------------------------------ routes

api = APIRouter(responses=_ERRORS)
anthropic_routes = APIRouter(responses={code: {"model": AnthropicErrorResponse}
                                        for code in (400, 401, 404, 413, 429, 500, 503)})
open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request, s: Services = Depends(services)) -> JSONResponse:
    if s.stopping:
        return JSONResponse({"status": "stopping"}, status_code=503)
    return JSONResponse({"status": "ok", "model": s.generator.model_name})


@open_routes.get("/metrics")
async def metrics(request: Request, s: Services = Depends(services)) -> Response:
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)


@api.get("/v1/models", response_model=ModelList, dependencies=[Depends(_auth)])
async def models(request: Request, s: Services = Depends(services)) -> dict:
    return s.openai.models()


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response,
                           tenant: Tenant = Depends(_auth),
                           s: Services = Depends(services)) -> Any:
    svc = s.openai
    generation = await svc.start_chat(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
    return await _reply(request, response, generation, body.stream, lambda: svc.chat_chunks(body, generation),
                        lambda: svc.chat(body, generation))


@api.post("/tokenize", dependencies=[Depends(_auth)])
async def tokenize(body: TokenizeRequest, request: Request, s: Services = Depends(services)) -> dict:
    """vLLM's ``/tokenize``: token ids of a prompt, or of messages through the chat template."""
    return s.openai.tokenize(body)


@api.post("/detokenize", dependencies=[Depends(_auth)])
async def detokenize(body: DetokenizeRequest, request: Request, s: Services = Depends(services)) -> dict:
    return s.openai.detokenize(body)


@api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, response: Response,
                      tenant: Tenant = Depends(_auth),
                      s: Services = Depends(services)) -> Any:
    svc = s.openai
    generation = await svc.start_completion(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
    return await _reply(request, response, generation, body.stream, lambda: svc.completion_chunks(body, generation),
                        lambda: svc.completion(body, generation))


@anthropic_routes.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, response: Response,
                   tenant: Tenant = Depends(_auth),
                   s: Services = Depends(services)) -> Any:
    """Anthropic's Messages API (``anthropic-version`` and ``anthropic-beta`` headers are accepted and
    not read); streaming sends Anthropic's named events. Session headers route as affinity keys."""
    svc = s.anthropic
    generation = await svc.start(body, tenant, affinity_key(request.headers))
    return await _reply(request, response, generation, body.stream, lambda: svc.events(generation),
                        lambda: svc.message(generation), anthropic=True)


@anthropic_routes.post("/v1/messages/count_tokens", response_model=TokenCount, dependencies=[Depends(_auth)])
async def count_tokens(body: CountTokensRequest, request: Request, s: Services = Depends(services)) -> dict:
    """The ``input_tokens`` of this request: its prompt as ``/v1/messages`` would submit it."""
    return s.anthropic.count_tokens(body)


@api.post("/v1/sessions", response_model=SessionResponse, status_code=201)
async def create_session(body: SessionCreateRequest, request: Request, tenant: Tenant = Depends(_auth),
                         s: Services = Depends(services)) -> dict:
    sessions = s.sessions
    return sessions.view(await sessions.create(body, tenant))


@api.get("/v1/sessions", response_model=SessionList)
async def list_sessions(request: Request, tenant: Tenant = Depends(_auth),
                        s: Services = Depends(services)) -> dict:
    sessions = s.sessions
    now = time.time()
    records = [r for r in await sessions.store.list(tenant=tenant.name) if r.expires_at > now]
    return {"object": "list", "data": [sessions.view(r) for r in records]}


@api.get("/v1/sessions/{session_id}", response_model=SessionResponse)
async def get_session(session_id: str, request: Request, tenant: Tenant = Depends(_auth),
                      s: Services = Depends(services)) -> dict:
    sessions = s.sessions
    return sessions.view(await sessions.get(session_id, tenant))


@api.delete("/v1/sessions/{session_id}", response_model=SessionDeleted)
async def delete_session(session_id: str, request: Request, tenant: Tenant = Depends(_auth),
                         s: Services = Depends(services)) -> dict:
    await s.sessions.delete(session_id, tenant)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@api.post("/v1/sessions/{session_id}/fork", response_model=SessionResponse, status_code=201)
async def fork_session(session_id: str, request: Request, body: ForkRequest | None = None,
                       tenant: Tenant = Depends(_auth),
                       s: Services = Depends(services)) -> dict:
    sessions = s.sessions
    return sessions.view(await sessions.fork(session_id, body or ForkRequest(), tenant))


@api.post("/v1/sessions/{session_id}/turns", response_model=TurnResponse)
async def session_turn(session_id: str, body: TurnRequest, request: Request, response: Response,
                       tenant: Tenant = Depends(_auth),
                       s: Services = Depends(services)) -> Any:
    """Append messages and generate the reply. Streaming sends ``turn.delta`` events (``turn.reasoning_delta``
    for reasoning, ``turn.tool_call`` for calls), then ``turn.completed``."""
    sessions = s.sessions
    started = await sessions.start_turn(session_id, body, tenant)
    if not isinstance(started, TurnRun):  # a retried turn id: the recorded reply, nothing appended
        sessions.gen.metrics.turns.labels("replayed").inc()
        view = sessions.turn_view(session_id, started, replayed=True)
        if body.stream:
            return sse_response(_one_event({"type": "turn.completed", "turn": view}), _nothing, 1)
        return view
    if body.stream:
        return await _sse_reply(request, started.generation, _turn_events(session_id, started), started.close)

    async def run() -> dict:
        return sessions.turn_view(session_id, await started.run())

    return await _json_reply(request, response, started.generation, run(), started.close)


async def _turn_events(session_id: str, run: TurnRun) -> AsyncIterator[dict]:
    index = 0
    async for d in run.deltas():
        if d.reasoning:
            yield {"type": "turn.reasoning_delta", "reasoning": d.reasoning}
        if d.content:
            yield {"type": "turn.delta", "content": d.content}
        for call in d.tool_calls:
            yield {"type": "turn.tool_call", "index": index, "id": call.id, "name": call.name,
                   "arguments": call.arguments}
            index += 1
    yield {"type": "turn.completed", "turn": SessionManager.turn_view(session_id, run.turn)}


@api.post("/v1/responses")
async def create_response(body: ResponseCreateRequest, request: Request, response: Response,
                          tenant: Tenant = Depends(_auth),
                          s: Services = Depends(services)) -> Any:
    """OpenAI's Responses API; a ``previous_response_id`` chain is a session. Streaming sends typed events.
    Like a chat completion, a response that runs answers once placed, naming its worker behind a router."""
    svc = s.responses
    run = await svc.start(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
    generation = run.running
    if body.stream:
        headers = {} if generation is None else await _placed(request, generation, run.close)
        if isinstance(headers, Response):
            return headers
        return sse_response(run.events(), run.close, s.config.retry_after_s, headers, named=True)
    if generation is None:
        return await _unless_disconnected(request, run.collect(), run.close)
    return await _json_reply(request, response, generation, run.collect(), run.close)


@api.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, tenant: Tenant = Depends(_auth),
                       stream: bool = Query(False),
                       s: Services = Depends(services)) -> dict:
    if stream:
        raise APIError(400, "streaming a stored response again is not supported; GET it without stream",
                       param="stream")
    return await s.responses.retrieve(response_id, tenant)


@api.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: str, request: Request, tenant: Tenant = Depends(_auth),
                          s: Services = Depends(services)) -> dict:
    return await s.responses.delete(response_id, tenant)


@api.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request, tenant: Tenant = Depends(_auth),
                               limit: int = Query(20), order: str = Query("desc"), after: str | None = None,
                               before: str | None = None,
                               s: Services = Depends(services)) -> dict:
    return await s.responses.input_items(response_id, tenant, limit=limit, order=order, after=after,
                                         before=before)


async def _one_event(event: dict) -> AsyncIterator[dict]:
    yield event


async def _nothing() -> None:
    return None


# ------------------------------------------------------------ app


def create_app(config: ServerConfig, engine: Any = None, store: SessionStore | None = None,
               role: str = "serve") -> FastAPI:
    """The app around ``engine`` (an ``engine.LLMEngine``; built from ``config`` when None). ``role``
    names the process in its traces (serve, worker)."""
    from engine import AsyncEngine

    # loaded in the engine's own thread, where it then runs (AsyncEngine's docstring says why)
    async_engine = AsyncEngine(engine) if engine is not None else AsyncEngine.from_config(config.engine_config())
    llm = async_engine.engine
    if tracing.enabled():
        llm.on_finished = tracing.record_engine_phases
    return assemble_app(config, async_engine, llm, store, role=role)


def assemble_app(config: ServingSettings, backend: EngineClient, model: Any, store: SessionStore | None = None,
                 title: str = "agentrt", tenant_limits: TenantLimiter | None = None,
                 metrics: Metrics | None = None, role: str = "serve") -> FastAPI:
    """The app over ``backend``, an ``engine.client.EngineClient``: the in-process ``engine.AsyncEngine``
    or the router's remote engine. ``model`` gives ``tokenizer``, ``max_model_len`` and ``model_id``.
    ``tenant_limits``: where tenants' concurrency and tokens per minute are counted (None: in this process).
    ``metrics``: the registry ``/metrics`` serves (None: a model server's, with ``backend``'s engine stats).
    ``role``: serve, worker or router, the ``agentrt.role`` of its server spans when tracing is on."""
    # A SIGTERM must not cut streams: uvicorn's graceful shutdown lets them finish (sse-starlette's default
    # cancels every stream of the process as soon as any server in it is told to exit).
    AppStatus.disable_automatic_graceful_drain()
    tenants = TenantRegistry.from_config(config.tenants_file, config.api_keys)
    if metrics is None:
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
            app.state.services.stopping = True
            sweeper.cancel()
            await backend.shutdown(config.shutdown_timeout_s)

    app = FastAPI(title=title, version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible chat API, Anthropic's Messages API, and server-side sessions "
                              "for LLM agents.")
    app.state.services = parts = Services(config, tenants, backend, metrics, generator, OpenAIService(generator),
                                          AnthropicService(generator), sessions, ResponsesService(sessions))
    app.state.dashboard = LocalStatus(parts)  # the router puts its own fleet view here
    install_handlers(app, config.retry_after_s)
    app.include_router(open_routes)
    app.include_router(api)
    app.include_router(anthropic_routes)
    app.include_router(dashboard_routes(_auth), responses={401: {"model": ErrorResponse}})
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, metrics=metrics)
    if tracing.enabled():
        app.add_middleware(tracing.TracingMiddleware, role=role)
    return app


async def _sweep_forever(sessions: SessionManager, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sessions.sweep()
        except Exception:  # a failed sweep must not end sweeping
            log.exception("session sweep failed")
