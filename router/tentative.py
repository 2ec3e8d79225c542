"""Tentative prefix entries: prompts a router has dispatched whose KV the worker has not yet reported.

The ``PrefixIndex`` learns a prefix only from the worker's ``stored`` event, i.e. after the
worker prefilled it. Requests routed in between (typically: several sessions sharing an
agent's system prompt, all starting at once) would see no holder and could compute the same
prefix on several workers. So when a router dispatches a request it records the prompt's
blocks the chosen worker is not yet known to hold as *tentatively* held there:

* in Redis, one short-lived key per block, ``tentative:<deployment>:<hash hex>`` -> worker
  id with a TTL (``tentative_ttl_s``), so every router replica sees them (contract 3: a
  short-lived routing hint any replica reads from Redis, not per-process state);
* in this process as well, so this replica's own dispatches count even while Redis is
  unreachable.

``lookup_shared(hashes)`` reads the Redis entries (the one await of a routing decision);
``holders(hashes, shared)`` adds this replica's entries, read after that await, so that a
decision and its ``record_local`` run with no other decision in between (concurrent
requests then see each other). The router matches the prompt against the real index and
these entries together. An entry goes away
when the worker's ``stored``/``removed`` event for the block arrives (``confirmed``,
locally; the Redis key is then redundant and left to its TTL), shortly after the request
completes (``completed``: its stored events are due; the key is shortened to
``tentative_grace_s``), at once when the request failed (``failed``: compare-and-delete),
and at its TTL if the dispatching router died. Redis errors never fail a request: the
index falls back to local entries and retries Redis after ``redis_backoff_s``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Collection, Sequence

import redis.asyncio as aioredis

from router.config import RouterConfig

log = logging.getLogger("router.tentative")

# KEYS: block keys; ARGV[1]: worker id; ARGV[2]: new TTL in ms, or "0" to delete.
# Only keys still naming that worker change (another dispatch may have taken a key since).
_SHORTEN_OR_DELETE = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    if ARGV[2] == '0' then redis.call('DEL', key) else redis.call('PEXPIRE', key, ARGV[2]) end
    n = n + 1
  end
end
return n
"""

# KEYS: block keys; ARGV[1]: worker id; ARGV[2]: TTL in ms. One command for a prompt's blocks: a
# pipeline of one SET per block cost the router ~4x the CPU (a command packed and parsed per block).
_SET_ALL = """
for _, key in ipairs(KEYS) do
  redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
end
return #KEYS
"""


@dataclass
class TentativeStats:
    recorded: int = 0        # blocks recorded at dispatch
    confirmed: int = 0       # local entries dropped because the worker reported the block
    failed: int = 0          # requests whose entries were dropped because they failed
    redis_errors: int = 0


class TentativeIndex:
    def __init__(self, client: aioredis.Redis, config: RouterConfig, redis_backoff_s: float = 1.0) -> None:
        self._redis = client
        self.config = config
        self.ttl_s = config.tentative_ttl_s
        self.grace_s = config.tentative_grace_s
        self.redis_backoff_s = redis_backoff_s
        self.stats = TentativeStats()
        self._local: dict[int, dict[str, float]] = {}  # hash -> worker -> expiry (monotonic s)
        self._script = client.register_script(_SHORTEN_OR_DELETE)
        self._set_all = client.register_script(_SET_ALL)
        self._redis_down_until = 0.0
        self._pruned_at = 0  # local map size after the last prune

    def __len__(self) -> int:
        return len(self._local)

    # ------------------------------------------------------------ Redis, tolerated to fail

    def _redis_usable(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _redis_failed(self, what: str, exc: BaseException) -> None:
        self.stats.redis_errors += 1
        self._redis_down_until = time.monotonic() + self.redis_backoff_s
        log.info("tentative index: %s failed (%s: %s); local entries only for %.1f s", what,
                 type(exc).__name__, exc, self.redis_backoff_s)

    # ------------------------------------------------------------ reads

    async def lookup_shared(self, hashes: Sequence[int]) -> dict[int, str]:
        """Block hash -> worker, from the Redis entries every replica writes ({} if Redis is unreachable)."""
        if not hashes or self.ttl_s <= 0 or not self._redis_usable():
            return {}
        try:
            values = await self._redis.mget([self.config.tentative_key(h) for h in hashes])
        except (aioredis.RedisError, OSError) as exc:
            self._redis_failed("lookup", exc)
            return {}
        return {h: v.decode() for h, v in zip(hashes, values) if v is not None}

    def holders(self, hashes: Sequence[int], shared: dict[int, str] | None = None) -> dict[int, set[str]]:
        """Block hash -> workers tentatively holding it: this replica's entries (read now, so they
        include every dispatch up to this moment) plus ``shared`` (from ``lookup_shared``)."""
        now = time.monotonic()
        out: dict[int, set[str]] = {}
        for h in hashes:
            entry = self._local.get(h)
            if entry:
                live = {w for w, exp in entry.items() if exp > now}
                if live:
                    out[h] = live
        for h, w in (shared or {}).items():
            out.setdefault(h, set()).add(w)
        return out

    # ------------------------------------------------------------ writes

    def record_local(self, worker_id: str, hashes: Sequence[int]) -> None:
        """``worker_id`` was sent a prompt with these blocks (those it is not yet known to hold).
        Synchronous, so the routing decision and its record happen with no other decision between."""
        if not hashes or self.ttl_s <= 0:
            return
        expiry = time.monotonic() + self.ttl_s
        for h in hashes:
            self._local.setdefault(h, {})[worker_id] = expiry
        self.stats.recorded += len(hashes)
        self._prune()

    async def publish(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Write the entries ``record_local`` made to Redis, for the other replicas."""
        if not hashes or self.ttl_s <= 0 or not self._redis_usable():
            return
        try:
            await self._set_all(keys=[self.config.tentative_key(h) for h in hashes],
                                args=[worker_id, max(1, int(self.ttl_s * 1000))])
        except (aioredis.RedisError, OSError) as exc:
            self._redis_failed("record", exc)

    async def completed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """The request finished: its ``stored`` events are due, keep the entries only ``grace_s`` more."""
        await self._end(worker_id, hashes, self.grace_s)

    async def failed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """The request failed (or was abandoned): the worker may never hold these blocks."""
        self.stats.failed += 1
        await self._end(worker_id, hashes, 0.0)

    async def _end(self, worker_id: str, hashes: Sequence[int], keep_s: float) -> None:
        if not hashes:
            return
        expiry = time.monotonic() + keep_s
        for h in hashes:
            entry = self._local.get(h)
            if entry is not None and worker_id in entry:
                if keep_s > 0:
                    entry[worker_id] = min(entry[worker_id], expiry)
                else:
                    del entry[worker_id]
                    if not entry:
                        del self._local[h]
        if not self._redis_usable():
            return
        try:
            await self._script(keys=[self.config.tentative_key(h) for h in hashes],
                               args=[worker_id, str(max(1, int(keep_s * 1000))) if keep_s > 0 else "0"])
        except (aioredis.RedisError, OSError) as exc:
            self._redis_failed("release", exc)

    def confirmed(self, worker_id: str, hashes: Collection[int]) -> None:
        """The worker's ``stored`` (or ``removed``) event for these blocks arrived: the real index knows.
        Called for every event the consumer applies: in a large one the blocks with a local entry are
        found in C (``keys() &`` iterates ``hashes`` and probes the map), not by a Python loop over
        hundreds of hashes; a small one (a block at a time, at a conversation's tip) is looked up in
        the loop, which costs less than building the sets."""
        local = self._local
        for h in (local.keys() & hashes) if len(hashes) > 8 else hashes:
            entry = local.get(h)
            if entry is not None and entry.pop(worker_id, None) is not None:
                self.stats.confirmed += 1
                if not entry:
                    del local[h]

    def forget_worker(self, worker_id: str) -> None:
        """The worker died or left: drop this replica's entries for it (Redis keys expire)."""
        for h in [h for h, e in self._local.items() if worker_id in e]:
            entry = self._local[h]
            del entry[worker_id]
            if not entry:
                del self._local[h]

    def _prune(self) -> None:
        """Drop expired local entries once the map has grown (amortised)."""
        if len(self._local) < 4096 or len(self._local) < 2 * self._pruned_at:
            return
        now = time.monotonic()
        for h in list(self._local):
            entry = {w: exp for w, exp in self._local[h].items() if exp > now}
            if entry:
                self._local[h] = entry
            else:
                del self._local[h]
        self._pruned_at = len(self._local)
