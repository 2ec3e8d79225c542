"""Tenant limits shared by router replicas: concurrent requests and tokens per minute, in Redis.

``RedisTenantLimits`` is agentrt's ``TenantLimiter`` (``agentrt/core/tenants.py``) for
``agentrt router``: every replica on one Redis admits against the same counts, so a
tenant gets its limits once, not once per replica. Per tenant, under the router's key
prefix (``RouterConfig.tenant_*_key``):

* ``tenant:<name>:leases``: sorted set, reservation id -> lease deadline (ms). One entry
  per request in flight; entries past their deadline are dropped by the next admission, so
  the slots of a router that died come back within a lease (``lease_s``). The replica that
  holds a reservation renews its lease every third of ``lease_s`` while the request runs.
* ``tenant:<name>:tokens``: sorted set, reservation id -> admission time (ms), and
  ``tenant:<name>:reserved``: hash, reservation id -> tokens. Together the sliding 60 s
  window: admission reserves ``prompt + max_tokens``, release sets the entry to the tokens
  really used (if it is still in the window), entries older than 60 s are dropped.

Admission is one Lua script that drops expired entries, checks both limits and reserves
both (or neither), on Redis's clock (``TIME``), so replicas with skewed clocks agree and two
replicas cannot both take a tenant's last slot. It follows ``TenantLimits`` exactly: a
request is refused for tokens only when the window already holds some and the request
would take it past the limit, and ``Retry-After`` is the time until enough of the window's
tokens leave it. Tenants with neither limit never touch Redis.

Redis unreachable at admission: 503 ``store_unavailable`` with ``Retry-After`` (fail
closed). At release: logged; the lease expires by itself and the window keeps the tokens
reserved (never more than was admitted).

An admission whose outcome the caller never learns (cancelled by a client that went away, or
its reply lost with the connection) may still have reserved on the server, or may still be on
its way there. It is withdrawn at once, whatever the order things reach Redis in:

* admission is idempotent per reservation id: a script that runs again for an id that already
  holds a reservation (redis-py retrying after a lost reply) answers "admitted" and reserves
  nothing more, where a second run used to find the tenant full, refuse, and leave the first
  run's lease behind for a whole ``lease_s``;
* ``tenant:<name>:withdrawn`` is a sorted set, reservation id -> deadline (ms, a lease ahead).
  Withdrawing removes whatever the id reserved and records the id there; an admission script
  for a withdrawn id, even one that reaches Redis after the withdrawal, reserves nothing.

A withdrawal runs in a task of its own (it outlives the cancelled caller) and is retried on
errors for up to a lease (``router.core.retry_for``). ``settle()`` waits for the withdrawals,
releases and unanswered admissions under way: after it, what Redis holds is final.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from agentrt.core.errors import APIError
from agentrt.core.tasks import cancel_and_wait
from agentrt.core.tenants import WINDOW_S, Tenant, TenantLimiter
from router.config import RouterConfig
from router.core import retry_for

log = logging.getLogger("router.tenant_limits")

LEASE_S = 60.0

# Every script takes "now" in ms as its last ARGV; "" means Redis's own clock (tests pass a time).
_NOW = """
local now = tonumber(ARGV[#ARGV])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS[1]: leases, KEYS[2]: tokens, KEYS[3]: reserved, KEYS[4]: withdrawn.
# ARGV: reservation id, tokens, max concurrent (0: none), tokens per minute (0: none), lease ms, window ms, now.
# Returns {1, 0} (reserved, now or by an earlier run for this id), {0, ms until a retry can succeed},
# or {0, -1} (the id was withdrawn: reserve nothing).
_ADMIT = _NOW + """
local id, tokens = ARGV[1], tonumber(ARGV[2])
local max_concurrent, per_minute = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, window = tonumber(ARGV[5]), tonumber(ARGV[6])
local withdrawn = tonumber(redis.call('ZSCORE', KEYS[4], id))
if withdrawn and withdrawn > now then return {0, -1} end
if redis.call('ZSCORE', KEYS[1], id) or redis.call('HEXISTS', KEYS[3], id) == 1 then return {1, 0} end
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= max_concurrent then return {0, 1000} end
end
if per_minute > 0 then
  local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window)
  for i = 1, #old do redis.call('HDEL', KEYS[3], old[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
  local entries = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  local used, counts = 0, {}
  for i = 1, #entries, 2 do
    local n = tonumber(redis.call('HGET', KEYS[3], entries[i]) or '0')
    counts[#counts + 1] = n
    used = used + n
  end
  if used > 0 and used + tokens > per_minute then
    local excess, freed = used + tokens - per_minute, 0
    for i = 1, #counts do
      freed = freed + counts[i]
      if freed >= excess then return {0, math.max(1000, tonumber(entries[2 * i]) + window - now)} end
    end
    return {0, window}
  end
end
if max_concurrent > 0 then
  redis.call('ZADD', KEYS[1], now + lease, id)
  redis.call('PEXPIRE', KEYS[1], lease)
end
if per_minute > 0 then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('HSET', KEYS[3], id, tokens)
  redis.call('PEXPIRE', KEYS[2], window)
  redis.call('PEXPIRE', KEYS[3], window)
end
return {1, 0}
"""

# KEYS[1]: leases, KEYS[2]: reserved. ARGV: reservation id, used tokens ("": keep the reservation).
_RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
return 1
"""

# KEYS[1]: leases, KEYS[2]: tokens, KEYS[3]: reserved, KEYS[4]: withdrawn. ARGV: reservation id, lease ms, now.
# Frees whatever the id reserved (charging nothing) and keeps any later admission of it from reserving.
_WITHDRAW = _NOW + """
local id, lease = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', KEYS[1], id)
redis.call('ZREM', KEYS[2], id)
redis.call('HDEL', KEYS[3], id)
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + lease, id)
redis.call('PEXPIRE', KEYS[4], lease)
return 1
"""

# KEYS: the leases key of each reservation. ARGV: lease ms, then one reservation id per key, then now.
# Extends the leases that still exist; returns the (1-based) positions of those that do not.
_RENEW = _NOW + """
local lease, lost = tonumber(ARGV[1]), {}
for i = 1, #KEYS do
  if redis.call('ZSCORE', KEYS[i], ARGV[i + 1]) then
    redis.call('ZADD', KEYS[i], 'XX', now + lease, ARGV[i + 1])
    redis.call('PEXPIRE', KEYS[i], lease)
  else
    lost[#lost + 1] = i
  end
end
return lost
"""

# KEYS[1]: leases. ARGV: now. The tenant's unexpired leases.
_IN_FLIGHT = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZCARD', KEYS[1])
"""


@dataclass(frozen=True)
class Reservation:
    """One admitted request: ``leased`` holds a concurrent-request lease (the tenant has
    ``max_concurrent_requests``), ``metered`` holds tokens in the window (``tokens_per_minute``)."""

    tenant: str
    id: str
    leased: bool
    metered: bool


def _ms(now: float | None) -> str:
    return "" if now is None else str(int(now * 1000))


class RedisTenantLimits(TenantLimiter):
    """``TenantLimiter`` over the router's Redis client; ``now`` (seconds) is for tests, else Redis's clock."""

    def __init__(self, client: aioredis.Redis, config: RouterConfig, *, lease_s: float = LEASE_S,
                 retry_after_s: int = 1) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self._redis = client
        self.config = config
        self.lease_ms = max(1, int(lease_s * 1000))
        self.window_ms = int(WINDOW_S * 1000)
        self.retry_after_s = retry_after_s
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._in_flight = client.register_script(_IN_FLIGHT)
        self._withdraw = client.register_script(_WITHDRAW)
        self._held: dict[str, Reservation] = {}  # this replica's leased reservations, renewed while held
        self._renewer: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()
        self.lost_leases = 0  # leases that expired while held (Redis unreachable for longer than a lease)
        self.release_errors = 0
        self.withdrawals = 0  # admissions withdrawn because their caller never learnt the outcome
        self.withdraw_errors = 0

    def _keys(self, tenant: str) -> tuple[str, str, str]:
        c = self.config
        return c.tenant_leases_key(tenant), c.tenant_tokens_key(tenant), c.tenant_reserved_key(tenant)

    def _admission_keys(self, tenant: str) -> list[str]:
        return [*self._keys(tenant), self.config.tenant_withdrawn_key(tenant)]

    def _unavailable(self, exc: BaseException) -> APIError:
        return APIError(503, f"the tenant limits store (Redis) is unavailable: {type(exc).__name__}: {exc}; "
                             "retry later", type="server_error", code="store_unavailable",
                        headers={"Retry-After": str(self.retry_after_s)})

    async def admit(self, tenant: Tenant, tokens: int, now: float | None = None) -> tuple[Reservation | None, float]:
        """``(reservation, 0)`` when admitted, ``(None, retry_after_s)`` over a limit; 503 if Redis is down."""
        reservation = Reservation(tenant.name, uuid.uuid4().hex, leased=tenant.max_concurrent_requests is not None,
                                  metered=tenant.tokens_per_minute is not None)
        if not reservation.leased and not reservation.metered:
            return reservation, 0.0
        args = [reservation.id, int(tokens), tenant.max_concurrent_requests or 0, tenant.tokens_per_minute or 0,
                self.lease_ms, self.window_ms, _ms(now)]
        # The script runs in a task of its own: a cancellation that lands inside redis-py can be lost
        # there (Python 3.11's wait_for), so the caller waits on it through a shield.
        call = asyncio.ensure_future(self._admit(keys=self._admission_keys(tenant.name), args=args))
        try:
            admitted, wait_ms = await asyncio.shield(call)
        except (RedisError, OSError) as exc:
            # The script may have run and its reply been lost: withdraw, then answer 503.
            self._withdraw_soon(reservation, now)
            raise self._unavailable(exc) from None
        except asyncio.CancelledError:
            # The caller went away (client disconnect, shutdown) while the script was on its way,
            # running, or answering: whichever it was, the slot and the tokens come back now.
            self._track(call)
            self._withdraw_soon(reservation, now)
            raise
        if not admitted:
            return None, max(1.0, int(wait_ms) / 1000)
        if reservation.leased:
            self._held[reservation.id] = reservation
            self._ensure_renewer()
        return reservation, 0.0

    def _withdraw_soon(self, reservation: Reservation, now: float | None) -> None:
        """Withdraw ``reservation`` in a task of its own (it outlives the cancelled caller; ``aclose`` waits)."""
        self._track(asyncio.get_running_loop().create_task(self._withdraw_now(reservation, now)))

    def _track(self, task: asyncio.Future) -> None:
        """Keep ``task`` until it is done (``aclose`` waits for it); its outcome is not needed."""
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log

    async def _withdraw_now(self, reservation: Reservation, now: float | None) -> None:
        """Withdraw, retrying a failed attempt (a transient error must not leave a slot held) for up to a
        lease, after which whatever the admission reserved has expired anyway."""
        async def failed(_: BaseException) -> None:
            self.withdraw_errors += 1

        try:
            await retry_for(self.lease_ms / 1000).call_with_retry(
                lambda: self._withdraw(keys=self._admission_keys(reservation.tenant),
                                       args=[reservation.id, self.lease_ms, _ms(now)]), failed)
            self.withdrawals += 1
        except (RedisError, OSError) as exc:
            log.warning("cannot withdraw tenant %r's unanswered admission %s (%s); if it reserved, its lease "
                        "has expired by now", reservation.tenant, reservation.id, exc)

    async def release(self, tenant: Tenant, reservation: Reservation, used_tokens: int | None) -> None:
        """Free the lease and charge ``used_tokens``; completes even if the caller is cancelled meanwhile."""
        self._held.pop(reservation.id, None)
        if not reservation.leased and not reservation.metered:
            return
        task = asyncio.get_running_loop().create_task(self._release_now(reservation, used_tokens))
        self._track(task)
        await asyncio.shield(task)

    async def _release_now(self, reservation: Reservation, used_tokens: int | None) -> None:
        leases, _, reserved = self._keys(reservation.tenant)
        try:
            await self._release(keys=[leases, reserved],
                                args=[reservation.id, "" if used_tokens is None else int(used_tokens)])
        except (RedisError, OSError) as exc:
            self.release_errors += 1
            log.warning("cannot release tenant %r's reservation %s (%s); its lease expires within %d ms",
                        reservation.tenant, reservation.id, exc, self.lease_ms)

    async def in_flight(self, tenant_name: str, now: float | None = None) -> int:
        """The tenant's requests in flight on every replica (unexpired leases)."""
        try:
            return int(await self._in_flight(keys=[self.config.tenant_leases_key(tenant_name)], args=[_ms(now)]))
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from None

    @property
    def held(self) -> int:
        """Leases this replica holds (and renews)."""
        return len(self._held)

    # ------------------------------------------------------------ lease renewal

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(), name="tenant-leases")

    async def _renew_forever(self) -> None:
        while self._held:
            await asyncio.sleep(self.lease_ms / 3000)
            await self.renew()

    async def renew(self) -> None:
        """Extend every lease this replica holds by a full lease (the renewer calls it every third of one)."""
        held = list(self._held.values())
        if not held:
            return
        try:
            lost = await self._renew(keys=[self.config.tenant_leases_key(r.tenant) for r in held],
                                     args=[self.lease_ms, *(r.id for r in held), ""])
        except (RedisError, OSError) as exc:
            log.warning("cannot renew %d tenant leases (%s); retrying", len(held), exc)
            return
        for position in lost:
            r = held[int(position) - 1]
            if self._held.pop(r.id, None) is not None:  # not released meanwhile: it really expired
                self.lost_leases += 1
                log.warning("tenant %r's lease %s expired while its request ran (Redis unreachable for longer "
                            "than %d ms?); the request no longer counts against the tenant's concurrency",
                            r.tenant, r.id, self.lease_ms)

    async def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until the releases, withdrawals and unanswered admissions under way are done (then what
        Redis holds for this replica is final); False if some are still running after ``timeout_s``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._releases:  # a task finishing may start none, but wait for those added meanwhile too
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(set(self._releases), timeout=left)
        return True

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Stop renewing and finish the releases and withdrawals under way, for at most ``grace_s`` (call
        before closing the Redis client). What is not done by then expires with its lease."""
        await cancel_and_wait(self._renewer)
        if not await self.settle(grace_s):
            pending = list(self._releases)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
