"""A worker's ``/internal/generate`` lines carry every field of a ``RequestOutput`` the router's
services read, the stop string that ended a reply included (Anthropic's ``stop_sequence``)."""

from __future__ import annotations

import json

import pytest

from engine.types import RequestOutput, TokenLogprob
from router.worker_api import output_from_wire, output_to_wire


@pytest.mark.parametrize("stop_reason", ["###", 2, None])
def test_an_output_round_trips(stop_reason):
    out = RequestOutput(request_id="r", text="hi", token_ids=[5, 6], finished=True, finish_reason="stop",
                        stop_reason=stop_reason, prompt_tokens=40, cached_tokens=32, completion_tokens=2,
                        logprobs=[TokenLogprob(6, -0.5, [(6, -0.5), (7, -1.0)])])
    assert output_from_wire(output_to_wire(out).decode(), "r") == out


@pytest.mark.parametrize("field, value", [("stop_reason", [1]), ("prompt_tokens", "40"), ("finished", 1),
                                          ("token_ids", [1.5]), ("logprobs", [[6, -0.5]]),
                                          ("cached_tokens_by_tier", {"host": "3"})])
def test_a_field_of_another_type_is_refused_by_name(field, value):
    """The typed wire (msgspec): a line whose field has another type is a ValueError naming that field."""
    good = json.loads(output_to_wire(RequestOutput(request_id="r", text="", token_ids=[])))
    with pytest.raises(ValueError, match=rf"malformed generate line from worker: .*\$\.{field}"):
        output_from_wire(json.dumps({**good, field: value}), "r")
    del good["prompt_tokens"]
    with pytest.raises(ValueError, match="prompt_tokens"):
        output_from_wire(json.dumps(good), "r")


def test_sampling_fields_are_typed():
    from agentrt.errors import APIError
    from router.worker_api import sampling_from_wire

    assert sampling_from_wire({"max_tokens": 5, "stop": ["x"]}).max_tokens == 5
    for bad, name in (({"max_tokens": "5"}, "max_tokens"), ({"stop": "x"}, "stop"), ({"temprature": 1}, "temprature")):
        with pytest.raises(APIError) as info:
            sampling_from_wire(bad)
        assert info.value.status == 400 and name in info.value.message, info.value.message


def test_worker_names_itself_on_every_response():
    """``NameWorker``: plain and streamed responses, and errors, carry ``x-agentrt-worker``; the app's
    own headers stay."""
    import asyncio

    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from router.worker import NameWorker

    async def plain(request):
        return JSONResponse({"ok": True}, headers={"x-own": "1"})

    async def streamed(request):
        async def lines():
            yield b"a\n"
            yield b"b\n"
        return StreamingResponse(lines())

    app = NameWorker(Starlette(routes=[Route("/plain", plain), Route("/stream", streamed)]), "worker-7")

    async def body():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            r = await http.get("/plain")
            assert r.headers["x-agentrt-worker"] == "worker-7" and r.headers["x-own"] == "1" and r.json() == {"ok": True}
            r = await http.get("/stream")
            assert r.headers["x-agentrt-worker"] == "worker-7" and r.text == "a\nb\n"
            r = await http.get("/missing")
            assert r.status_code == 404 and r.headers["x-agentrt-worker"] == "worker-7"
    asyncio.run(body())


def test_the_demote_and_prefetch_routes_reach_the_workers_engine_and_check_the_pin_id():
    """``/internal/pin/demote`` and ``/internal/pin/prefetch`` (what a router's ``RemoteEngine.demote`` /
    ``prefetch`` post) call the worker's engine client with the pin id; a missing or empty id is a 422."""
    import fastapi
    from fastapi.testclient import TestClient

    from router.worker_api import worker_routes

    calls = []

    class Engine:
        def demote(self, pin_id, worker=None):
            calls.append(("demote", pin_id))

        def prefetch(self, pin_id, worker=None):
            calls.append(("prefetch", pin_id))

    app = fastapi.FastAPI()
    app.include_router(worker_routes)
    app.state.engine = Engine()
    with TestClient(app) as http:
        assert http.post("/internal/pin/demote", json={"pin_id": "req-1"}).json() == {"pin_id": "req-1",
                                                                                     "pinned": False}
        assert http.post("/internal/pin/prefetch", json={"pin_id": "req-1"}).json() == {"pin_id": "req-1"}
        assert http.post("/internal/pin/demote", json={"pin_id": ""}).status_code == 422
        assert http.post("/internal/pin/prefetch", json={}).status_code == 422
    assert calls == [("demote", "req-1"), ("prefetch", "req-1")]
