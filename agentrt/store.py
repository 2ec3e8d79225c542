"""Where sessions live: the :class:`SessionStore` interface and the in-process implementation.

A session record is plain data (it must serialize: the router's Redis store keeps it as
msgpack, DESIGN.md contract 3). The store's one write that matters is
:meth:`SessionStore.append_turn_once`: it appends a turn's messages and its reply in one
step, at most once per turn id (contract 4), so a retried turn never appends twice and a
failed turn never appends half.
"""

from __future__ import annotations

import asyncio
import copy
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


@dataclass
class SessionRecord:
    """Everything needed to rebuild a session on any worker."""

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


class SessionNotFound(KeyError):
    """No session with that id (never created, deleted, or expired)."""


class SessionLimitReached(RuntimeError):
    """The store holds as many sessions as it may."""


class TenantSessionLimitReached(SessionLimitReached):
    """The session's tenant holds as many sessions as it may (``create``'s ``max_tenant_sessions``)."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant '{tenant}' holds its maximum of {limit} sessions; delete one or retry later")
        self.tenant, self.limit = tenant, limit


class TurnLock:
    """A session's turn lock, held by the one turn running on it. ``release`` is idempotent."""

    async def release(self) -> None:
        raise NotImplementedError


class _LocalTurnLock(TurnLock):
    def __init__(self, held: set[str], session_id: str) -> None:
        self._held, self._session_id = held, session_id

    async def release(self) -> None:
        self._held.discard(self._session_id)


class SessionStore:
    """Contract every store implements (in-process here; Redis with the router).

    Records returned are copies: changing one changes nothing stored.
    - ``create(record, max_tenant_sessions)`` stores a new record; raises
      :class:`SessionLimitReached` when full, and :class:`TenantSessionLimitReached` when
      ``record.tenant`` already holds ``max_tenant_sessions`` sessions (None: no limit). The
      check and the insert are one atomic step (across router replicas with the Redis store).
    - ``get(id)`` returns the record or None.
    - ``append_turn_once(id, turn_id, new_messages, reply)`` atomically: if a turn with
      ``turn_id`` is recorded, returns ``(record, False)`` and changes nothing; otherwise
      appends ``new_messages`` then ``reply.message`` to the history, records ``reply``,
      refreshes ``last_active_at`` and returns ``(record, True)``. Raises
      :class:`SessionNotFound` if the session is gone.
    - ``delete(id)`` removes it and returns the removed record (None if absent).
    - ``list()`` returns all records.
    - ``count(tenant)`` returns how many sessions ``tenant`` holds.
    - ``lock_turn(id)`` takes the session's turn lock and returns it, or None when a turn
      holds it already (wherever the store is shared: the router's Redis store locks across
      replicas); ``turn_locked(id)`` says whether one is held.
    """

    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        raise NotImplementedError

    async def get(self, session_id: str) -> SessionRecord | None:
        raise NotImplementedError

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord) -> tuple[SessionRecord, bool]:
        raise NotImplementedError

    async def delete(self, session_id: str) -> SessionRecord | None:
        raise NotImplementedError

    async def list(self) -> list[SessionRecord]:
        raise NotImplementedError

    async def lock_turn(self, session_id: str) -> TurnLock | None:
        raise NotImplementedError

    async def turn_locked(self, session_id: str) -> bool:
        raise NotImplementedError

    async def count(self, tenant: str) -> int:
        return sum(1 for r in await self.list() if r.tenant == tenant)


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

    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        async with self._lock:
            if record.id in self._records:
                raise ValueError(f"session {record.id} already exists")
            if len(self._records) >= self.max_sessions:
                raise SessionLimitReached(f"the server holds its maximum of {self.max_sessions} sessions")
            if max_tenant_sessions is not None and \
                    sum(1 for r in self._records.values() if r.tenant == record.tenant) >= max_tenant_sessions:
                raise TenantSessionLimitReached(record.tenant, max_tenant_sessions)
            self._records[record.id] = copy.deepcopy(record)
            return copy.deepcopy(record)

    async def get(self, session_id: str) -> SessionRecord | None:
        record = self._records.get(session_id)
        return copy.deepcopy(record) if record is not None else None

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord) -> tuple[SessionRecord, bool]:
        async with self._lock:
            record = self._records.get(session_id)
            if record is None:
                raise SessionNotFound(session_id)
            if record.find_turn(turn_id) is not None:
                return copy.deepcopy(record), False
            record.messages.extend(copy.deepcopy(new_messages))
            record.messages.append(copy.deepcopy(reply.message))
            record.turns.append(copy.deepcopy(reply))
            record.last_active_at = max(record.last_active_at, time.time())
            return copy.deepcopy(record), True

    async def delete(self, session_id: str) -> SessionRecord | None:
        async with self._lock:
            return self._records.pop(session_id, None)

    async def list(self) -> list[SessionRecord]:
        return [copy.deepcopy(r) for r in self._records.values()]
