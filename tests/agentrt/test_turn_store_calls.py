"""A session turn touches the session store twice: ``open_turn`` (the record and the turn lock, one atomic
step) and ``append_turn_once(lock=...)`` (the turn recorded and the lock released, one atomic step). With
the router's Redis store each is one round trip, where a turn used to make five (get, lock, get, append,
unlock). The app is the real one (``assemble_app``) over a recording engine client (tests/agentrt/
test_session_priority_api.py) and an in-memory store that logs its calls; the Redis store's side of the
contract is tested in tests/router/test_session_store.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_session_priority_api import _Engine

from agentrt.config import ServerConfig
from agentrt.server import assemble_app
from agentrt.core.store import InMemorySessionStore


class LoggingStore(InMemorySessionStore):
    """The in-memory store, each call of its API from outside logged by name (not the calls one of its
    methods makes of another: ``open_turn`` is ``get`` and ``lock_turn`` with no await between them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.depth = 0

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if not name.startswith("_") and asyncio.iscoroutinefunction(attr):
            async def logged(*args, **kwargs):
                if self.depth == 0:
                    self.calls.append(name)
                self.depth += 1
                try:
                    return await attr(*args, **kwargs)
                finally:
                    self.depth -= 1
            return logged
        return attr


@pytest.fixture(scope="module")
def model():
    from router.model_info import load_router_model
    return load_router_model(None)


TURN = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_turn_touches_the_store_twice_and_leaves_the_session_unlocked(model):
    store = LoggingStore()
    app = assemble_app(ServerConfig(), _Engine(), model, store=store)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            sid = (await http.post("/v1/sessions", json={"model": model.model_id})).json()["id"]
            seen = {}
            for name, body in (("first", {**TURN, "turn_id": "t1"}), ("second", TURN),
                               ("replay", {**TURN, "turn_id": "t1"})):
                store.calls.clear()
                resp = await http.post(f"/v1/sessions/{sid}/turns", json=body)
                seen[name] = (resp.status_code, list(store.calls), store._turns.copy())
            held = await InMemorySessionStore.lock_turn(store, sid)   # another turn is running
            store.calls.clear()
            busy = await http.post(f"/v1/sessions/{sid}/turns", json=TURN)
            seen["busy"] = (busy.status_code, list(store.calls), store._turns.copy())
            await held.release()
            store.calls.clear()
            missing = await http.post("/v1/sessions/sess_nope/turns", json=TURN)
            seen["missing"] = (missing.status_code, list(store.calls), store._turns.copy())
            record = await InMemorySessionStore.get(store, sid)
            return seen, record

    seen, record = asyncio.run(run())
    for name in ("first", "second"):
        assert seen[name] == (200, ["open_turn", "append_turn_once"], set()), (name, seen[name])
    # a replay answers the recorded turn from the record open_turn read, and frees the lock it took
    assert seen["replay"] == (200, ["open_turn"], set())
    assert seen["busy"][:2] == (409, ["open_turn"])
    assert seen["missing"] == (404, ["open_turn"], set())
    assert [t.turn_id for t in record.turns][0] == "t1" and len(record.turns) == 2
