"""Server-side sessions (``/v1/sessions``): create, list, read, delete and fork a session, and run its turns
(``SessionManager`` in ``agentrt/core/turns.py``). A turn streams ``turn.delta`` events
(``turn.reasoning_delta`` for reasoning, ``turn.tool_call`` for calls), then ``turn.completed``; a retried
``turn_id`` answers the recorded turn and appends nothing."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from agentrt.api.http import ERRORS, Auth, json_reply, sse_reply, sse_response
from agentrt.core.tenants import Tenant
from agentrt.core.turns import SessionManager, TurnRun
from agentrt.protocol import (ForkRequest, SessionCreateRequest, SessionDeleted, SessionList, SessionResponse,
                              TurnRequest, TurnResponse)


def routes(sessions: SessionManager, auth: Auth, retry_after_s: int) -> APIRouter:
    """The session routes over ``sessions``; ``auth``: the API-key check."""
    api = APIRouter(responses=ERRORS)

    @api.post("/v1/sessions", response_model=SessionResponse, status_code=201)
    async def create_session(body: SessionCreateRequest, tenant: Tenant = Depends(auth)) -> dict:
        return sessions.view(await sessions.create(body, tenant))

    @api.get("/v1/sessions", response_model=SessionList)
    async def list_sessions(tenant: Tenant = Depends(auth)) -> dict:
        now = time.time()
        records = [r for r in await sessions.store.list(tenant=tenant.name) if r.expires_at > now]
        return {"object": "list", "data": [sessions.view(r) for r in records]}

    @api.get("/v1/sessions/{session_id}", response_model=SessionResponse)
    async def get_session(session_id: str, tenant: Tenant = Depends(auth)) -> dict:
        return sessions.view(await sessions.get(session_id, tenant))

    @api.delete("/v1/sessions/{session_id}", response_model=SessionDeleted)
    async def delete_session(session_id: str, tenant: Tenant = Depends(auth)) -> dict:
        await sessions.delete(session_id, tenant)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @api.post("/v1/sessions/{session_id}/fork", response_model=SessionResponse, status_code=201)
    async def fork_session(session_id: str, body: ForkRequest | None = None, tenant: Tenant = Depends(auth)) -> dict:
        return sessions.view(await sessions.fork(session_id, body or ForkRequest(), tenant))

    @api.post("/v1/sessions/{session_id}/turns", response_model=TurnResponse)
    async def session_turn(session_id: str, body: TurnRequest, request: Request, response: Response,
                           tenant: Tenant = Depends(auth)) -> Any:
        """Append messages and generate the reply. Streaming sends ``turn.delta`` events
        (``turn.reasoning_delta`` for reasoning, ``turn.tool_call`` for calls), then ``turn.completed``."""
        started = await sessions.start_turn(session_id, body, tenant)
        if not isinstance(started, TurnRun):  # a retried turn id: the recorded reply, nothing appended
            sessions.gen.metrics.turns.labels("replayed").inc()
            view = sessions.turn_view(session_id, started, replayed=True)
            if body.stream:
                return sse_response(_one_event({"type": "turn.completed", "turn": view}), _nothing, 1)
            return view
        if body.stream:
            return await sse_reply(request, started.generation, _turn_events(session_id, started), started.close,
                                   retry_after_s)

        async def run() -> dict:
            return sessions.turn_view(session_id, await started.run())

        return await json_reply(request, response, started.generation, run(), started.close)

    return api


async def _turn_events(session_id: str, run: TurnRun) -> AsyncIterator[dict]:
    index = 0
    async for d in run.deltas():
        if d.reasoning:
            yield {"type": "turn.reasoning_delta", "reasoning": d.reasoning}
        if d.content:
            yield {"type": "turn.delta", "content": d.content}
        for call in d.tool_calls:
            yield {"type": "turn.tool_call", "index": index, "id": call.id, "name": call.name,
                   "arguments": call.arguments}
            index += 1
    yield {"type": "turn.completed", "turn": SessionManager.turn_view(session_id, run.turn)}


async def _one_event(event: dict) -> AsyncIterator[dict]:
    yield event


async def _nothing() -> None:
    return None
