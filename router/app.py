"""The router process: agentrt's public API (OpenAI endpoints and sessions) over a fleet of workers.

``create_router_app`` assembles agentrt's app (``agentrt.server.assemble_app``) with:
the model's tokenizer only (``router.model_info``), a ``RemoteEngine`` that routes every
request through ``RouterCore`` and streams it from a worker, and sessions in Redis
(``RedisSessionStore``), and tenants' concurrency and tokens per minute counted in Redis
(``RedisTenantLimits``), so they hold across replicas. Everything it routes on comes from
Redis, so any number of replicas run side by side and agree (contract 3).
Its ``/metrics`` carries agentrt's HTTP metrics and the router's own (``router/metrics.py``), not
the workers' engine gauges. ``GET /router/state`` shows this replica's view: live workers, their load and indexed
blocks, KV event counters, how many decisions each policy rule made, and the tenant leases
it holds. ``GET /dashboard`` shows the fleet (``router/dashboard.py``'s ``RouterStatus``).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from agentrt.core.errors import APIError

from agentrt.config import RouterServerConfig
from agentrt.server import services
from router.config import RouterConfig

router_routes = APIRouter()


@router_routes.get("/router/state")
async def router_state(request: Request) -> dict:
    parts = services(request)
    limits = parts.generator.tenant_limits
    return {**request.app.state.core.state(), "failovers": parts.engine.failovers,
            "tenant_limits": {"leases_held": limits.held, "lost_leases": limits.lost_leases,
                              "release_errors": limits.release_errors}}


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    retry = services(request).config.retry_after_s
    return APIError(503, f"the session store (Redis) is unavailable: {type(exc).__name__}: {exc}; retry later",
                    type="server_error", code="store_unavailable",
                    headers={"Retry-After": str(retry)}).response(request.url.path)


def create_router_app(config: RouterServerConfig, rconfig: RouterConfig) -> FastAPI:
    from agentrt.metrics import Metrics
    from agentrt.server import assemble_app
    from router.core import RouterCore
    from router.dashboard import RouterStatus
    from router.metrics import RouterCollector
    from router.model_info import load_router_model
    from router.redis_store import RedisSessionStore
    from router.remote import RemoteEngine
    from router.tenant_limits import RedisTenantLimits

    model = load_router_model(config.model, config.served_model_name, config.max_model_len)
    core = RouterCore(rconfig, model.model_id)
    remote = RemoteEngine(core, model.max_model_len, header_timeout_s=rconfig.worker_header_timeout_s,
                          vocab_size=model.tokenizer.vocab_size)
    store = RedisSessionStore(core.redis, rconfig, remote.worker_of)
    limits = RedisTenantLimits(core.redis, rconfig, retry_after_s=config.retry_after_s)
    metrics = Metrics()
    metrics.attach(RouterCollector(core, remote))
    app = assemble_app(config, remote, model, store, title="agentrt router",
                       tenant_limits=limits, metrics=metrics, role="router")
    app.state.core = core
    app.state.dashboard = RouterStatus(app.state.services, core)
    app.include_router(router_routes)
    app.add_exception_handler(RedisError, _redis_unavailable)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await core.start()
        try:
            async with inner(app):
                yield
        finally:
            await limits.aclose()
            await core.stop()

    app.router.lifespan_context = lifespan
    return app
