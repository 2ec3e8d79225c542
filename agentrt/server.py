"""The app: ``assemble_app`` is the composition root. It builds the app's parts once (``Services``: the
engine client, generator, session manager, the surfaces' services), includes each surface's routes
(``agentrt/api/``: OpenAI, Anthropic Messages, sessions, Responses) over its own service, the dashboard's
and the probes (``/health``, ``/metrics``), and adds the body limit and tracing middleware.

``create_app(config, engine=None)`` builds the app around an ``engine.LLMEngine`` (loaded from ``config``
when not given), runs it in an ``AsyncEngine`` thread, and on shutdown drains the engine. How replies
stream, and answer once their request is placed (behind a router, naming the worker in the
``x-agentrt-worker`` header), is ``agentrt/api/http.py``. Chat completions and completions route by the
client's affinity key (``agentrt/core/affinity.py``).

With tracing on (``--otlp-endpoint``, ``agentrt/tracing.py``) every request but probes gets a server
span (``TracingMiddleware``, outermost, so it times 413s and auth failures too) and the engine's
requests their phase spans. Nothing here runs per request: the body limit every request passes is
``agentrt/api/http.py``'s, with the rest of the HTTP plumbing, and the periodic sweep is the session
manager's (``SessionManager.sweep_forever``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import AppStatus

from engine.client import EngineClient

from agentrt import tracing
from agentrt.api import messages, openai, responses, sessions as session_api
from agentrt.api.http import BodyLimitMiddleware, authenticator
from agentrt.api.messages import AnthropicService
from agentrt.api.openai import OpenAIService
from agentrt.api.responses import ResponsesService
from agentrt.config import ServerConfig, ServingSettings
from agentrt.core.errors import install_handlers
from agentrt.core.generation import Generator
from agentrt.core.store import InMemorySessionStore, SessionStore
from agentrt.core.tenants import TenantLimiter, TenantRegistry
from agentrt.core.turns import SessionManager
from agentrt.dashboard import LocalStatus, dashboard_routes
from agentrt.debug import install_task_dump
from agentrt.metrics import CONTENT_TYPE, Metrics
from agentrt.protocol import ErrorResponse

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


# ------------------------------------------------------------ routes

open_routes = APIRouter()


@open_routes.get("/health")
async def health(request: Request, s: Services = Depends(services)) -> JSONResponse:
    if s.stopping:
        return JSONResponse({"status": "stopping"}, status_code=503)
    return JSONResponse({"status": "ok", "model": s.generator.model_name})


@open_routes.get("/metrics")
async def metrics(request: Request, s: Services = Depends(services)) -> Response:
    return Response(s.metrics.render(), media_type=CONTENT_TYPE)


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


def freeze_startup_heap() -> None:
    """Move what start-up made (torch, the model's modules, the tokenizer, the templates: ~270k objects,
    alive for the process's life) into the garbage collector's permanent generation, after collecting
    start-up's garbage. Otherwise the first full collections walk all of it during the first requests
    (a 0.25-0.55 s stall seen on the first request of a fresh server on 2 cores), and every later full
    collection walks it again. vLLM freezes its heap after engine start for the same reason.

    For a server process's entry point (``agentrt serve``, ``agentrt worker``), once its app is built: an
    embedding process (a test, a notebook) keeps its own collector, so that an engine it drops is freed."""
    gc.collect()
    gc.freeze()


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
        sweeper = asyncio.create_task(sessions.sweep_forever(config.sweep_interval_s))
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
    auth, retry = authenticator(tenants), config.retry_after_s
    app.include_router(open_routes)
    # the surfaces, side by side, each over its own service (agentrt/api/)
    app.include_router(openai.routes(parts.openai, auth, retry))
    app.include_router(messages.routes(parts.anthropic, auth, retry))
    app.include_router(session_api.routes(sessions, auth, retry))
    app.include_router(responses.routes(parts.responses, auth, retry))
    app.include_router(dashboard_routes(auth), responses={401: {"model": ErrorResponse}})
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, metrics=metrics)
    if tracing.enabled():
        app.add_middleware(tracing.TracingMiddleware, role=role)
    return app
