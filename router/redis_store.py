"""agentrt's ``SessionStore`` interface over ``RedisSessionStore``: sessions shared by router replicas.

An ``agentrt.store.SessionRecord`` maps onto the router's msgpack ``SessionRecord``
(contract 3): history in ``messages``, tools in ``tools``, the rest of the session's
settings in ``settings``, each turn's ``TurnRecord`` under its turn id in ``turns``, the
last turn's pin deadline in ``pinned_until_ms`` and the worker it ran on in
``last_worker``. ``append_turn_once`` is the Redis store's WATCH/MULTI transaction, so a
turn id is appended once however many replicas replay it (contract 4).

``worker_of(pin_id)`` tells which worker ran a turn (its pin id is its request id); the
router's ``RemoteEngine.worker_of`` provides it.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, Callable

from agentrt.store import SessionNotFound, SessionRecord, SessionStore, TurnRecord
from router import session_store as rs

_TURN_FIELDS = {f.name for f in fields(TurnRecord)}


def to_redis(record: SessionRecord) -> rs.SessionRecord:
    last = record.last_turn
    return rs.SessionRecord(
        session_id=record.id, tenant=record.tenant, model=record.model, messages=list(record.messages),
        tools=list(record.tools or []),
        settings={"system": record.system, "tools_given": record.tools is not None, "sampling": record.sampling,
                  "metadata": record.metadata, "idle_ttl_s": record.idle_ttl_s, "pin_ttl_s": record.pin_ttl_s,
                  "parent_id": record.parent_id},
        pinned_until_ms=int(last.pin_expires_at * 1000) if last else 0, last_worker=record.last_worker,
        turn=len(record.turns), turns={t.turn_id: asdict(t) for t in record.turns},
        created_ms=int(record.created_at * 1000), updated_ms=int(record.last_active_at * 1000))


def from_redis(rec: rs.SessionRecord) -> SessionRecord:
    s = rec.settings
    try:
        turns = sorted((TurnRecord(**{k: v for k, v in t.items() if k in _TURN_FIELDS}) for t in rec.turns.values()),
                       key=lambda t: t.index)
        return SessionRecord(
            id=rec.session_id, model=rec.model, system=s["system"], tools=rec.tools if s["tools_given"] else None,
            sampling=dict(s["sampling"]), metadata=dict(s["metadata"]), idle_ttl_s=float(s["idle_ttl_s"]),
            pin_ttl_s=s["pin_ttl_s"], parent_id=s["parent_id"], created_at=rec.created_ms / 1000,
            last_active_at=rec.updated_ms / 1000, messages=list(rec.messages), turns=turns,
            last_worker=rec.last_worker, tenant=rec.tenant or "default")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise rs.SessionDecodeError(f"session {rec.session_id} is not an agentrt session: {exc}") from None


class RedisAgentrtStore(SessionStore):
    def __init__(self, store: rs.RedisSessionStore, worker_of: Callable[[str], str | None],
                 list_limit: int = 1000) -> None:
        self.store = store
        self.worker_of = worker_of
        self.list_limit = list_limit

    async def create(self, record: SessionRecord) -> SessionRecord:
        try:
            return from_redis(await self.store.create(to_redis(record)))
        except rs.SessionExists:
            raise ValueError(f"session {record.id} already exists") from None

    async def get(self, session_id: str) -> SessionRecord | None:
        try:
            return from_redis(await self.store.get(session_id))
        except rs.SessionNotFound:
            return None

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord) -> tuple[SessionRecord, bool]:
        try:
            rec, was_new = await self.store.append_turn_once(
                session_id, turn_id, list(new_messages), dict(reply.message),
                last_worker=self.worker_of(reply.pin_id) if reply.pin_id else None, turn_record=asdict(reply))
        except rs.SessionNotFound:
            raise SessionNotFound(session_id) from None
        return from_redis(rec), was_new

    async def delete(self, session_id: str) -> SessionRecord | None:
        record = await self.get(session_id)
        if record is None or not await self.store.delete(session_id):
            return None
        return record

    async def list(self) -> list[SessionRecord]:
        out = []
        for sid in await self.store.list(limit=self.list_limit):
            record = await self.get(sid)
            if record is not None:
                out.append(record)
        return out
