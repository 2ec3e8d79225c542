"""``agentrt up``: Redis (if none answers), N workers and a router on this machine, as child processes.

The children are an ``agentrt.procs.Procs`` group; each child's output is printed with a prefix
(``[worker-0] ...``). Ctrl-C (or SIGTERM) stops the router first, then the workers (each
unregisters), then the Redis it started. A Redis started here runs from PATH on a free port with
its data (``appendonly yes``) in a temporary directory that is removed afterwards. A worker that
exits (killed, drained) is reported and the cluster goes on while one is left (the router fails
over); the cluster stops when the router, its Redis or the last worker exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from agentrt.procs import Procs, redis_answers
from router.config import RouterConfig


class LocalCluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs = Procs(prefix="agentrt-up-", echo=True)

    def _common(self, engine: bool) -> list[str]:
        """The flags given to ``agentrt up`` that a child takes: every child the model, log level and
        tracing; workers (``engine``) the engine's settings too, which the router does not offer."""
        a, out = self.args, []
        flags = [("--model", a.model), ("--log-level", a.log_level), ("--otlp-endpoint", a.otlp_endpoint)]
        if engine:
            flags += [("--kv-cache-tokens", a.kv_cache_tokens), ("--device", a.device), ("--dtype", a.dtype),
                      ("--scheduling-policy", a.scheduling_policy)]
        for flag, value in flags:
            if value is not None:
                out += [flag, str(value)]
        return out

    def start(self) -> dict[str, str]:
        a = self.args
        redis_url = a.redis_url or RouterConfig.model_fields["redis_url"].default
        if not redis_answers(redis_url):
            redis_url = self.procs.redis().url
        urls = {"redis": redis_url}
        workers = [self.procs.agentrt(f"worker-{i}", "worker", "--redis", redis_url, "--worker-id", f"worker-{i}",
                                      *self._common(engine=True), host=a.host) for i in range(a.workers)]
        for worker in workers:
            urls[worker.name] = worker.wait_ready().url
        policy = ["--policy", a.policy] if a.policy is not None else []
        router = self.procs.agentrt("router", "router", "--redis", redis_url, *policy, *self._common(engine=False),
                                    host=a.host, port=a.port)
        urls["router"] = router.wait_ready().url
        return urls

    def run(self) -> int:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # set explicitly: a background job inherits SIGINT ignored
            signal.signal(sig, lambda *_: stop.set())
        try:
            urls = self.start()
            with self.procs.echo_lock:
                print("\nagentrt cluster is up:")
                for name, url in urls.items():
                    print(f"  {name:10s} {url}")
                print(f"  API:       {urls['router']}/v1  (agentrt status --redis {urls['redis']})\n"
                      "Ctrl-C stops everything.\n", flush=True)
            reported: set[str] = set()
            while not stop.is_set():
                dead = [p.name for p in self.procs.procs if not p.alive()]
                workers_left = sum(1 for p in self.procs.procs if p.name.startswith("worker-") and p.alive())
                if any(not name.startswith("worker-") for name in dead) or not workers_left:
                    print(f"agentrt up: {', '.join(dead)} exited; stopping the cluster", file=sys.stderr)
                    return 1
                for name in set(dead) - reported:  # the router fails over; the cluster goes on
                    print(f"agentrt up: {name} exited; {workers_left} workers left", file=sys.stderr, flush=True)
                    reported.add(name)
                stop.wait(0.5)
            return 0
        except KeyboardInterrupt:
            return 0
        except RuntimeError as exc:
            print(f"agentrt up: {exc}", file=sys.stderr)
            return 1
        finally:
            self.procs.stop(timeout_s=20.0)
