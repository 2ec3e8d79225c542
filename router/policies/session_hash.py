"""Session hash: a session always maps to the same worker (rendezvous hashing).

Rendezvous (highest-random-weight) hashing keeps a session on its worker when other
workers come and go; only sessions of a removed worker move. Requests without a session
id are keyed on their first block hash, or go to the least-loaded worker if they have none.
"""

from __future__ import annotations

import hashlib

from router.policy import (RouteDecision, RouteRequest, RoutingPolicy, WorkerState, least_loaded,
                           require_workers)


def _weight(key: str, worker_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8).digest(), "little")


class SessionHashPolicy(RoutingPolicy):
    name = "session_hash"

    def select(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        require_workers(workers)
        if request.session_id is not None:
            key = request.session_id
        elif request.hashes:
            key = f"block:{request.hashes[0]}"
        else:
            w = least_loaded(workers)
            return RouteDecision(w.worker_id, w.cached_blocks, "no_key")
        w = max(workers, key=lambda w: _weight(key, w.worker_id))
        return RouteDecision(w.worker_id, w.cached_blocks, "session_hash")
