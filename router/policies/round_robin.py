"""Round robin: each request to the next worker in id order; ignores cache and load."""

from __future__ import annotations

from router.policy import RouteDecision, RouteRequest, RoutingPolicy, WorkerState, require_workers


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        require_workers(workers)
        ordered = sorted(workers, key=lambda w: w.worker_id)
        w = ordered[self._next % len(ordered)]
        return RouteDecision(w.worker_id, w.cached_blocks, "round_robin")

    def on_dispatch(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._next += 1
