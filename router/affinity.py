"""Where conversations named by an affinity key run: the key's worker, in Redis, for every replica.

A client that keeps its own history names the conversation (``prompt_cache_key``, a session
header: ``agentrt/core/affinity.py``), and the router gets a ``SessionHint`` with ``remember`` set and
no last worker. ``RemoteEngine`` looks the conversation's worker up here before routing and passes
it to the policy as the last worker (soft affinity: it wins unless it is overloaded, dead, or
holds too little of the prompt), then records the worker the request went to. Each record is one
Redis key, ``affinity:<deployment>:<hint session id>`` -> worker id, written with a TTL of
``affinity_ttl_s`` on every request (so the TTL runs from the conversation's last request), and
rewritten when the conversation moves (its worker was overloaded or died, a failover): every
router replica reads the same mapping.

A mapping is a hint: Redis errors never fail a request. After one, the replica routes such
requests by prefix alone (and records nothing) for ``redis_backoff_s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from router.config import RouterConfig

log = logging.getLogger("router.affinity")


@dataclass
class AffinityStats:
    hits: int = 0          # lookups that found the conversation's worker
    misses: int = 0        # lookups that found none (a new conversation, or its mapping expired)
    moved: int = 0         # requests sent elsewhere than the conversation's recorded worker
    redis_errors: int = 0


class AffinityMap:
    def __init__(self, client: aioredis.Redis, config: RouterConfig, redis_backoff_s: float = 1.0) -> None:
        self._redis = client
        self.config = config
        self.ttl_s = config.affinity_ttl_s
        self.redis_backoff_s = redis_backoff_s
        self.stats = AffinityStats()
        self._redis_down_until = 0.0

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def _usable(self) -> bool:
        return self.enabled and time.monotonic() >= self._redis_down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.redis_errors += 1
        self._redis_down_until = time.monotonic() + self.redis_backoff_s
        log.info("affinity: %s failed (%s: %s); routing by prefix alone for %.1f s", what,
                 type(exc).__name__, exc, self.redis_backoff_s)

    async def worker_of(self, session_id: str) -> str | None:
        """The worker the conversation's last request went to (None: unknown, expired, or Redis down)."""
        if not self._usable():
            return None
        try:
            value = await self._redis.get(self.config.affinity_key(session_id))
        except (aioredis.RedisError, OSError) as exc:
            self._failed("lookup", exc)
            return None
        if value is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return value.decode()

    async def remember(self, session_id: str, worker_id: str, previous: str | None = None) -> None:
        """The conversation's request went to ``worker_id`` (``previous``: the worker it was mapped to):
        map it there for ``affinity_ttl_s`` from now."""
        if previous is not None and previous != worker_id:
            self.stats.moved += 1
            log.info("affinity %s moved from %s to %s", session_id, previous, worker_id)
        if not self._usable():
            return
        try:
            await self._redis.set(self.config.affinity_key(session_id), worker_id,
                                  px=max(1, int(self.ttl_s * 1000)))
        except (aioredis.RedisError, OSError) as exc:
            self._failed("record", exc)
