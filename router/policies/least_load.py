"""Least load: the worker with the fewest queued requests (report or own in-flight count)."""

from __future__ import annotations

from router.policy import (RouteDecision, RouteRequest, RoutingPolicy, WorkerState, least_loaded,
                           require_workers)


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        require_workers(workers)
        w = least_loaded(workers)
        return RouteDecision(w.worker_id, w.cached_blocks, "least_load")
