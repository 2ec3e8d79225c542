"""The session API through agentrt.Client against the real server: turns, history, fork, replay, 409."""

from __future__ import annotations

import json

import httpx
import pytest
from agentrt_test_helpers import MODEL, WEATHER_TOOL, wait_for

import agentrt


@pytest.fixture(scope="module")
def client(agentrt_server):
    with agentrt.Client(agentrt_server.url, timeout=120) as c:
        yield c


def new_session(client, **kw):
    return client.sessions.create(system="You are a terse assistant.", sampling={"temperature": 0, "max_tokens": 12},
                                  **kw)


def test_turns_build_history_and_reuse_the_cache(client):
    session = new_session(client, metadata={"agent": "test"})
    assert session.id.startswith("sess_") and session.info.model == MODEL and session.info.turns == 0
    first = session.send("What is the capital of France?")
    second = session.send("And of Italy?")
    assert first.finish_reason in ("stop", "length") and first.content
    assert second.usage.cached_tokens > 0 and second.index == 3
    info = session.refresh()
    assert [m["role"] for m in info.messages] == ["user", "assistant", "user", "assistant"]
    assert info.messages[1]["content"] == first.content and info.messages[3]["content"] == second.content
    assert info.turns == 2 and info.metadata == {"agent": "test"}
    assert info.usage.cached_tokens == first.usage.cached_tokens + second.usage.cached_tokens
    assert info.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    session.close()


def test_streamed_turn_records_the_same_reply(client):
    session = new_session(client)
    stream = session.send("Say hi.", stream=True)
    text = "".join(d.content for d in stream)
    assert stream.reply is not None and stream.reply.content == text
    assert session.refresh().messages[-1] == {"role": "assistant", "content": text}
    session.close()


def test_tool_call_turn_and_tool_result(client):
    session = client.sessions.create(tools=[WEATHER_TOOL], sampling={"temperature": 0, "max_tokens": 40})
    call_turn = session.send("Weather in Paris?", tool_choice="required", parallel_tool_calls=False)
    assert call_turn.finish_reason == "tool_calls"
    (call,) = call_turn.tool_calls
    assert call.name == "get_weather" and call.args()["city"] in ("Paris", "London")
    answer = session.send(agentrt.tool_result(call.id, {"sky": "sunny"}), tool_choice="none", max_tokens=12)
    assert answer.tool_calls == [] and answer.usage.cached_tokens > 0
    roles = [m["role"] for m in session.refresh().messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert session.info.messages[1]["tool_calls"][0]["id"] == call.id
    session.close()


def test_fork_shares_history_and_diverges(client):
    parent = new_session(client)
    parent.send("My name is Ada.")
    child = parent.fork(metadata={"branch": "b"})
    assert child.id != parent.id and child.info.parent_id == parent.id
    assert child.info.messages == parent.refresh().messages and child.info.metadata == {"branch": "b"}
    reply = child.send("What is my name?")
    assert reply.usage.cached_tokens > 0
    assert len(child.refresh().messages) == 4 and len(parent.refresh().messages) == 2
    parent.close()
    assert len(child.refresh().messages) == 4  # the fork outlives its parent
    child.close()


def test_turn_id_makes_turns_idempotent(client):
    session = new_session(client)
    first = session.send("Tell me a colour.", turn_id="turn-1")
    again = session.send("Tell me a colour.", turn_id="turn-1")
    assert not first.replayed and again.replayed
    assert (again.id, again.content, again.usage) == (first.id, first.content, first.usage)
    streamed = session.send("Tell me a colour.", turn_id="turn-1", stream=True)
    assert list(streamed) == [] and streamed.reply.replayed and streamed.reply.content == first.content
    assert len(session.refresh().messages) == 2 and session.info.turns == 1
    session.close()


def test_concurrent_turn_is_409_and_disconnect_leaves_session_unchanged(client, agentrt_server):
    session = new_session(client)
    session.send("Hello.")
    before = session.refresh().messages
    body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}], "stream": True,
            "max_tokens": 64}
    with httpx.Client(base_url=agentrt_server.url, timeout=60) as http:
        with http.stream("POST", f"/v1/sessions/{session.id}/turns", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # keep it: a dropped iterator closes the connection
            next(lines)  # the turn is running
            with pytest.raises(agentrt.ConflictError) as err:
                session.send("Another message.")
            assert err.value.status_code == 409 and err.value.code == "turn_in_progress"
        # the client went away mid-stream: nothing of that turn is recorded
    assert session.refresh().messages == before
    assert wait_for(lambda: _try_turn(session))
    assert len(session.refresh().messages) == len(before) + 2
    session.close()


def test_leaving_a_stream_early_aborts_the_turn(client):
    session = new_session(client)
    session.send("Hello.")
    before = session.refresh().messages
    stream = session.send("Write a long story about a dragon.", stream=True, max_tokens=200)
    for delta in stream:
        assert delta.content or delta.tool_call
        break  # closes the stream: the connection goes, the server aborts the turn
    assert stream.reply is None
    assert wait_for(lambda: _try_turn(session))
    assert len(session.refresh().messages) == len(before) + 2  # the abandoned turn left nothing
    session.close()


def _try_turn(session) -> bool:
    try:
        session.send("Still there?")
        return True
    except agentrt.ConflictError:  # the server has not yet noticed the disconnect
        return False


def test_failed_turn_appends_nothing(client):
    session = new_session(client)
    session.send("Hi.")
    before = session.refresh().messages
    with pytest.raises(agentrt.BadRequestError) as err:
        session.send("Hi again.", max_tokens=100_000)
    assert "context window" in err.value.message
    with pytest.raises(agentrt.BadRequestError):
        session.send({"role": "assistant", "content": "I am not allowed here"})
    assert session.refresh().messages == before and session.info.turns == 1
    session.close()


def test_unknown_and_deleted_sessions_are_404(client, agentrt_server):
    session = new_session(client)
    session.close()
    for call in (session.refresh, lambda: session.send("hi"), session.fork, session.close):
        with pytest.raises(agentrt.NotFoundError) as err:
            call()
        assert err.value.code == "session_not_found"
    response = httpx.get(agentrt_server.url + "/v1/sessions/sess_nope")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(agentrt.NotFoundError):
        client.sessions.create(model="no-such-model")


def test_async_client(agentrt_server):
    import asyncio

    async def main():
        async with agentrt.AsyncClient(agentrt_server.url, timeout=120) as c:
            s = await c.sessions.create(sampling={"temperature": 0, "max_tokens": 6})
            reply = await s.send("Hi!")
            stream = await s.send("Bye!", stream=True)
            text = "".join([d.content async for d in stream])
            child = await s.fork()
            info = await child.refresh()
            await s.close()
            await child.close()
            return reply, stream.reply, text, info

    reply, streamed, text, info = asyncio.run(main())
    assert reply.content and streamed.content == text and len(info.messages) == 4


def test_session_routes_in_openapi_schema(agentrt_server):
    paths = httpx.get(agentrt_server.url + "/openapi.json").json()["paths"]
    for path in ("/v1/sessions", "/v1/sessions/{session_id}", "/v1/sessions/{session_id}/turns",
                 "/v1/sessions/{session_id}/fork", "/v1/chat/completions"):
        assert path in paths, path
    assert json.dumps(paths["/v1/sessions/{session_id}/turns"]).count("TurnRequest") >= 1
