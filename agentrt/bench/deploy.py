"""Local deployments for the ablation: a private Redis, N ``agentrt worker`` processes, one ``agentrt router``.

The same processes ``agentrt up`` starts, spawned here directly because the ladder switches
settings ``agentrt up`` does not expose (the prefix cache, expert placement) and restarts
only what a step changes: workers when their flags change, the router when its policy does.
Logs go to a temp dir; :meth:`Deployment.stop` stops everything (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import sys
import time

import httpx

from agentrt.procs import Procs, free_port, start_redis, wait_healthy


class Deployment:
    def __init__(self, workers: int, kv_cache_tokens: int | None = None, model: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.n_workers, self.kv_cache_tokens, self.model = workers, kv_cache_tokens, model
        self.procs = Procs("agentrt-bench-")
        self.exe = [sys.executable, "-m", "agentrt.cli"]
        self.redis_url: str | None = None
        self.worker_urls: list[str] = []
        self.router_url: str | None = None
        self._workers: list = []
        self._router = None
        self._worker_flags: tuple[str, ...] | None = None
        self._policy: str | None = None
        self._generation = 0

    def _common(self) -> list[str]:
        out = ["--log-level", "warning", "--heartbeat-interval-s", "0.5", "--heartbeat-ttl-s", "5"]
        if self.kv_cache_tokens is not None:
            out += ["--kv-cache-tokens", str(self.kv_cache_tokens)]
        if self.model is not None:
            out += ["--model", self.model]
        return out

    def ensure(self, worker_flags: tuple[str, ...], policy: str) -> None:
        """Workers running with ``worker_flags`` and a router with ``policy`` (restarting what differs)."""
        if self.redis_url is None:
            port = free_port()
            self.procs.procs.append(start_redis(port, str(self.procs.dir)))
            self.redis_url = f"redis://127.0.0.1:{port}/0"
        if worker_flags != self._worker_flags:
            self._stop_router()
            self._stop(self._workers)
            self._start_workers(worker_flags)
        if policy != self._policy or self._router is None:
            self._stop_router()
            self._start_router(policy)

    def _start_workers(self, flags: tuple[str, ...]) -> None:
        self._generation += 1
        self._workers, self.worker_urls = [], []
        for i in range(self.n_workers):
            port = free_port()
            name = f"worker-{i}-g{self._generation}"
            proc = self.procs.spawn(name, self.exe + [
                "worker", "--redis", self.redis_url, "--port", str(port), "--worker-id", f"worker-{i}",
                *self._common(), *flags])
            self._workers.append((name, proc))
            self.worker_urls.append(f"http://127.0.0.1:{port}")
        for url, (name, proc) in zip(self.worker_urls, self._workers):
            try:
                wait_healthy(url, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{name} ({' '.join(flags)}): {exc}\n{self.procs.log_tail(name)}") from None
        self._worker_flags = flags

    def _start_router(self, policy: str) -> None:
        port = free_port()
        name = f"router-{policy}-g{self._generation}"
        proc = self.procs.spawn(name, self.exe + ["router", "--redis", self.redis_url, "--port", str(port),
                                                  "--policy", policy, *self._common()])
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            self._wait_workers(url)
        except RuntimeError as exc:
            raise RuntimeError(f"{name}: {exc}\n{self.procs.log_tail(name)}") from None
        self._router, self.router_url, self._policy = (name, proc), url, policy

    def _wait_workers(self, url: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = httpx.get(url + "/router/state", timeout=5).json()
            if len(state.get("workers") or []) >= self.n_workers:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the router did not see {self.n_workers} live workers in {timeout_s} s")

    def _stop(self, named: list) -> None:
        for _, proc in named:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in named:
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stuck child is killed, whatever the reason
                proc.kill()
                proc.wait()

    def _stop_router(self) -> None:
        if self._router is not None:
            self._stop([self._router])
            self._router = None

    def stop(self) -> None:
        self.procs.stop()
