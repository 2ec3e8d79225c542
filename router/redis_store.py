"""Sessions in Redis, shared by router replicas: ``RedisSessionStore`` implements agentrt's
``SessionStore`` (``agentrt/core/store.py``) on its own ``SessionRecord`` and errors.

A session record is the source of truth that lets any worker rebuild a session after a
failure (contract 3). Turns are idempotent (contract 4): ``append_turn_once`` appends a
turn's messages and reply only if its ``turn_id`` was never recorded, in one WATCH/MULTI
transaction, so two routers replaying the same turn never append twice; the loser gets the
recorded reply. It also records where the turn ran: ``worker_of(pin_id)`` names the worker (a
turn's pin id is its request id; the router's ``RemoteEngine.worker_of`` provides it) and the
record's ``last_worker`` takes it.

Redis layout: ``session:<id>`` holds the msgpack record (``encode_record``: the record's
fields as a map, plus ``v``, the format's version); ``sessions`` is a sorted set of ids scored
by last activity (ms); ``tenant:<name>:sessions`` is the sorted set of the tenant's session ids,
which ``create`` checks against the tenant's session limit and inserts into in one script, so
replicas racing for a tenant's last session cannot both get it; ``session:<id>:turn`` is the
turn lock while a turn runs (``lock_turn``: a random token, SET NX PX; renewed and released
only by its holder, see ``RedisTurnLock``). A turn touches Redis twice: ``open_turn`` reads the
record and takes the lock in one script, ``append_turn_once(lock=...)`` writes the turn and deletes
the lock in one transaction. Every recorded turn id is kept for the session's
life (the record's size limit, ``session_max_bytes``, bounds it).

Decoding (``decode_record``) is bounded (``session_max_bytes``) and type-checked down to each
message and turn by msgspec structs (``_Record``, ``_Turn``: the format's fields and types, version 2's
defaults in ``_RecordV2``); a record that fails is never guessed at: it is counted in ``bad_records``,
logged, ``get`` raises ``SessionDecodeError`` naming the session (agentrt's session manager
answers 500 ``session_record_corrupt``), and ``list`` skips it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
from dataclasses import asdict
from typing import Annotated, Any, Awaitable, Callable

import msgpack
import msgspec
import redis.asyncio as aioredis
from msgspec import Meta
from redis.exceptions import WatchError

from agentrt.core.store import (SessionDecodeError, SessionExists, SessionNotFound, SessionRecord, SessionStore,
                           SessionTooLarge, TenantSessionLimitReached, TurnLock, TurnRecord, apply_turn,
                           apply_turn_update, check_tenant_limit)
from agentrt.core.tasks import in_background
from router.config import RouterConfig
from router.core import retry_for

log = logging.getLogger("router.redis_store")

RECORD_VERSION = 3  # 3: turns carry ``response`` (the Responses API's record); 2 (without it) is still read

# KEYS[1]: session key, KEYS[2]: the sessions set, KEYS[3]: the tenant's sessions set.
# ARGV[1]: the encoded record, ARGV[2]: now (ms), ARGV[3]: session id, ARGV[4]: the tenant's limit (0: none).
# Returns 1 (created), 0 (the id exists), -1 (the tenant is at its limit).
_CREATE = """
local limit = tonumber(ARGV[4])
if limit > 0 and redis.call('ZCARD', KEYS[3]) >= limit then return -1 end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[3])
return 1
"""

# KEYS[1]: lock key, KEYS[2]: the token's withdrawn marker; ARGV[1]: holder token; ARGV[2]: TTL in ms.
# Idempotent for one token (a retry after a lost reply finds the lock its own), and never takes the
# lock for a token that was withdrawn (an acquisition that reaches Redis after its withdrawal).
_LOCK_ACQUIRE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# ``_LOCK_ACQUIRE`` and the record in one step (a turn's first touch of the store, ``open_turn``):
# KEYS[3]: the session key. Returns {} when there is no record (no lock taken), else {taken, record}.
_OPEN_TURN = """
local record = redis.call('GET', KEYS[3])
if not record then return {} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0, record} end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return {1, record} end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, record} end
return {0, record}
"""

# KEYS[1]: lock key, KEYS[2]: the token's withdrawn marker; ARGV[1]: token; ARGV[2]: TTL in ms.
_LOCK_WITHDRAW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
return 1
"""

# KEYS[1]: lock key; ARGV[1]: holder token; ARGV[2]: new TTL in ms, or "0" to release.
_LOCK_RENEW_OR_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""


def _ms(t: float) -> int:
    return int(t * 1000)


# ------------------------------------------------------------ the record's bytes

def encode_record(record: SessionRecord) -> bytes:
    return msgpack.packb({"v": RECORD_VERSION, **asdict(record)})


# The record's wire types (``SessionRecord``/``TurnRecord`` as stored): every field required unless a
# default says which older records lack it, no other field, and msgspec's strict types (a bool is never an
# int, an int is a float where a float is meant). Values inside messages, tools, sampling, metadata and
# responses are any msgpack (no bin or ext: ``decode_record``'s unpack refuses those anywhere).
Json = dict[str, Any]


class _Turn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    turn_id: str
    index: int
    message: Json
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created_at: float
    pin_id: str | None
    pin_expires_at: float
    raw_text: str | None
    response: Json | None
    cached_tokens_by_tier: dict[str, int] | None = None   # written before KV tiers: not reported
    in_slo: bool | None = None                           # written before SLO outcomes: not recorded


class _TurnV2(_Turn, kw_only=True):
    response: Json | None = None  # version 2 turns had no response


class _Record(msgspec.Struct, forbid_unknown_fields=True, tag_field="v", tag=RECORD_VERSION):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    model: str
    system: str | None
    tools: list[Json] | None
    sampling: Json
    metadata: Json
    idle_ttl_s: float
    pin_ttl_s: float | None
    parent_id: str | None
    created_at: float
    last_active_at: float
    messages: list[Json]
    turns: list[_Turn]
    last_worker: str | None
    tenant: str


class _RecordV2(_Record, tag=2):
    turns: list[_TurnV2]


def decode_record(data: bytes, max_bytes: int) -> SessionRecord:
    """The record in ``data``, or ``SessionDecodeError``: over ``max_bytes``, not msgpack (or bin or ext
    values in it), an unknown version, or any field (each message, tool and turn included) missing, extra
    or of the wrong type; the error names the field's path and what it must be."""
    if len(data) > max_bytes:
        raise SessionDecodeError(f"session record of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise SessionDecodeError(f"session record is not msgpack: {e}") from None
    try:
        wire = msgspec.convert(obj, _Record | _RecordV2)
    except msgspec.ValidationError as e:
        raise SessionDecodeError(f"session record is invalid: {e}") from None
    turns = [TurnRecord(**msgspec.structs.asdict(t)) for t in wire.turns]
    return SessionRecord(**{**msgspec.structs.asdict(wire), "turns": turns})


# ------------------------------------------------------------ the turn lock

class RedisTurnLock(TurnLock):
    """A held turn lock: renewed in the background until ``release``. ``store``: what renews and
    releases it (``renew_turn_lock``, ``unlock_turn``), the ``RedisSessionStore`` that took it."""

    def __init__(self, store: RedisSessionStore, session_id: str, token: str, ttl_ms: int) -> None:
        self.store, self.session_id, self.token, self.ttl_ms = store, session_id, token, ttl_ms
        self._released = False
        self._unlocking: asyncio.Task | None = None  # the release's Redis work, which outlives its caller
        self._renewer = asyncio.get_running_loop().create_task(self._renew_forever(),
                                                               name=f"turn-lock-{session_id}")

    async def _renew_forever(self) -> None:
        while not self._released:
            await asyncio.sleep(self.ttl_ms / 3000)
            if self._released:
                return
            try:
                held = await self.store.renew_turn_lock(self.session_id, self.token, self.ttl_ms)
            except (aioredis.RedisError, OSError) as exc:
                if not self._released:
                    log.warning("cannot renew the turn lock of session %s: %s; retrying", self.session_id, exc)
                continue
            if not held:
                if not self._released:
                    log.warning("turn lock of session %s was lost (expired while Redis was unreachable?)",
                                self.session_id)
                return

    def released_by_store(self) -> None:
        """The store deleted the lock in a transaction of its own (``append_turn_once(lock=...)``): stop
        renewing; ``release`` then does nothing."""
        self._released = True
        self._renewer.cancel()

    async def release(self) -> None:
        """Stop renewing and delete the lock; the deletion completes even if the caller is cancelled
        meanwhile (a client that disconnects as its turn ends must not leave the session locked)."""
        if self._released:
            return
        self._released = True
        self._renewer.cancel()
        self._unlocking = asyncio.get_running_loop().create_task(self._unlock())
        await asyncio.shield(self._unlocking)

    async def _unlock(self) -> None:
        # Never wait on the renewer for long: a cancellation that lands as a Redis command completes
        # can be lost inside the client (asyncio.wait_for on Python 3.11 drops it), and awaiting the
        # renewer then held the turn, and its client's stream, forever. The renewer stops by itself
        # at its next look at _released.
        await asyncio.wait({self._renewer}, timeout=1.0)
        if self._renewer.done() and not self._renewer.cancelled() and self._renewer.exception() is not None:
            log.warning("turn lock renewer of session %s failed: %r", self.session_id, self._renewer.exception())
        try:
            await self.store.unlock_turn(self.session_id, self.token)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("cannot release the turn lock of session %s (%s); it expires in %d ms", self.session_id,
                        exc, self.ttl_ms)


# ------------------------------------------------------------ the store

class RedisSessionStore(SessionStore):
    """Records as msgpack under ``config.session_key(id)``; atomic turns via WATCH/MULTI; the turn
    lock across replicas. ``worker_of(pin_id)``: the worker a turn ran on, if known (None: never
    known, ``last_worker`` stays unset); ``list_limit``: ``list``'s cap when no limit is given;
    ``max_retries``: concurrent updates ``append_turn_once`` outlasts before it gives up.

    The turn lock's TTL (``RouterConfig.turn_lock_ttl_s``) is renewed every third of it while the
    turn runs; it only bounds how long a router that died mid-turn keeps the session locked."""

    def __init__(self, client: aioredis.Redis, config: RouterConfig,
                 worker_of: Callable[[str], str | None] | None = None, *, list_limit: int = 1000,
                 max_retries: int = 64) -> None:
        self._redis = client
        self.config = config
        self.worker_of = worker_of or (lambda _pin_id: None)
        self.list_limit = list_limit
        self.max_retries = max_retries
        self.lock_ttl_ms = max(1, int(config.turn_lock_ttl_s * 1000))
        self.bad_records = 0  # undecodable records met (each logged)
        self._withdrawals: set[asyncio.Task] = set()  # turn locks being withdrawn (kept until done)
        self._lock_script = client.register_script(_LOCK_RENEW_OR_RELEASE)
        self._create_script = client.register_script(_CREATE)
        self._acquire_script = client.register_script(_LOCK_ACQUIRE)
        self._withdraw_script = client.register_script(_LOCK_WITHDRAW)
        self._open_script = client.register_script(_OPEN_TURN)

    # ------------------------------------------------------------ turn lock (one turn at a time, any replica)

    async def lock_turn(self, session_id: str) -> TurnLock | None:
        token = secrets.token_hex(16)
        acquire = self._acquire_turn_lock(session_id, token, self.lock_ttl_ms)
        locked = await self._unwithdrawn(session_id, token, acquire)
        return RedisTurnLock(self, session_id, token, self.lock_ttl_ms) if locked else None

    async def open_turn(self, session_id: str) -> tuple[SessionRecord | None, TurnLock | None]:
        token = secrets.token_hex(16)
        keys = [self.config.turn_lock_key(session_id), self.config.turn_lock_withdrawn_key(token),
                self.config.session_key(session_id)]
        reply = await self._unwithdrawn(session_id, token,
                                        self._open_script(keys=keys, args=[token, str(self.lock_ttl_ms)]))
        if not reply:
            return None, None
        taken, raw = reply
        lock = RedisTurnLock(self, session_id, token, self.lock_ttl_ms) if taken else None
        try:
            return self._decode(session_id, raw), lock
        except BaseException:
            if lock is not None:
                await lock.release()
            raise

    async def _unwithdrawn(self, session_id: str, token: str, acquire: Awaitable[Any]) -> Any:
        """``await acquire`` (a command that may take the turn lock for ``token``). As with tenant admission:
        the command runs in a task of its own, and a caller that never reads its answer (cancelled, or the
        reply lost) withdraws it, whatever Redis did with it."""
        call = asyncio.ensure_future(acquire)
        try:
            return await asyncio.shield(call)
        except BaseException:
            call.add_done_callback(lambda t: t.cancelled() or t.exception())  # outcome not needed any more
            in_background(self._withdrawals, self._withdraw_lock(session_id, token))
            raise

    async def _acquire_turn_lock(self, session_id: str, token: str, ttl_ms: int) -> bool:
        """Take the session's turn lock for ``token``; False if someone else holds it, or ``token`` was
        withdrawn. Running it again for the same token (a retry) is harmless."""
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        keys = [self.config.turn_lock_key(session_id), self.config.turn_lock_withdrawn_key(token)]
        return bool(await self._acquire_script(keys=keys, args=[token, str(ttl_ms)]))

    async def _withdraw_lock(self, session_id: str, token: str) -> None:
        async def failed(_: BaseException) -> None:
            pass

        try:  # retried for up to the lock's TTL: a transient error must not leave the session locked
            await retry_for(self.lock_ttl_ms / 1000).call_with_retry(
                lambda: self.withdraw_turn_lock(session_id, token, self.lock_ttl_ms), failed)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("cannot withdraw an unanswered turn lock of session %s (%s); if it was taken, it "
                        "expires in %d ms", session_id, exc, self.lock_ttl_ms)

    async def withdraw_turn_lock(self, session_id: str, token: str, ttl_ms: int) -> None:
        """For a lock request whose answer was never read: release the lock if ``token`` got it, and
        keep that request from taking it if it has not reached Redis yet (for ``ttl_ms``)."""
        keys = [self.config.turn_lock_key(session_id), self.config.turn_lock_withdrawn_key(token)]
        await self._withdraw_script(keys=keys, args=[token, str(ttl_ms)])

    async def renew_turn_lock(self, session_id: str, token: str, ttl_ms: int) -> bool:
        """Extend the lock if ``token`` still holds it; False if it was lost (expired, taken)."""
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        return bool(await self._lock_script(keys=[self.config.turn_lock_key(session_id)], args=[token, str(ttl_ms)]))

    async def unlock_turn(self, session_id: str, token: str) -> bool:
        """Release the lock if ``token`` holds it (compare-and-delete); False otherwise."""
        return bool(await self._lock_script(keys=[self.config.turn_lock_key(session_id)], args=[token, "0"]))

    async def turn_locked(self, session_id: str) -> bool:
        return bool(await self._redis.exists(self.config.turn_lock_key(session_id)))

    # ------------------------------------------------------------ records

    def _decode(self, session_id: str, raw: bytes) -> SessionRecord:
        try:
            return decode_record(raw, self.config.session_max_bytes)
        except SessionDecodeError as exc:
            self.bad_records += 1
            log.error("undecodable session record %s: %s", session_id, exc)
            raise SessionDecodeError(f"the record of session '{session_id}' is corrupt: {exc}") from None

    def _encode(self, record: SessionRecord) -> bytes:
        data = encode_record(record)
        if len(data) > self.config.session_max_bytes:
            raise SessionTooLarge(f"session {record.id} would be {len(data)} bytes, over the "
                                  f"{self.config.session_max_bytes}-byte limit")
        return data

    async def get(self, session_id: str) -> SessionRecord | None:
        raw = await self._redis.get(self.config.session_key(session_id))
        return None if raw is None else self._decode(session_id, raw)

    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        check_tenant_limit(max_tenant_sessions)
        keys = [self.config.session_key(record.id), self.config.sessions_set_key,
                self.config.tenant_sessions_key(record.tenant)]
        args = [self._encode(record), _ms(record.last_active_at), record.id, max_tenant_sessions or 0]
        created = await self._create_script(keys=keys, args=args)
        if created == -1 and await self._prune_tenant(record.tenant):
            created = await self._create_script(keys=keys, args=args)  # ids of deleted sessions were dropped
        if created == -1:
            raise TenantSessionLimitReached(record.tenant, max_tenant_sessions)
        if not created:
            raise SessionExists(record.id)
        return copy.deepcopy(record)

    async def _prune_tenant(self, tenant: str) -> int:
        """Drop ids from the tenant's set whose record is gone (deleted without the tenant known, or
        by a router older than the set); returns how many."""
        key = self.config.tenant_sessions_key(tenant)
        ids = [m.decode() for m in await self._redis.zrange(key, 0, -1)]
        if not ids:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        for sid in ids:
            pipe.exists(self.config.session_key(sid))
        gone = [sid for sid, exists in zip(ids, await pipe.execute()) if not exists]
        if gone:
            await self._redis.zrem(key, *gone)
        return len(gone)

    async def count(self, tenant: str) -> int:
        await self._prune_tenant(tenant)
        return await self._redis.zcard(self.config.tenant_sessions_key(tenant))

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord, lock: TurnLock | None = None) -> tuple[SessionRecord, bool]:
        worker = self.worker_of(reply.pin_id) if reply.pin_id else None
        recorded: list[SessionRecord] = []

        def append(record: SessionRecord) -> SessionRecord | None:
            if record.find_turn(turn_id) is not None:
                recorded.append(record)
                return None
            return apply_turn(record, turn_id, new_messages, reply, last_worker=worker)

        held = lock if isinstance(lock, RedisTurnLock) and lock.session_id == session_id else None
        new = await self._update(session_id, append, held)
        if new is None and lock is not None:  # recorded already (a concurrent retry): nothing was written
            await lock.release()
        return (recorded[0], False) if new is None else (new, True)

    async def update_turn(self, session_id: str, turn_id: str, /, **changes: Any) -> SessionRecord | None:
        return await self._update(session_id, lambda record: apply_turn_update(record, turn_id, changes))

    async def _update(self, session_id: str, change: Callable[[SessionRecord], SessionRecord | None],
                      lock: RedisTurnLock | None = None) -> SessionRecord | None:
        """Store ``change(record)`` in one WATCH/MULTI transaction (run again when another client wrote
        the record meanwhile) and return it; None, with nothing written, when ``change`` returns None.
        ``lock``: a turn lock released in the same transaction, if it still holds (compare-and-delete
        under WATCH: a lock that expired and was taken by another turn meanwhile is left to that turn)."""
        key = self.config.session_key(session_id)
        lock_key = self.config.turn_lock_key(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(self.max_retries):
                try:
                    await pipe.watch(*((key, lock_key) if lock is not None else (key,)))
                    raw = await pipe.get(key)
                    if raw is None:
                        raise SessionNotFound(session_id)
                    new = change(self._decode(session_id, raw))
                    if new is None:
                        await pipe.unwatch()
                        return None
                    holds = lock is not None and await pipe.get(lock_key) == lock.token.encode()
                    pipe.multi()
                    pipe.set(key, self._encode(new))
                    pipe.zadd(self.config.sessions_set_key, {session_id: _ms(new.last_active_at)})
                    if holds:
                        pipe.delete(lock_key)
                    await pipe.execute()
                    if lock is not None:
                        lock.released_by_store()
                    return new
                except WatchError:
                    continue
                finally:
                    await pipe.reset()
        raise RuntimeError(f"session {session_id}: {self.max_retries} concurrent updates in a row")

    async def delete(self, session_id: str) -> SessionRecord | None:
        """Remove the session and return its record; an undecodable one is removed too (None is
        returned, and its id is pruned from its tenant's set later, the owner being unreadable)."""
        try:
            record = await self.get(session_id)
        except SessionDecodeError:
            record = None
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.config.session_key(session_id))
        pipe.zrem(self.config.sessions_set_key, session_id)
        if record is not None:
            pipe.zrem(self.config.tenant_sessions_key(record.tenant), session_id)
        deleted = (await pipe.execute())[0]
        return record if deleted else None

    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionRecord]:
        limit = self.list_limit if limit is None else limit
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        ids = [m.decode() for m in await self._redis.zrevrange(self.config.sessions_set_key, 0, -1)]
        out: list[SessionRecord] = []
        for start in range(0, len(ids), 100):  # a hundred records a round trip
            if len(out) >= limit:
                break
            chunk = ids[start:start + 100]
            for sid, raw in zip(chunk, await self._redis.mget([self.config.session_key(s) for s in chunk])):
                if raw is None:  # deleted meanwhile
                    continue
                try:
                    record = self._decode(sid, raw)
                except SessionDecodeError:  # counted and logged
                    continue
                if tenant is None or record.tenant == tenant:
                    out.append(record)
                    if len(out) >= limit:
                        break
        return out
