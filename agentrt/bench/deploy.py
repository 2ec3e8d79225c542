"""Local deployments for the ablation: a private Redis, N ``agentrt worker`` processes, one ``agentrt router``.

The same processes ``agentrt up`` starts (through the same launcher, ``agentrt.procs.Procs``),
spawned here directly because the ladder switches settings ``agentrt up`` does not expose (the
prefix cache, expert placement) and restarts only what a step changes: workers when their flags
change, the router when its policy does. Logs go to a temp dir; :meth:`Deployment.stop` stops
everything (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import time

import httpx

from agentrt.procs import Proc, Procs, tls_context


class Deployment:
    def __init__(self, workers: int, kv_cache_tokens: int | None = None, model: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.n_workers, self.kv_cache_tokens, self.model = workers, kv_cache_tokens, model
        self.procs = Procs(prefix="agentrt-bench-")
        self.redis_url: str | None = None
        self.worker_urls: list[str] = []
        self.router_url: str | None = None
        self._workers: list[Proc] = []
        self._router: Proc | None = None
        self._worker_flags: tuple[str, ...] | None = None
        self._policy: str | None = None
        self._generation = 0

    def _common(self, engine: bool = True) -> list[str]:
        """Flags for every child; ``engine``: a worker's, with the engine settings the router does not offer."""
        out = ["--log-level", "warning", "--heartbeat-interval-s", "0.5", "--heartbeat-ttl-s", "5"]
        if engine and self.kv_cache_tokens is not None:
            out += ["--kv-cache-tokens", str(self.kv_cache_tokens)]
        if self.model is not None:
            out += ["--model", self.model]
        return out

    def ensure(self, worker_flags: tuple[str, ...], policy: str) -> None:
        """Workers running with ``worker_flags`` and a router with ``policy`` (restarting what differs)."""
        if self.redis_url is None:
            self.redis_url = self.procs.redis().url
        if worker_flags != self._worker_flags:
            self._stop_router()
            for worker in self._workers:
                worker.stop()
            self._start_workers(worker_flags)
        if policy != self._policy or self._router is None:
            self._stop_router()
            self._start_router(policy)

    def _start_workers(self, flags: tuple[str, ...]) -> None:
        self._generation += 1
        self._workers = [self.procs.agentrt(f"worker-{i}-g{self._generation}", "worker", "--redis", self.redis_url,
                                            "--worker-id", f"worker-{i}", *self._common(), *flags)
                         for i in range(self.n_workers)]
        self.worker_urls = [worker.url for worker in self._workers]
        for worker in self._workers:
            try:
                worker.wait_ready()
            except RuntimeError as exc:
                raise RuntimeError(f"{' '.join(flags)}: {exc}") from None
        self._worker_flags = flags

    def _start_router(self, policy: str) -> None:
        router = self.procs.agentrt(f"router-{policy}-g{self._generation}", "router", "--redis", self.redis_url,
                                    "--policy", policy, *self._common(engine=False))
        router.wait_ready()
        self._wait_workers(router)
        self._router, self.router_url, self._policy = router, router.url, policy

    def _wait_workers(self, router: Proc, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5, verify=tls_context()) as http:     # one client for the wait
            while time.monotonic() < deadline:
                state = http.get(router.url + "/router/state").json()
                if len(state.get("workers") or []) >= self.n_workers:
                    return
                time.sleep(0.5)
        raise RuntimeError(f"{router.name}: the router did not see {self.n_workers} live workers in {timeout_s} s:\n"
                           f"{router.log()[-3000:]}")

    def _stop_router(self) -> None:
        if self._router is not None:
            self._router.stop()
            self._router = None

    def stop(self) -> None:
        self.procs.stop()
