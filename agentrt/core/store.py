"""Where sessions live: the :class:`SessionStore` interface, its record and error types, and the
in-process implementation.

This module is the one definition every store shares: the record (:class:`SessionRecord`, its
turns :class:`TurnRecord`), the errors (:class:`SessionStoreError` and its subclasses), the turn
lock (:class:`TurnLock`) and the contract (:class:`SessionStore`). :class:`InMemorySessionStore`
keeps sessions in this process; the router's ``router.redis_store.RedisSessionStore`` keeps the
same records in Redis (as msgpack, DESIGN.md contract 3), shared by router replicas.

A session record is plain data (it must serialize). The store's one write that matters is
:meth:`SessionStore.append_turn_once`: it appends a turn's messages and its reply in one
step, at most once per turn id (contract 4), so a retried turn never appends twice and a
failed turn never appends half.
"""

from __future__ import annotations

import abc
import asyncio
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TurnRecord:
    """The recorded outcome of one turn: what a replay of its turn id returns."""

    turn_id: str
    index: int
    message: dict[str, Any]  # the assistant message, OpenAI shape
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    created_at: float
    pin_id: str | None = None
    pin_expires_at: float = 0.0
    raw_text: str | None = None  # the reply as the model wrote it: re-rendered verbatim for cache reuse
    # The Responses API's record of this turn (``agentrt/api/responses.py``: the response object and its
    # input items); None for a plain session turn, and once the response is deleted.
    response: dict[str, Any] | None = None
    # ``cached_tokens`` by where the engine found them: {"device", "host", "disk"} (KV tiers,
    # engine/kv_tier.py); None when not reported (a record written before tiers existed)
    cached_tokens_by_tier: dict[str, int] | None = None
    # whether the turn met the server's latency SLO (``Generator.meets_slo``); None: not recorded
    in_slo: bool | None = None


@dataclass
class SessionRecord:
    """Everything needed to rebuild a session on any worker. ``id``: 1..256 characters."""

    id: str
    model: str
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    idle_ttl_s: float = 3600.0
    pin_ttl_s: float | None = None
    parent_id: str | None = None
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    last_worker: str | None = None  # where the last turn ran (router mode; None in-process)
    tenant: str = "default"  # the tenant that owns it: only that tenant's keys see the session

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not 0 < len(self.id) <= 256:
            raise ValueError("a session id must be a string of 1..256 characters")

    @property
    def expires_at(self) -> float:
        return self.last_active_at + self.idle_ttl_s

    @property
    def last_turn(self) -> TurnRecord | None:
        return self.turns[-1] if self.turns else None

    def find_turn(self, turn_id: str) -> TurnRecord | None:
        for turn in self.turns:
            if turn.turn_id == turn_id:
                return turn
        return None

    def usage(self) -> dict[str, int]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        completion = sum(t.completion_tokens for t in self.turns)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "cached_tokens": sum(t.cached_tokens for t in self.turns),
                "total_tokens": prompt + completion}


def apply_turn(record: SessionRecord, turn_id: str, new_messages: list[dict[str, Any]], reply: TurnRecord,
               last_worker: str | None = None) -> SessionRecord:
    """The record after appending one new turn (every store's ``append_turn_once`` writes this):
    ``new_messages`` then ``reply.message`` appended to the history, ``reply`` recorded,
    ``last_active_at`` refreshed, ``last_worker`` set when given. ``record`` is not changed."""
    if not turn_id or reply.turn_id != turn_id:
        raise ValueError(f"turn_id must be non-empty and the reply's own, got {turn_id!r} for a reply "
                         f"to {reply.turn_id!r}")
    if not all(isinstance(m, dict) for m in new_messages) or not isinstance(reply.message, dict):
        raise ValueError("new_messages must be a list of dicts and the reply's message a dict")
    return dataclasses.replace(
        record, messages=[*record.messages, *copy.deepcopy(new_messages), copy.deepcopy(reply.message)],
        turns=[*record.turns, copy.deepcopy(reply)],
        last_active_at=max(record.last_active_at, time.time()),
        last_worker=last_worker if last_worker is not None else record.last_worker)


_FIXED_TURN_FIELDS = ("turn_id", "index")


def apply_turn_update(record: SessionRecord, turn_id: str, changes: dict[str, Any]) -> SessionRecord | None:
    """The record with ``changes`` (TurnRecord fields other than ``turn_id`` and ``index``) made to its
    turn ``turn_id`` (every store's ``update_turn`` writes this); None if it has no such turn.
    ``record`` is not changed; ``last_active_at`` is kept."""
    changeable = {f.name for f in dataclasses.fields(TurnRecord)} - set(_FIXED_TURN_FIELDS)
    bad = sorted(set(changes) - changeable)
    if bad:
        raise ValueError(f"cannot update turn fields {bad}")
    turns = list(record.turns)
    for i, turn in enumerate(turns):
        if turn.turn_id == turn_id:
            turns[i] = dataclasses.replace(turn, **copy.deepcopy(changes))
            return dataclasses.replace(record, turns=turns)
    return None


class SessionStoreError(Exception):
    """What a session store raises (each subclass also derives from the built-in error it refines)."""


class SessionNotFound(SessionStoreError, KeyError):
    """No session with that id (never created, deleted, or expired)."""


class SessionExists(SessionStoreError, ValueError):
    """``create`` with an id that is already taken."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} already exists")
        self.session_id = session_id


class SessionLimitReached(SessionStoreError, RuntimeError):
    """The store holds as many sessions as it may."""


class TenantSessionLimitReached(SessionLimitReached):
    """The session's tenant holds as many sessions as it may (``create``'s ``max_tenant_sessions``)."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant '{tenant}' holds its maximum of {limit} sessions; delete one or retry later")
        self.tenant, self.limit = tenant, limit


class SessionTooLarge(SessionStoreError, ValueError):
    """A record would exceed the store's size limit (stores that serialize records have one)."""


class SessionDecodeError(SessionStoreError, ValueError):
    """A stored session record is corrupt, too large, or of an unknown version (stores that serialize
    records); the record is never guessed at."""


def check_tenant_limit(max_tenant_sessions: int | None) -> None:
    if max_tenant_sessions is not None and (isinstance(max_tenant_sessions, bool) or max_tenant_sessions < 1):
        raise ValueError(f"max_tenant_sessions must be >= 1, got {max_tenant_sessions!r}")


class TurnLock(abc.ABC):
    """A session's turn lock, held by the one turn running on it. ``release`` is idempotent."""

    @abc.abstractmethod
    async def release(self) -> None:
        ...


class _LocalTurnLock(TurnLock):
    def __init__(self, held: set[str], session_id: str) -> None:
        self._held, self._session_id = held, session_id
        self._released = False

    async def release(self) -> None:
        if not self._released:   # once: a second call must not free the lock of a turn that took it since
            self._released = True
            self._held.discard(self._session_id)


class SessionStore(abc.ABC):
    """Contract every store implements (:class:`InMemorySessionStore` here; the router's
    ``RedisSessionStore``, shared by its replicas). A missing, taken, full, oversized or
    unreadable session raises a :class:`SessionStoreError`; a bad argument, ValueError.

    Records returned are copies: changing one changes nothing stored.
    - ``create(record, max_tenant_sessions)`` stores a new record as given and returns a copy;
      raises :class:`SessionExists` when the id is taken, :class:`SessionLimitReached` when
      full, and :class:`TenantSessionLimitReached` when ``record.tenant`` already holds
      ``max_tenant_sessions`` sessions (None: no limit; below 1: ValueError). The check and
      the insert are one atomic step (across router replicas with the Redis store).
    - ``get(id)`` returns the record or None.
    - ``append_turn_once(id, turn_id, new_messages, reply)`` atomically: if a turn with
      ``turn_id`` is recorded, returns ``(record, False)`` and changes nothing; otherwise
      stores :func:`apply_turn`'s record and returns ``(record, True)``. Raises
      :class:`SessionNotFound` if the session is gone, ValueError for a ``turn_id`` that is
      empty or not ``reply.turn_id``.
    - ``update_turn(id, turn_id, **changes)`` atomically stores :func:`apply_turn_update`'s record
      (the turn's fields, never its id or index, changed) and returns it; None if the session has no
      turn ``turn_id``. Raises :class:`SessionNotFound` if the session is gone, ValueError for a
      field that cannot change.
    - ``delete(id)`` removes it and returns the removed record (None if absent).
    - ``list(tenant, limit)`` returns the records (of ``tenant`` if given), most recently
      active first, at most ``limit`` of them (None: the store's own cap, if any).
    - ``count(tenant)`` returns how many sessions ``tenant`` holds.
    - ``lock_turn(id)`` takes the session's turn lock and returns it, or None when a turn
      holds it already (wherever the store is shared: the Redis store locks across
      replicas); ``turn_locked(id)`` says whether one is held.
    - ``open_turn(id)`` is a turn's first touch of the store, one atomic step: ``(record, lock)``,
      the record (None: no such session) and, when it exists and no turn holds it, its turn lock
      (else None). ``append_turn_once(..., lock=lock)`` is its last: the append and the lock's
      release in one atomic step (the lock is released whether the turn is appended or was
      recorded already; ``lock.release()`` afterwards does nothing). A turn touches the store twice.
    A store that serializes records raises :class:`SessionDecodeError` from ``get`` for a
    stored record it cannot read, and :class:`SessionTooLarge` for one it cannot write.
    """

    @abc.abstractmethod
    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        ...

    @abc.abstractmethod
    async def get(self, session_id: str) -> SessionRecord | None:
        ...

    @abc.abstractmethod
    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord, lock: TurnLock | None = None) -> tuple[SessionRecord, bool]:
        ...

    @abc.abstractmethod
    async def update_turn(self, session_id: str, turn_id: str, /, **changes: Any) -> SessionRecord | None:
        ...

    @abc.abstractmethod
    async def delete(self, session_id: str) -> SessionRecord | None:
        ...

    @abc.abstractmethod
    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionRecord]:
        ...

    @abc.abstractmethod
    async def count(self, tenant: str) -> int:
        ...

    @abc.abstractmethod
    async def lock_turn(self, session_id: str) -> TurnLock | None:
        ...

    @abc.abstractmethod
    async def turn_locked(self, session_id: str) -> bool:
        ...

    @abc.abstractmethod
    async def open_turn(self, session_id: str) -> tuple[SessionRecord | None, TurnLock | None]:
        ...


class InMemorySessionStore(SessionStore):
    """Sessions in a dict of this process, guarded by one asyncio lock (all callers share a loop)."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._records: dict[str, SessionRecord] = {}
        self._lock = asyncio.Lock()
        self._turns: set[str] = set()  # sessions with a turn running

    async def lock_turn(self, session_id: str) -> TurnLock | None:
        if session_id in self._turns:
            return None
        self._turns.add(session_id)
        return _LocalTurnLock(self._turns, session_id)

    async def turn_locked(self, session_id: str) -> bool:
        return session_id in self._turns

    async def open_turn(self, session_id: str) -> tuple[SessionRecord | None, TurnLock | None]:
        record = await self.get(session_id)
        return record, None if record is None else await self.lock_turn(session_id)

    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        check_tenant_limit(max_tenant_sessions)
        async with self._lock:
            if record.id in self._records:
                raise SessionExists(record.id)
            if len(self._records) >= self.max_sessions:
                raise SessionLimitReached(f"the server holds its maximum of {self.max_sessions} sessions")
            if max_tenant_sessions is not None and await self.count(record.tenant) >= max_tenant_sessions:
                raise TenantSessionLimitReached(record.tenant, max_tenant_sessions)
            self._records[record.id] = copy.deepcopy(record)
            return copy.deepcopy(record)

    async def get(self, session_id: str) -> SessionRecord | None:
        record = self._records.get(session_id)
        return copy.deepcopy(record) if record is not None else None

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord, lock: TurnLock | None = None) -> tuple[SessionRecord, bool]:
        async with self._lock:
            record = self._records.get(session_id)
            if record is None:
                raise SessionNotFound(session_id)
            if lock is not None:   # released with the append, in the same step (no await in between)
                await lock.release()
            if record.find_turn(turn_id) is not None:
                return copy.deepcopy(record), False
            record = self._records[session_id] = apply_turn(record, turn_id, new_messages, reply)
            return copy.deepcopy(record), True

    async def update_turn(self, session_id: str, turn_id: str, /, **changes: Any) -> SessionRecord | None:
        async with self._lock:
            record = self._records.get(session_id)
            if record is None:
                raise SessionNotFound(session_id)
            updated = apply_turn_update(record, turn_id, changes)
            if updated is None:
                return None
            self._records[session_id] = updated
            return copy.deepcopy(updated)

    async def delete(self, session_id: str) -> SessionRecord | None:
        async with self._lock:
            return self._records.pop(session_id, None)

    async def list(self, tenant: str | None = None, limit: int | None = None) -> list[SessionRecord]:
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        records = sorted((r for r in self._records.values() if tenant is None or r.tenant == tenant),
                         key=lambda r: r.last_active_at, reverse=True)
        return [copy.deepcopy(r) for r in records[:limit]]

    async def count(self, tenant: str) -> int:
        return sum(1 for r in self._records.values() if r.tenant == tenant)
