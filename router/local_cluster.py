"""``agentrt up``: Redis (if none answers), N workers and a router on this machine, as child processes.

Each child's output is printed with a prefix (``[worker-0] ...``). Ctrl-C (or SIGTERM) stops
the router first, then the workers (each unregisters), then the Redis it started. A Redis
started here runs from PATH on a free port with its data (``appendonly yes``) in a
temporary directory that is removed afterwards. A worker that exits (killed, drained) is
reported and the cluster goes on while one is left (the router fails over); the cluster
stops when the router, its Redis or the last worker exits.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from agentrt.procs import free_port, redis_answers, start_redis, wait_healthy
from router.config import RouterConfig

def _pump(name: str, stream, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(f"[{name}] {raw.decode(errors='replace')}")
            sys.stdout.flush()


class LocalCluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.lock = threading.Lock()
        self.redis_dir: str | None = None

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=_pump, args=(name, proc.stdout, self.lock), daemon=True).start()
        self.procs.append((name, proc))
        return proc

    def _common(self) -> list[str]:
        a, out = self.args, []
        for flag, value in (("--model", a.model), ("--kv-cache-tokens", a.kv_cache_tokens),
                            ("--device", a.device), ("--dtype", a.dtype), ("--log-level", a.log_level)):
            if value is not None:
                out += [flag, str(value)]
        return out

    def _redis_url(self) -> str:
        url = self.args.redis_url or RouterConfig.model_fields["redis_url"].default
        if redis_answers(url):
            return url
        port = free_port()
        self.redis_dir = tempfile.mkdtemp(prefix="agentrt-up-redis-")
        proc = start_redis(port, self.redis_dir)
        threading.Thread(target=_pump, args=("redis", proc.stdout, self.lock), daemon=True).start()
        self.procs.append(("redis", proc))
        return f"redis://127.0.0.1:{port}/0"

    def start(self) -> dict[str, str]:
        a = self.args
        redis_url = self._redis_url()
        urls = {"redis": redis_url}
        exe = [sys.executable, "-m", "agentrt.cli"]
        workers = []
        for i in range(a.workers):
            port = free_port(a.host)
            url = f"http://{a.host}:{port}"
            workers.append((url, self._spawn(f"worker-{i}", exe + [
                "worker", "--redis", redis_url, "--host", a.host, "--port", str(port),
                "--worker-id", f"worker-{i}", *self._common()])))
            urls[f"worker-{i}"] = url
        for url, proc in workers:
            wait_healthy(url, proc)
        router_url = f"http://{a.host}:{a.port}"
        policy = ["--policy", a.policy] if a.policy is not None else []
        router = self._spawn("router", exe + ["router", "--redis", redis_url, "--host", a.host, "--port",
                                              str(a.port), *policy, *self._common()])
        wait_healthy(router_url, router)
        urls["router"] = router_url
        return urls

    def stop(self) -> None:
        """Router first, then workers (they unregister), then Redis; SIGKILL what lingers."""
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)

    def run(self) -> int:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # set explicitly: a background job inherits SIGINT ignored
            signal.signal(sig, lambda *_: stop.set())
        try:
            urls = self.start()
            with self.lock:
                print("\nagentrt cluster is up:")
                for name, url in urls.items():
                    print(f"  {name:10s} {url}")
                print(f"  API:       {urls['router']}/v1  (agentrt status --redis {urls['redis']})\n"
                      "Ctrl-C stops everything.\n", flush=True)
            reported: set[str] = set()
            while not stop.is_set():
                dead = [name for name, proc in self.procs if proc.poll() is not None]
                workers_left = sum(1 for name, proc in self.procs if name.startswith("worker-") and proc.poll() is None)
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
            self.stop()
