"""``agentrt worker``, ``agentrt router``, ``agentrt up`` and ``agentrt status`` (registered in agentrt_cli/).

Only argparse, the settings models (their fields are the flags) and the standard library at import
time: heavy imports live in the ``run_*`` functions, so ``agentrt status`` never loads torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from agentrt.config import (KEEP_ALIVE_S, RouterServerConfig, ServerConfig, ServingSettings, add_flags,
                            configure_router_http, configure_serve)
from router.config import RouterConfig, WorkerSettings

# The RouterConfig fields each command takes as flags (the rest keep their defaults, or env).
# block_size is none of them: it must equal the workers' KV page size, which is fixed.
CONNECTION = ("redis_url", "key_prefix", "deployment", "heartbeat_ttl_s", "heartbeat_interval_s")
WORKER_FIELDS = CONNECTION + ("events_maxlen", "kv_moves")
ROUTER_FIELDS = CONNECTION + ("event_max_bytes", "event_max_hashes", "session_max_bytes", "tentative_ttl_s",
                              "tentative_grace_s", "turn_lock_ttl_s", "affinity_ttl_s", "policy", "policy_options",
                              "vllm_workers", "vllm_events_topic", "vllm_health_interval_s", "kv_moves",
                              "kv_move_min_tokens", "kv_move_bandwidth_bytes_s", "kv_move_prefill_tokens_s",
                              "kv_move_overhead_s", "worker_header_timeout_s")


def _serve(app, config: ServingSettings) -> None:
    import uvicorn

    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=int(config.shutdown_timeout_s) or 1, timeout_keep_alive=KEEP_ALIVE_S)


def _logging(config: ServingSettings) -> None:
    import logging

    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _tracing(config: ServingSettings, service: str) -> None:
    """Tracing on when ``--otlp-endpoint`` is given (agentrt/tracing.py); ``service``: the default service.name."""
    if config.otlp_endpoint:
        from agentrt import tracing

        tracing.setup(config.otlp_endpoint, config.otel_service_name, service)


def _stop_tracing() -> None:
    from agentrt import tracing

    tracing.shutdown()  # the last spans go out


def _run_server(config: ServingSettings, service: str, serve: Callable[[], None]) -> int:
    """Logging and tracing (``service``: its default service.name) as ``config`` says, then ``serve()``,
    which builds the app and serves until shutdown; tracing stops however it ends. Returns 0."""
    _logging(config)
    _tracing(config, service)
    try:
        serve()
    finally:
        _stop_tracing()
    return 0


# ------------------------------------------------------------ worker


def configure_worker(parser: argparse.ArgumentParser) -> None:
    configure_serve(parser)
    add_flags(parser, RouterConfig, WORKER_FIELDS)
    add_flags(parser, WorkerSettings)


def run_worker(args: argparse.Namespace) -> int:
    from router.worker import create_worker_app, serve_worker

    try:
        config = ServerConfig.from_args(args)
        rconfig = RouterConfig.from_args(args)
        settings = WorkerSettings.from_args(args)
    except ValueError as exc:
        print(f"agentrt worker: {exc}", file=sys.stderr)
        return 2
    return _run_server(config, "agentrt-worker", lambda: serve_worker(create_worker_app(config, rconfig, settings),
                                                                      config))


# ------------------------------------------------------------ router


def configure_router(parser: argparse.ArgumentParser) -> None:
    configure_router_http(parser)
    add_flags(parser, RouterConfig, ROUTER_FIELDS)


def run_router(args: argparse.Namespace) -> int:
    from router.app import create_router_app
    from router.policy import make_policy

    try:
        config = RouterServerConfig.from_args(args)
        rconfig = RouterConfig.from_args(args)
        try:
            make_policy(rconfig.policy, **rconfig.policy_options)
        except TypeError as exc:
            raise ValueError(f"policy {rconfig.policy}: {exc}") from None
    except ValueError as exc:
        print(f"agentrt router: {exc}", file=sys.stderr)
        return 2
    return _run_server(config, "agentrt-router", lambda: _serve(create_router_app(config, rconfig), config))


# ------------------------------------------------------------ up


def configure_up(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--redis", dest="redis_url", default=None,
                        help="Redis URL; if nothing answers there, redis-server is started on a free port")
    parser.add_argument("--host", default="127.0.0.1", help="address the router and workers listen on")
    parser.add_argument("--port", type=int, default=8000, help="router port (workers get free ports)")
    # Passed on to each worker (and the router) when given; unset, the children's environment and defaults apply.
    add_flags(parser, ServerConfig, ("model", "kv_cache_tokens", "device", "dtype", "scheduling_policy", "log_level",
                                     "otlp_endpoint"))
    add_flags(parser, RouterConfig, ("policy",))


def run_up(args: argparse.Namespace) -> int:
    from router.local_cluster import LocalCluster

    if args.workers < 1:
        print("agentrt up: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.otlp_endpoint is not None:  # checked here too: the children would each fail with it
        try:
            ServerConfig.from_sources({"otlp_endpoint": args.otlp_endpoint})
        except ValueError as exc:
            print(f"agentrt up: {exc}", file=sys.stderr)
            return 2
    return LocalCluster(args).run()


# ------------------------------------------------------------ status


def configure_status(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RouterConfig, CONNECTION)
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run_status(args: argparse.Namespace) -> int:
    import asyncio
    import json

    import redis

    from router.status import collect_status, format_status

    try:
        status = asyncio.run(collect_status(RouterConfig.from_args(args)))
    except (OSError, redis.RedisError, ValueError) as exc:
        print(f"agentrt status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
