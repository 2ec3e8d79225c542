"""agentrt's ``SessionStore`` interface over ``RedisSessionStore``: sessions shared by router replicas.

An ``agentrt.store.SessionRecord`` maps onto the router's msgpack ``SessionRecord``
(contract 3): history in ``messages``, tools in ``tools``, the rest of the session's
settings in ``settings``, each turn's ``TurnRecord`` under its turn id in ``turns``, the
last turn's pin deadline in ``pinned_until_ms`` and the worker it ran on in
``last_worker``. ``append_turn_once`` is the Redis store's WATCH/MULTI transaction, so a
turn id is appended once however many replicas replay it (contract 4).

A record that cannot be decoded (corrupt, oversized, of an unknown shape) is never
guessed at: it is counted in ``bad_records`` and logged; ``get`` answers 500 naming the
session, ``list`` skips it.

A tenant's session limit is checked in the same script that creates the record
(``RedisSessionStore.create(max_per_tenant=…)``, over the tenant's set of session ids), so
it counts every replica's sessions and two replicas cannot both take the last one.

``worker_of(pin_id)`` tells which worker ran a turn (its pin id is its request id); the
router's ``RemoteEngine.worker_of`` provides it.

``lock_turn`` is the session's turn lock in Redis (``RedisSessionStore.lock_turn``), so a
second turn on a session gets 409 from any replica. The lock's TTL
(``RouterConfig.turn_lock_ttl_s``) is renewed every third of it while the turn runs; it only
bounds how long a router that died mid-turn keeps the session locked.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import asdict, fields
from typing import Any, Callable

import redis.asyncio as aioredis

from agentrt.errors import APIError
from agentrt.store import (SessionNotFound, SessionRecord, SessionStore, TenantSessionLimitReached, TurnLock,
                           TurnRecord)
from router import session_store as rs
from router.core import retry_for

_TURN_FIELDS = {f.name for f in fields(TurnRecord)}

log = logging.getLogger("router.redis_store")


class RedisTurnLock(TurnLock):
    """A held turn lock: renewed in the background until ``release``."""

    def __init__(self, store: rs.RedisSessionStore, session_id: str, token: str, ttl_ms: int) -> None:
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


_NUM = (int, float)
_TURN_TYPES = {"turn_id": str, "index": int, "message": dict, "finish_reason": str, "prompt_tokens": int,
               "completion_tokens": int, "cached_tokens": int, "created_at": _NUM, "pin_id": (str, type(None)),
               "pin_expires_at": _NUM, "raw_text": (str, type(None))}
_SETTING_TYPES = {"system": (str, type(None)), "tools_given": bool, "sampling": dict, "metadata": dict,
                  "idle_ttl_s": _NUM, "pin_ttl_s": (*_NUM, type(None)), "parent_id": (str, type(None))}


def _check_types(rec: rs.SessionRecord) -> None:
    """Every field agentrt reads has the type it expects (a corrupt record fails here, not mid-turn)."""
    def check(what: str, value: object, typ: type | tuple) -> None:
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            raise TypeError(f"{what} has type {type(value).__name__}")
    for name, typ in _SETTING_TYPES.items():
        check(f"settings.{name}", rec.settings.get(name), typ)
    for i, m in enumerate(rec.messages):
        check(f"messages[{i}]", m, dict)
    for i, t in enumerate(rec.tools):
        check(f"tools[{i}]", t, dict)
    for turn_id, t in rec.turns.items():
        check(f"turns[{turn_id!r}]", t, dict)
        for name, typ in _TURN_TYPES.items():
            check(f"turns[{turn_id!r}].{name}", t.get(name), typ)


def from_redis(rec: rs.SessionRecord) -> SessionRecord:
    s = rec.settings
    try:
        _check_types(rec)
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
        self.lock_ttl_ms = max(1, int(store.config.turn_lock_ttl_s * 1000))
        self.worker_of = worker_of
        self.list_limit = list_limit
        self.bad_records = 0
        self._withdrawals: set[asyncio.Task] = set()  # turn locks being withdrawn (kept until done)

    async def create(self, record: SessionRecord, max_tenant_sessions: int | None = None) -> SessionRecord:
        try:
            return from_redis(await self.store.create(to_redis(record), max_per_tenant=max_tenant_sessions))
        except rs.SessionExists:
            raise ValueError(f"session {record.id} already exists") from None
        except rs.TooManySessions as exc:
            raise TenantSessionLimitReached(record.tenant, exc.limit) from None

    async def count(self, tenant: str) -> int:
        return await self.store.count(tenant)

    async def get(self, session_id: str) -> SessionRecord | None:
        try:
            return from_redis(await self.store.get(session_id))
        except rs.SessionNotFound:
            return None
        except rs.SessionDecodeError as exc:
            raise self._bad(session_id, exc) from None

    def _bad(self, session_id: str, exc: Exception) -> APIError:
        self.bad_records += 1
        log.error("undecodable session record %s: %s", session_id, exc)
        return APIError(500, f"the record of session '{session_id}' is corrupt and cannot be used",
                        type="server_error", code="session_record_corrupt")

    async def append_turn_once(self, session_id: str, turn_id: str, new_messages: list[dict[str, Any]],
                               reply: TurnRecord) -> tuple[SessionRecord, bool]:
        try:
            rec, was_new = await self.store.append_turn_once(
                session_id, turn_id, list(new_messages), dict(reply.message),
                last_worker=self.worker_of(reply.pin_id) if reply.pin_id else None, turn_record=asdict(reply))
        except rs.SessionNotFound:
            raise SessionNotFound(session_id) from None
        return from_redis(rec), was_new

    async def lock_turn(self, session_id: str) -> TurnLock | None:
        token = secrets.token_hex(16)
        # As with tenant admission: the command runs in a task of its own, and a caller that never
        # reads its answer (cancelled, or the reply lost) withdraws it, whatever Redis did with it.
        call = asyncio.ensure_future(self.store.lock_turn(session_id, token, self.lock_ttl_ms))
        try:
            locked = await asyncio.shield(call)
        except BaseException:
            call.add_done_callback(lambda t: t.cancelled() or t.exception())  # outcome not needed any more
            task = asyncio.get_running_loop().create_task(self._withdraw_lock(session_id, token))
            self._withdrawals.add(task)
            task.add_done_callback(self._withdrawals.discard)
            raise
        if not locked:
            return None
        return RedisTurnLock(self.store, session_id, token, self.lock_ttl_ms)

    async def _withdraw_lock(self, session_id: str, token: str) -> None:
        async def failed(_: BaseException) -> None:
            pass

        try:  # retried for up to the lock's TTL: a transient error must not leave the session locked
            await retry_for(self.lock_ttl_ms / 1000).call_with_retry(
                lambda: self.store.withdraw_turn_lock(session_id, token, self.lock_ttl_ms), failed)
        except (aioredis.RedisError, OSError) as exc:
            log.warning("cannot withdraw an unanswered turn lock of session %s (%s); if it was taken, it "
                        "expires in %d ms", session_id, exc, self.lock_ttl_ms)

    async def turn_locked(self, session_id: str) -> bool:
        return await self.store.turn_locked(session_id)

    async def delete(self, session_id: str) -> SessionRecord | None:
        record = await self.get(session_id)
        if record is None or not await self.store.delete(session_id, tenant=record.tenant):
            return None
        return record

    async def list(self) -> list[SessionRecord]:
        out = []
        for sid in await self.store.list(limit=self.list_limit):
            try:
                record = await self.get(sid)
            except APIError:  # counted and logged by get
                continue
            if record is not None:
                out.append(record)
        return out
