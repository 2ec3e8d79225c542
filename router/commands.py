"""``agentrt worker``, ``agentrt router``, ``agentrt up`` and ``agentrt status`` (registered in agentrt/cli.py).

Only argparse and the standard library at import time: heavy imports live in the ``run_*``
functions, so ``agentrt status`` never loads torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from agentrt.config import KEEP_ALIVE_S, ServerConfig, configure_serve

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _add_redis_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", dest="redis_url", default=None,
                        help=f"Redis URL (env AGENTRT_REDIS_URL; default {DEFAULT_REDIS})")
    parser.add_argument("--key-prefix", default="agentrt:", help="prefix of every Redis key")
    parser.add_argument("--deployment", default="default", help="deployment name (workers set, event stream)")
    parser.add_argument("--heartbeat-ttl-s", type=float, default=10.0, help="a worker silent this long is dead")
    parser.add_argument("--heartbeat-interval-s", type=float, default=3.0, help="how often workers heartbeat")


def _router_config(args: argparse.Namespace, **extra):
    from router.config import RouterConfig

    return RouterConfig(redis_url=args.redis_url or os.environ.get("AGENTRT_REDIS_URL") or DEFAULT_REDIS,
                        key_prefix=args.key_prefix, deployment=args.deployment,
                        heartbeat_ttl_s=args.heartbeat_ttl_s, heartbeat_interval_s=args.heartbeat_interval_s,
                        **extra)


def _server_config(args: argparse.Namespace, command: str) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig.from_sources({k: v for k, v in vars(args).items() if k in names})


def _serve(app, config: ServerConfig) -> None:
    import uvicorn

    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=int(config.shutdown_timeout_s) or 1, timeout_keep_alive=KEEP_ALIVE_S)


def _logging(config: ServerConfig) -> None:
    import logging

    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ------------------------------------------------------------ worker


def configure_worker(parser: argparse.ArgumentParser) -> None:
    configure_serve(parser)
    _add_redis_flags(parser)
    parser.add_argument("--worker-id", default=None, help="id in Redis (default: <hostname>-<port>)")
    parser.add_argument("--advertise-url", default=None,
                        help="URL routers use to reach this worker (default: http://<host>:<port>)")


def run_worker(args: argparse.Namespace) -> int:
    from router.worker import WorkerSettings, create_worker_app, serve_worker

    try:
        config = _server_config(args, "worker")
        rconfig = _router_config(args)
        settings = WorkerSettings.default(config, args.worker_id, args.advertise_url)
    except ValueError as exc:
        print(f"agentrt worker: {exc}", file=sys.stderr)
        return 2
    _logging(config)
    serve_worker(create_worker_app(config, rconfig, settings), config)
    return 0


# ------------------------------------------------------------ router


def configure_router(parser: argparse.ArgumentParser) -> None:
    configure_serve(parser)
    _add_redis_flags(parser)
    parser.add_argument("--policy", default="agentrt", help="routing policy (router/policy.py registry)")
    parser.add_argument("--policy-option", action="append", default=[], metavar="NAME=NUMBER",
                        help="a keyword argument of the policy, e.g. tokens_per_queued_request=1024 (repeatable)")
    parser.add_argument("--tentative-ttl-s", type=float, default=60.0,
                        help="how long a dispatched prompt counts as held by its worker before the worker's KV "
                             "events confirm it (0: off)")
    parser.add_argument("--turn-lock-ttl-s", type=float, default=60.0,
                        help="TTL of a session's turn lock in Redis (renewed while the turn runs)")


def _policy_options(items: list[str]) -> dict[str, float]:
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name.isidentifier() or number is None:
            raise ValueError(f"--policy-option takes NAME=NUMBER, got {item!r}")
        options[name] = int(number) if number.is_integer() and "." not in value else number
    return options


def run_router(args: argparse.Namespace) -> int:
    from router.app import create_router_app
    from router.policy import make_policy

    try:
        config = _server_config(args, "router")
        rconfig = _router_config(args, policy=args.policy, policy_options=_policy_options(args.policy_option),
                                 tentative_ttl_s=args.tentative_ttl_s, turn_lock_ttl_s=args.turn_lock_ttl_s)
        try:
            make_policy(rconfig.policy, **rconfig.policy_options)
        except TypeError as exc:
            raise ValueError(f"policy {rconfig.policy}: {exc}") from None
    except ValueError as exc:
        print(f"agentrt router: {exc}", file=sys.stderr)
        return 2
    _logging(config)
    _serve(create_router_app(config, rconfig), config)
    return 0


# ------------------------------------------------------------ up


def configure_up(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--redis", dest="redis_url", default=None,
                        help="Redis URL; if nothing answers there, redis-server is started on a free port")
    parser.add_argument("--host", default="127.0.0.1", help="address the router and workers listen on")
    parser.add_argument("--port", type=int, default=8000, help="router port (workers get free ports)")
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool per worker, in tokens")
    parser.add_argument("--device", default=None, help="where the workers' engines run: cpu, cuda or auto")
    parser.add_argument("--dtype", default=None, help="the workers' weights and KV precision: float32, bfloat16 "
                                                      "or float16")
    parser.add_argument("--policy", default="agentrt", help="routing policy (router/policy.py registry)")
    parser.add_argument("--log-level", default="info", help="critical, error, warning, info, debug or trace")


def run_up(args: argparse.Namespace) -> int:
    from router.local_cluster import LocalCluster

    if args.workers < 1:
        print("agentrt up: --workers must be >= 1", file=sys.stderr)
        return 2
    return LocalCluster(args).run()


# ------------------------------------------------------------ status


def configure_status(parser: argparse.ArgumentParser) -> None:
    _add_redis_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the status as JSON")


def run_status(args: argparse.Namespace) -> int:
    import asyncio
    import json

    import redis

    from router.status import collect_status, format_status

    try:
        status = asyncio.run(collect_status(_router_config(args)))
    except (OSError, redis.RedisError, ValueError) as exc:
        print(f"agentrt status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
