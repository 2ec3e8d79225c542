"""Sessions: server-side conversations whose KV prefix stays warm between turns.

A turn renders the session's whole history plus the new messages, so the engine's radix
cache serves everything the previous turn already computed. Each turn acquires a KV lease
(``agentrt/core/leases.py``: the engine holds the turn's sequence, prompt + reply, under the
turn's request id for the TTL the ``LeasePolicy`` gives, and the pause plan after the turn may
extend or demote it); the next turn releases it once its own request is admitted, and delete
or idle expiry release it too. Which lease to release comes from the session record (its last
turn's ``pin_id``, on the record's last worker), so behind several router replicas any of them
releases a lease another made. The engine may drop a lease early under memory pressure: a
lease is a hint, never a reason to fail.

Turns are atomic: the new messages and the reply are appended together, once, after the
reply is complete (``SessionStore.append_turn_once``). An error or a client that goes
away leaves the session as it was. One turn runs at a time per session (409 otherwise): the
lock is the store's (``SessionStore.lock_turn``), so with the router's Redis store it holds
across replicas.

``SessionManager.begin_turn`` is the turn path any API builds on: the session turns of
``/v1/sessions`` (``start_turn``) and the OpenAI Responses API (``agentrt/api/responses.py``),
whose chains of responses are sessions and which makes its own prompt (a ``TurnPlan``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from engine.tokenizer import template_handles_tools
from engine.client import SessionHint, StructuredOutput

from agentrt.config import ServingSettings
from agentrt.core.errors import APIError, bad_request, not_found
from agentrt.core.generation import Generation, Generator, Result, message_dicts, tool_call_dicts
from agentrt.protocol import ForkRequest, SessionCreateRequest, TurnRequest
from agentrt.core.store import (SessionDecodeError, SessionLimitReached, SessionNotFound, SessionRecord, SessionStore,
                           TurnLock, TurnRecord)
from agentrt.core.tenants import Tenant

log = logging.getLogger("agentrt.core.turns")


class TurnRun:
    """A turn in progress: its generation, the session lock it holds, and how to record it."""

    def __init__(self, manager: "SessionManager", record: SessionRecord, turn_id: str, plan: "TurnPlan",
                 generation: Generation, lock: TurnLock, lease_ttl_s: float, tenant: Tenant) -> None:
        self.manager = manager
        self.record = record
        self.turn_id = turn_id
        self.new_messages = plan.new_messages
        self.describe = plan.describe
        self.expected_pause_s = plan.expected_pause_s
        self.generation = generation
        self.lease_ttl_s = lease_ttl_s
        self.tenant = tenant
        self.lock = lock
        self.turn: TurnRecord | None = None

    async def deltas(self) -> AsyncIterator[Any]:
        """Generation deltas; when the reply is complete the turn is recorded (``self.turn``)."""
        try:
            async for d in self.generation.deltas():
                yield d
            self.turn = await self.manager._record_turn(self)
        finally:
            await self.close()

    async def run(self) -> TurnRecord:
        async for _ in self.deltas():
            pass
        if self.turn is None:
            raise APIError(503, "the turn ended before its reply was complete", type="server_error")
        return self.turn

    async def close(self) -> None:
        """Abort the generation if unfinished, release its lease if not recorded, release the lock
        (idempotent; the lock is released even when the caller is cancelled while the generation closes)."""
        try:
            await self.generation.close()
            if self.turn is None:  # the engine leases a request's sequence when it ends, even aborted: undo that
                self.manager.release(self.generation.request_id)
        finally:
            await self.lock.release()


@dataclass
class TurnPlan:
    """What one turn sends and records: ``messages``, the whole prompt (system, history, then
    ``new_messages``, which are appended to the history with the reply); the OpenAI-named sampling
    ``fields``; the structured-output ``options`` (their tools are rendered into the prompt); and
    ``describe``, which makes the turn record's ``response`` from the finished generation (None: none);
    ``template_kwargs``: the chat template's switches (``reasoning_effort``...)."""

    new_messages: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    fields: dict[str, Any]
    options: StructuredOutput
    describe: Callable[[Result], dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    expected_pause_s: float | None = None  # the agent's hint: its pause after this turn (agentrt/core/leases.py)


class SessionManager:
    def __init__(self, store: SessionStore, generator: Generator, config: ServingSettings) -> None:
        self.store = store
        self.gen = generator
        self.config = config
        self.leases = generator.leases   # the turns' KV leases (agentrt/core/leases.py)
        self._expiry: dict[str, float] = {}  # session id -> idle expiry, for the sessions made here

    # ------------------------------------------------------------ lifecycle

    async def create(self, req: SessionCreateRequest, tenant: Tenant) -> SessionRecord:
        model = self.gen.check_model(req.model)
        sampling = req.sampling.model_dump(exclude_none=True)
        self.gen.check_defaults(sampling, StructuredOutput(
            sampling.get("response_format"), [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            sampling.get("tool_choice"), sampling.get("parallel_tool_calls")))
        self._check_lease(lambda: self.leases.policy.check_session_ttl(req.pin_ttl_s), "pin_ttl_s")
        record = SessionRecord(
            id="sess_" + uuid.uuid4().hex, model=model, system=req.system,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            sampling=sampling, metadata=dict(req.metadata),
            idle_ttl_s=req.idle_ttl_s or self.config.session_idle_ttl_s,
            pin_ttl_s=req.pin_ttl_s, tenant=tenant.name)
        return await self._create(record, tenant)

    async def fork(self, session_id: str, req: ForkRequest, tenant: Tenant, at_turn: str | None = None
                   ) -> SessionRecord:
        """A new session with the parent's history and turn records (the engine shares the prefix);
        ``at_turn``: only up to the end of that turn (404 if the parent has no such turn). Turns are
        copied without their pins and responses (a response stays the parent's, the session its id names)."""
        parent = await self.get(session_id, tenant)
        messages, turns = parent.messages, parent.turns
        if at_turn is not None:
            end = parent.find_turn(at_turn)
            if end is None:
                raise not_found(f"session '{session_id}' has no turn '{at_turn}'", param="turn_id",
                                code="turn_not_found")
            messages, turns = messages[:end.index + 1], [t for t in turns if t.index <= end.index]
        record = SessionRecord(
            id="sess_" + uuid.uuid4().hex, model=parent.model, system=parent.system, tools=parent.tools,
            sampling=dict(parent.sampling),
            metadata=dict(parent.metadata if req.metadata is None else req.metadata),
            idle_ttl_s=req.idle_ttl_s or parent.idle_ttl_s, pin_ttl_s=parent.pin_ttl_s, parent_id=parent.id,
            messages=messages, tenant=tenant.name,
            # the parent keeps its pins: a fork's first turn must not release them
            turns=[dataclasses.replace(t, pin_id=None, pin_expires_at=0.0, response=None) for t in turns])
        return await self._create(record, tenant)

    async def _create(self, record: SessionRecord, tenant: Tenant) -> SessionRecord:
        try:  # the store checks the tenant's session limit and creates in one step (cluster-wide with Redis)
            record = await self.store.create(record, max_tenant_sessions=tenant.max_sessions)
        except SessionLimitReached as exc:
            raise APIError(429, str(exc), code="too_many_sessions",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        self.gen.metrics.sessions.inc()
        self._expiry[record.id] = record.expires_at
        return record

    async def get(self, session_id: str, tenant: Tenant) -> SessionRecord:
        """The session, if it exists and belongs to ``tenant`` (another tenant's session is 404, not 403:
        its existence is not revealed). A stored record the store cannot read is 500
        ``session_record_corrupt`` (the store has counted and logged it)."""
        try:
            record = await self.store.get(session_id)
        except SessionDecodeError:
            raise _corrupt(session_id) from None
        return _visible(session_id, record, tenant)

    async def delete(self, session_id: str, tenant: Tenant) -> None:
        await self.get(session_id, tenant)
        record = await self.store.delete(session_id)
        if record is None:
            raise not_found(f"session '{session_id}' does not exist (never created, deleted, or expired)",
                            param="session_id", code="session_not_found")
        self._forget(session_id, record)

    def _forget(self, session_id: str, record: SessionRecord | None) -> None:
        """The session is gone (``record``: as deleted here; None if it was deleted elsewhere)."""
        self.gen.metrics.sessions.dec()
        self._expiry.pop(session_id, None)
        self.leases.session_ended(session_id)
        if record is not None:
            self._release_last_lease(record)
            if record.turns:  # from its creation to the end of its last turn
                self.gen.metrics.observe_session_end(record.turns[-1].created_at - record.created_at,
                                                     [t.in_slo for t in record.turns if t.in_slo is not None])

    def _release_last_lease(self, record: SessionRecord) -> None:
        """Release the session's last turn's lease while it may hold (whichever router made it)."""
        turn = record.last_turn
        if turn is not None and turn.pin_id is not None and turn.pin_expires_at > time.time():
            self.release(turn.pin_id, record.last_worker)

    async def sweep_forever(self, interval_s: float) -> None:
        """:meth:`sweep` every ``interval_s`` seconds until cancelled (the app's lifespan runs it)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep()
            except Exception:  # a failed sweep must not end sweeping
                log.exception("session sweep failed")

    async def sweep(self) -> int:
        """Read back demoted leases that are due, forget expired ones and delete sessions idle past their
        TTL; returns sessions deleted."""
        now = time.time()
        self.leases.sweep(now)
        deleted = 0
        for sid, expires in list(self._expiry.items()):
            if expires > now or await self.store.turn_locked(sid):
                continue
            record = await self.store.get(sid)
            if record is not None and record.expires_at > now:  # used since: keep it
                self._expiry[sid] = record.expires_at
                continue
            self._forget(sid, await self.store.delete(sid))
            deleted += 1
        return deleted

    def pin_info(self, record: SessionRecord) -> dict[str, Any] | None:
        turn = record.last_turn
        if turn is None or turn.pin_id is None:
            return None
        active = self.leases.session_holds(record.id, turn.pin_id, time.time())
        return {"id": turn.pin_id, "expires_at": turn.pin_expires_at, "active": active}

    def release(self, lease_id: str, worker: str | None = None) -> None:
        """Release a turn's lease; a no-op when the engine already let it go (expiry, memory pressure).
        ``worker``: where it lives (router mode: the session record's last worker); None in-process."""
        self.leases.release(lease_id, worker)

    def _check_lease(self, check: Callable[[], None], param: str) -> None:
        """400 naming ``param`` for what the lease policy refuses (its ``check_*`` methods)."""
        try:
            check()
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from None

    # ------------------------------------------------------------ turns

    async def start_turn(self, session_id: str, req: TurnRequest, tenant: Tenant) -> TurnRun | TurnRecord:
        """A recorded turn (replay of ``turn_id``) or a running one holding the session's lock."""
        new_messages = self._check_new_messages(req)

        def plan(record: SessionRecord) -> TurnPlan:
            self._check_lease(lambda: self.leases.policy.check_pause_hint(session_id, record.pin_ttl_s,
                                                                          req.expected_pause_s), "expected_pause_s")
            fields = {**record.sampling, **req.model_dump(include={"temperature", "top_p", "max_tokens", "stop",
                                                                   "seed", "priority"}, exclude_none=True)}
            structured = _structured_options(record.sampling, req)
            options = StructuredOutput(structured["response_format"], record.tools, structured["tool_choice"],
                                       structured["parallel_tool_calls"])
            return TurnPlan(new_messages, self.history(record) + new_messages, fields, options,
                            expected_pause_s=req.expected_pause_s)

        started = await self.begin_turn(session_id, tenant, req.turn_id, plan)
        assert started is not None  # begin_turn returns None only for a turn that must follow another
        return started

    async def begin_turn(self, session_id: str, tenant: Tenant, turn_id: str | None,
                         plan: Callable[[SessionRecord], TurnPlan], *, after: str | None = None
                         ) -> TurnRun | TurnRecord | None:
        """Start a turn on the session of ``tenant``: the recorded turn if ``turn_id`` is one (a replay),
        else a running turn holding the session's lock, its request made by ``plan(record)`` from the
        record as it is once locked. 404 for a session ``tenant`` cannot see, 409 ``turn_in_progress``
        while another turn runs. ``after``: the turn must directly follow that turn; None (nothing
        started) when it cannot now, because another turn runs or has followed it. The record and the
        lock come from one store call (``SessionStore.open_turn``); the turn's record and the lock's
        release are the other (``append_turn_once`` in ``_record_turn``)."""
        try:
            record, lock = await self.store.open_turn(session_id)
        except SessionDecodeError:
            raise _corrupt(session_id) from None
        try:
            record = _visible(session_id, record, tenant)
            if turn_id is not None and (done := record.find_turn(turn_id)) is not None:
                await _release(lock)  # a replay (or recorded by a turn that held the lock a moment ago)
                return done
            if lock is None:
                if after is not None:
                    return None
                raise APIError(409, f"session '{session_id}' already has a turn in progress; wait for it to "
                               "finish", param="session_id", code="turn_in_progress")
            if after is not None and (record.last_turn is None or record.last_turn.turn_id != after):
                await _release(lock)
                return None
            run = await self._submit(record, plan(record), turn_id or "turn_" + uuid.uuid4().hex, lock, tenant)
        except BaseException:
            await _release(lock)
            raise
        # The new request now holds the prefix; the last turn's lease (whichever router made it) has done its job.
        self.leases.session_turn_began(session_id)
        self._release_last_lease(record)
        return run

    def _check_new_messages(self, req: TurnRequest) -> list[dict[str, Any]]:
        for i, m in enumerate(req.messages):
            if m.role not in ("user", "tool"):
                raise bad_request(f"messages[{i}]: a turn appends user messages or tool results, not "
                                  f"'{m.role}' messages", param=f"messages.{i}.role")
        return message_dicts(req.messages)

    async def _submit(self, record: SessionRecord, plan: TurnPlan, turn_id: str, lock: TurnLock,
                      tenant: Tenant) -> TurnRun:
        started = time.monotonic()
        lease_ttl = self.leases.policy.turn_ttl(record.pin_ttl_s)
        hint = SessionHint(record.id, record.last_worker, continuing=bool(record.turns))
        generation = await self.gen.start_chat(plan.messages, plan.fields, plan.options, lease_ttl_s=lease_ttl,
                                               started_at=started, session=hint, tenant=tenant,
                                               template_kwargs=plan.template_kwargs)
        return TurnRun(self, record, turn_id, plan, generation, lock, lease_ttl, tenant)

    def history(self, record: SessionRecord, upto: TurnRecord | None = None) -> list[dict[str, Any]]:
        """The prompt's messages so far: system, history; ``upto``: only up to the end of that turn. With
        a template that knows nothing of tools, replies are as the model wrote them (for exact cache
        reuse); a template that renders tools gets them as messages (content, calls, reasoning), the
        form it was written for (gpt-oss's refuses its own markers in content)."""
        history = list(record.messages) if upto is None else record.messages[:upto.index + 1]
        if template_handles_tools(self.gen.tokenizer.chat_template):
            return ([{"role": "system", "content": record.system}] if record.system is not None else []) + history
        for t in record.turns:
            if t.raw_text is not None and 0 <= t.index < len(history):
                history[t.index] = {"role": "assistant", "content": t.raw_text}
        system = [{"role": "system", "content": record.system}] if record.system is not None else []
        return system + history

    async def _record_turn(self, run: TurnRun) -> TurnRecord:
        result = run.generation.result
        # The engine leased the turn under its request id when it finished: over the pause that follows
        # (a tool run, or the one the agent announced) the lease is held or goes to the tiers.
        lease_ttl, demoted_after = self.leases.hold_for_pause(
            run.generation.request_id, run.record.id, tool_call=bool(result.tool_calls),
            expected_pause_s=run.expected_pause_s, ttl_s=run.lease_ttl_s, own_ttl=run.record.pin_ttl_s is not None)
        now = time.time()
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = tool_call_dicts(result.tool_calls)
        turn = TurnRecord(turn_id=run.turn_id, index=len(run.record.messages) + len(run.new_messages),
                          message=message, finish_reason=result.finish_reason, prompt_tokens=result.prompt_tokens,
                          completion_tokens=result.completion_tokens, cached_tokens=result.cached_tokens,
                          cached_tokens_by_tier=result.cached_tokens_by_tier or None, created_at=now,
                          pin_id=run.generation.request_id, pin_expires_at=now + lease_ttl,
                          raw_text=result.text, response=run.describe(result) if run.describe else None,
                          in_slo=result.in_slo)
        try:
            record, was_new = await self.store.append_turn_once(run.record.id, run.turn_id, run.new_messages, turn,
                                                                lock=run.lock)
        except SessionNotFound:
            self.release(turn.pin_id)
            raise not_found(f"session '{run.record.id}' was deleted while its turn ran",
                            param="session_id", code="session_not_found") from None
        if not was_new:  # a concurrent retry recorded this turn id first: keep its reply
            self.release(turn.pin_id)
            return record.find_turn(run.turn_id)
        self.leases.session_recorded(record.id, turn.pin_id, turn.pin_expires_at, record.last_worker, demoted_after,
                                     now)
        self._expiry[record.id] = record.expires_at
        self.gen.metrics.turns.labels("new").inc()
        return turn

    # ------------------------------------------------------------ views

    def view(self, record: SessionRecord) -> dict[str, Any]:
        return {"id": record.id, "object": "session", "model": record.model, "system": record.system,
                "tools": record.tools, "sampling": record.sampling, "metadata": record.metadata,
                "idle_ttl_s": record.idle_ttl_s, "pin_ttl_s": record.pin_ttl_s, "created_at": record.created_at,
                "last_active_at": record.last_active_at, "expires_at": record.expires_at,
                "parent_id": record.parent_id, "turns": len(record.turns), "messages": record.messages,
                "usage": record.usage(), "pin": self.pin_info(record)}

    @staticmethod
    def turn_view(session_id: str, turn: TurnRecord, replayed: bool = False) -> dict[str, Any]:
        usage = {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
                 "cached_tokens": turn.cached_tokens, "total_tokens": turn.prompt_tokens + turn.completion_tokens}
        if turn.cached_tokens_by_tier is not None:   # where the cached tokens came from (KV tiers)
            usage["cached_tokens_by_tier"] = dict(turn.cached_tokens_by_tier)
        return {"id": turn.turn_id, "object": "session.turn", "session_id": session_id, "index": turn.index,
                "message": turn.message, "finish_reason": turn.finish_reason, "usage": usage,
                "replayed": replayed, "created_at": turn.created_at}


_STRUCTURED = ("response_format", "tool_choice", "parallel_tool_calls")


def _corrupt(session_id: str) -> APIError:
    return APIError(500, f"the record of session '{session_id}' is corrupt and cannot be used",
                    type="server_error", code="session_record_corrupt")


def _visible(session_id: str, record: SessionRecord | None, tenant: Tenant) -> SessionRecord:
    """``record`` if ``tenant`` may see it: 404 for one that is absent, expired or another tenant's (its
    existence is not revealed)."""
    if record is None or record.expires_at <= time.time() or record.tenant != tenant.name:
        raise not_found(f"session '{session_id}' does not exist (never created, deleted, or expired)",
                        param="session_id", code="session_not_found")
    return record


async def _release(lock: TurnLock | None) -> None:
    if lock is not None:
        await lock.release()


def _structured_options(defaults: dict[str, Any], req: TurnRequest) -> dict[str, Any]:
    """The turn's structured-output options, falling back to the session's defaults."""
    return {name: getattr(req, name) if getattr(req, name) is not None else defaults.get(name)
            for name in _STRUCTURED}
