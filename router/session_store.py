"""Session records and their stores: the ``SessionStore`` interface and its Redis implementation.

A session record is the source of truth that lets any worker rebuild a session after a
failure (contract 3). Turns are idempotent (contract 4): ``append_turn_once`` appends a
turn's messages and reply only if its ``turn_id`` was never recorded, atomically, so two
routers replaying the same turn never append twice; the loser gets the recorded reply.

Redis layout: ``session:<id>`` holds the msgpack record; ``sessions`` is a sorted set of
ids scored by last update (ms); ``tenant:<name>:sessions`` is the sorted set of the tenant's
session ids (scored by creation, ms), which ``create`` checks against the tenant's session limit
and inserts into in one script, so replicas racing for a tenant's last session cannot both get
it; ``session:<id>:turn`` is the turn lock while a turn runs
(``lock_turn``: a random token, SET NX PX; renewed and released only by its holder). Every recorded turn id is kept for the session's life
(the record's size limit bounds it). Decoding is bounded (``session_max_bytes``) and
type-checked; a record that fails is reported as ``SessionDecodeError``, never guessed at.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import msgpack
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from router.config import RouterConfig

RECORD_VERSION = 1

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


class SessionNotFound(KeyError):
    """No session with that id."""


class SessionExists(ValueError):
    """``create`` with an id that is already taken."""


class SessionDecodeError(ValueError):
    """A stored session record is corrupt, too large, or of an unknown version."""


class TooManySessions(RuntimeError):
    """``create`` for a tenant that already holds its limit of sessions."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} holds its maximum of {limit} sessions")
        self.tenant, self.limit = tenant, limit


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class SessionRecord:
    """One session. ``messages``: OpenAI-style message dicts in order; ``turns``: turn id ->
    the reply recorded for it; ``turn``: turns appended so far; ``pinned_until_ms``: the
    KV pin deadline (0: none); ``last_worker``: where its last turn ran."""

    session_id: str
    tenant: str = ""
    model: str = ""
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    pinned_until_ms: int = 0
    last_worker: str | None = None
    turn: int = 0
    turns: dict[str, dict] = field(default_factory=dict)
    created_ms: int = 0
    updated_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, str) or not 0 < len(self.session_id) <= 256:
            raise ValueError("session_id must be a string of 1..256 characters")


class SessionStore:
    """Where session records live. Implementations: ``RedisSessionStore`` (here, shared by
    router replicas) and the in-process store of the embedded server (agentrt/).

    Contracts: ``get`` raises ``SessionNotFound``; ``create`` raises ``SessionExists`` and
    fills ``created_ms``/``updated_ms``, and with ``max_per_tenant`` raises ``TooManySessions``
    (checked and created atomically) when ``record.tenant`` holds that many sessions;
    ``count(tenant)`` is how many it holds; ``append_turn_once`` raises ``SessionNotFound``,
    and is atomic: if ``turn_id`` is recorded it changes nothing and returns
    ``(record, False)``, else it appends ``messages`` then ``reply``, records
    ``turns[turn_id] = reply``, increments ``turn``, sets ``last_worker`` when given, and
    returns ``(new record, True)``. ``turn_record``, if given, is what is recorded under
    ``turn_id`` instead of ``reply`` (the reply message plus usage, for instance).
    Returned records are copies the caller may mutate.
    """

    async def get(self, session_id: str) -> SessionRecord:
        raise NotImplementedError

    async def create(self, record: SessionRecord, max_per_tenant: int | None = None) -> SessionRecord:
        raise NotImplementedError

    async def append_turn_once(self, session_id: str, turn_id: str, messages: list[dict],
                               reply: dict, *, last_worker: str | None = None,
                               turn_record: dict | None = None) -> tuple[SessionRecord, bool]:
        raise NotImplementedError

    async def delete(self, session_id: str, tenant: str | None = None) -> bool:
        """Remove the session (``tenant``: its owner, if the caller knows it); False if it did not exist."""
        raise NotImplementedError

    async def count(self, tenant: str) -> int:
        """How many sessions ``tenant`` holds."""
        raise NotImplementedError

    async def list(self, tenant: str | None = None, limit: int = 100) -> list[str]:
        """Up to ``limit`` session ids, most recently updated first, of ``tenant`` if given."""
        raise NotImplementedError


def apply_turn(record: SessionRecord, turn_id: str, messages: list[dict], reply: dict,
               last_worker: str | None, turn_record: dict | None = None) -> SessionRecord:
    """The record after appending one new turn (shared by every store implementation)."""
    if not turn_id:
        raise ValueError("turn_id must be non-empty")
    if not all(isinstance(m, dict) for m in messages) or not isinstance(reply, dict):
        raise ValueError("messages must be a list of dicts and reply a dict")
    if turn_record is not None and not isinstance(turn_record, dict):
        raise ValueError("turn_record must be a dict")
    return replace(record, messages=[*record.messages, *messages, reply],
                   turns={**record.turns, turn_id: reply if turn_record is None else turn_record},
                   turn=record.turn + 1,
                   last_worker=last_worker if last_worker is not None else record.last_worker,
                   updated_ms=_now_ms())


def encode_record(record: SessionRecord) -> bytes:
    return msgpack.packb({"v": RECORD_VERSION, **asdict(record)})


_FIELD_TYPES = {"session_id": str, "tenant": str, "model": str, "messages": list, "tools": list,
                "settings": dict, "pinned_until_ms": int, "last_worker": (str, type(None)),
                "turn": int, "turns": dict, "created_ms": int, "updated_ms": int}


def decode_record(data: bytes, max_bytes: int) -> SessionRecord:
    if len(data) > max_bytes:
        raise SessionDecodeError(f"session record of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise SessionDecodeError(f"session record is not msgpack: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != RECORD_VERSION:
        raise SessionDecodeError("session record is not a map of a known version")
    obj.pop("v")
    if set(obj) != set(_FIELD_TYPES):
        raise SessionDecodeError(f"session record fields {sorted(obj)} are not the expected ones")
    for name, typ in _FIELD_TYPES.items():
        if not isinstance(obj[name], typ) or isinstance(obj[name], bool):
            raise SessionDecodeError(f"session field {name} has type {type(obj[name]).__name__}")
    try:
        return SessionRecord(**obj)
    except ValueError as e:  # a field of the right type with a value the record refuses
        raise SessionDecodeError(f"session record is invalid: {e}") from None


class RedisSessionStore(SessionStore):
    """Records as msgpack under ``config.session_key(id)``; atomic turns via WATCH/MULTI."""

    def __init__(self, client: aioredis.Redis, config: RouterConfig, max_retries: int = 64) -> None:
        self._redis = client
        self.config = config
        self.max_retries = max_retries
        self._lock_script = client.register_script(_LOCK_RENEW_OR_RELEASE)
        self._create_script = client.register_script(_CREATE)
        self._acquire_script = client.register_script(_LOCK_ACQUIRE)
        self._withdraw_script = client.register_script(_LOCK_WITHDRAW)

    # ------------------------------------------------------------ turn lock (one turn at a time, any replica)

    async def lock_turn(self, session_id: str, token: str, ttl_ms: int) -> bool:
        """Take the session's turn lock for ``token``; False if someone else holds it, or ``token`` was
        withdrawn. Running it again for the same token (a retry) is harmless."""
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms}")
        keys = [self.config.turn_lock_key(session_id), self.config.turn_lock_withdrawn_key(token)]
        return bool(await self._acquire_script(keys=keys, args=[token, str(ttl_ms)]))

    async def withdraw_turn_lock(self, session_id: str, token: str, ttl_ms: int) -> None:
        """For a ``lock_turn`` whose answer was never read: release the lock if ``token`` got it, and
        keep that ``lock_turn`` from taking it if it has not reached Redis yet (for ``ttl_ms``)."""
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

    async def get(self, session_id: str) -> SessionRecord:
        raw = await self._redis.get(self.config.session_key(session_id))
        if raw is None:
            raise SessionNotFound(session_id)
        return decode_record(raw, self.config.session_max_bytes)

    async def create(self, record: SessionRecord, max_per_tenant: int | None = None) -> SessionRecord:
        if max_per_tenant is not None and max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be >= 1, got {max_per_tenant}")
        now = _now_ms()
        record = replace(record, created_ms=record.created_ms or now, updated_ms=now)
        keys = [self.config.session_key(record.session_id), self.config.sessions_set_key,
                self.config.tenant_sessions_key(record.tenant)]
        args = [self._encode(record), now, record.session_id, max_per_tenant or 0]
        created = await self._create_script(keys=keys, args=args)
        if created == -1 and await self._prune_tenant(record.tenant):
            created = await self._create_script(keys=keys, args=args)  # ids of deleted sessions were dropped
        if created == -1:
            raise TooManySessions(record.tenant, max_per_tenant)
        if not created:
            raise SessionExists(record.session_id)
        return record

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

    async def append_turn_once(self, session_id: str, turn_id: str, messages: list[dict],
                               reply: dict, *, last_worker: str | None = None,
                               turn_record: dict | None = None) -> tuple[SessionRecord, bool]:
        key = self.config.session_key(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(self.max_retries):
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        raise SessionNotFound(session_id)
                    record = decode_record(raw, self.config.session_max_bytes)
                    if turn_id in record.turns:
                        await pipe.unwatch()
                        return record, False
                    new = apply_turn(record, turn_id, messages, reply, last_worker, turn_record)
                    pipe.multi()
                    pipe.set(key, self._encode(new))
                    pipe.zadd(self.config.sessions_set_key, {session_id: new.updated_ms})
                    await pipe.execute()
                    return new, True
                except WatchError:
                    continue
                finally:
                    await pipe.reset()
        raise RuntimeError(f"session {session_id}: {self.max_retries} concurrent updates in a row")

    async def delete(self, session_id: str, tenant: str | None = None) -> bool:
        if tenant is None:  # read the owner from the record; an undecodable one is pruned from its set later
            try:
                tenant = (await self.get(session_id)).tenant
            except (SessionNotFound, SessionDecodeError):
                pass
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.config.session_key(session_id))
        pipe.zrem(self.config.sessions_set_key, session_id)
        if tenant is not None:
            pipe.zrem(self.config.tenant_sessions_key(tenant), session_id)
        deleted = (await pipe.execute())[0]
        return bool(deleted)

    async def list(self, tenant: str | None = None, limit: int = 100) -> list[str]:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        ids = [m.decode() for m in await self._redis.zrevrange(self.config.sessions_set_key, 0, -1)]
        if tenant is None:
            return ids[:limit]
        out = []
        for sid in ids:
            if len(out) >= limit:
                break
            try:
                if (await self.get(sid)).tenant == tenant:
                    out.append(sid)
            except SessionNotFound:
                continue
        return out

    def _encode(self, record: SessionRecord) -> bytes:
        data = encode_record(record)
        if len(data) > self.config.session_max_bytes:
            raise ValueError(f"session {record.session_id} would be {len(data)} bytes, over the "
                             f"{self.config.session_max_bytes}-byte limit")
        return data
