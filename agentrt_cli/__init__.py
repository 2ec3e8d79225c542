"""The ``agentrt`` command (``python -m agentrt_cli``). Subcommands are entries of :data:`SUBCOMMANDS`.

The package stands above ``agentrt`` and ``router`` (tests/test_layers.py): it dispatches to the
serving core's subcommands (serve, chat, bench) and the multi-worker ones (worker, router, up,
status: ``router/commands.py``), and nothing of ours imports it.

To add one, write ``configure(parser)`` and ``run(args) -> int`` functions and add a
:class:`Subcommand` to the tuple; heavy imports go inside ``run`` so ``agentrt chat`` never loads torch.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from agentrt.config import ENV_PREFIX, KEEP_ALIVE_S, ServerConfig, Settings, configure_serve


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------ serve


def run_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from agentrt import tracing
    from agentrt.server import create_app, freeze_startup_heap

    try:
        config = ServerConfig.from_args(args)
    except ValueError as exc:
        print(f"agentrt serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.otlp_endpoint:
        tracing.setup(config.otlp_endpoint, config.otel_service_name, "agentrt")
    try:
        try:
            app = create_app(config)
        except ValueError as exc:  # a model the settings cannot serve (e.g. --ep-size with a dense model)
            print(f"agentrt serve: {exc}", file=sys.stderr)
            return 2
        freeze_startup_heap()
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                    timeout_graceful_shutdown=int(config.shutdown_timeout_s) or 1, timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        tracing.shutdown()  # the last spans go out
    return 0


# ------------------------------------------------------------ chat


def configure_chat(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server URL")
    parser.add_argument("--api-key", default=None, help="API key (env AGENTRT_API_KEY)")
    parser.add_argument("--system", default=None, help="system prompt of the session")
    parser.add_argument("--max-tokens", type=int, default=256, help="reply token limit")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")


def run_chat(args: argparse.Namespace) -> int:
    import os

    from agentrt.client import AgentRTError, Client

    client = Client(args.url, api_key=args.api_key or os.environ.get("AGENTRT_API_KEY"))
    try:
        session = client.sessions.create(system=args.system)
    except AgentRTError as exc:
        print(f"agentrt chat: cannot open a session at {args.url}: {exc}", file=sys.stderr)
        return 1
    print(f"session {session.id} on {session.info.model}. /fork, /history, /quit")
    try:
        return _chat_loop(session, args)
    finally:
        try:
            session.close()
        except AgentRTError:
            pass
        client.close()


def _chat_loop(session, args: argparse.Namespace) -> int:
    from agentrt.client import AgentRTError

    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/history":
            for m in session.refresh().messages:
                print(f"[{m['role']}] {m.get('content')}")
            continue
        if line == "/fork":
            session = session.fork()
            print(f"forked: now in session {session.id}")
            continue
        try:
            stream = session.send(line, stream=True, max_tokens=args.max_tokens, temperature=args.temperature)
            print("assistant> ", end="", flush=True)
            for delta in stream:
                if delta.tool_call is not None:
                    print(f"\n[tool call] {delta.tool_call.name}({delta.tool_call.arguments})", end="")
                print(delta.content, end="", flush=True)
            usage = stream.reply.usage if stream.reply else None
            if usage:
                print(f"\n  ({usage.prompt_tokens} prompt tokens, {usage.cached_tokens} cached, "
                      f"{usage.completion_tokens} generated)")
        except AgentRTError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)


def _bench_configure(parser: argparse.ArgumentParser) -> None:
    from agentrt.bench.cli import configure

    configure(parser)


def _bench_run(args: argparse.Namespace) -> int:
    from agentrt.bench.cli import run

    return run(args)


def _cluster_subcommands() -> tuple[Subcommand, ...]:
    from router import commands as rc

    return (
        Subcommand("worker", "run a worker: the engine behind the HTTP API, registered in Redis for routers",
                   rc.configure_worker, rc.run_worker),
        Subcommand("router", "run a router: the public API, routing each request to a worker by cache and load",
                   rc.configure_router, rc.run_router),
        Subcommand("up", "start a local cluster: Redis (if needed), N workers and a router", rc.configure_up,
                   rc.run_up),
        Subcommand("status", "show a cluster's workers, load, cached blocks, sessions and hit rates",
                   rc.configure_status, rc.run_status),
    )


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("serve", "run the server: engine in-process, OpenAI and session APIs", configure_serve, run_serve),
    Subcommand("chat", "chat in the terminal with a running server", configure_chat, run_chat),
    Subcommand("bench", "benchmark an OpenAI-compatible URL with the agentic workload, or --ablate locally",
               _bench_configure, _bench_run),
    *_cluster_subcommands(),
)


def build_parser(subcommands: Sequence[Subcommand] = SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrt", description="A runtime that serves LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in subcommands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


# AGENTRT_* variables read elsewhere than the settings models: the client's key (agentrt chat, agentrt.Client)
# and the kernels' build (engine/cpu_build.py, engine/attention/flashinfer_backend.py)
OTHER_ENV = frozenset({"AGENTRT_API_KEY", "AGENTRT_KERNEL_MARCH", "AGENTRT_KERNEL_CACHE",
                       "AGENTRT_FLASHINFER_PREFILL_BACKEND"})


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """The ``AGENTRT_*`` variables of ``environ`` that no setting of any command reads (``Settings`` and its
    subclasses: serve's, the router's, the worker's) and nothing else does (:data:`OTHER_ENV`), each with
    the nearest name that is read, as vLLM warns of unknown ``VLLM_*`` variables: a misspelt variable is
    otherwise ignored without a word."""
    known, stack = set(OTHER_ENV), [Settings]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        known.update(Settings.env_name(name) for name in cls.model_fields)
    out, cut = [], len(ENV_PREFIX)
    names = sorted(k[cut:] for k in known)
    for key in sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known):
        near = difflib.get_close_matches(key.upper()[cut:], names, n=1, cutoff=0.75)   # by the part after the prefix
        out.append(key + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    for name in unknown_env(os.environ):
        print(f"agentrt: warning: {name} is set, but no agentrt setting reads it", file=sys.stderr)
    args = build_parser().parse_args(argv)
    return args._run(args)
