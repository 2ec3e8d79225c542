"""A worker's ``/internal/generate`` lines carry every field of a ``RequestOutput`` the router's
services read, the stop string that ended a reply included (Anthropic's ``stop_sequence``)."""

from __future__ import annotations

import json
import types

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
    from agentrt.core.errors import APIError
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


class _LeaseEngine:
    """A worker's engine client as the lease routes see it: records each lease call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def extend_lease(self, lease_id, ttl_s, worker=None):
        self.calls.append(("extend", lease_id, ttl_s))

    def release_lease(self, lease_id, worker=None):
        self.calls.append(("release", lease_id, None))

    def demote_lease(self, lease_id, worker=None):
        self.calls.append(("demote", lease_id, None))

    def prefetch_lease(self, lease_id, worker=None):
        self.calls.append(("prefetch", lease_id, None))


def _lease_app(engine: _LeaseEngine):
    import fastapi

    from agentrt.core.errors import install_handlers
    from router.worker_api import worker_routes

    app = fastapi.FastAPI()
    install_handlers(app)
    app.include_router(worker_routes)
    app.state.services = types.SimpleNamespace(engine=engine)   # the one part the lease routes use
    return app


def test_the_lease_routes_reach_the_workers_engine_client_and_check_the_body():
    """``POST /internal/lease/{op}`` calls the worker's engine client's lease method of that name with the
    lease id (and, to extend, the TTL); a missing or empty id, or an extend without a positive ``ttl_s``,
    is a 400; an unknown call a 404."""
    from fastapi.testclient import TestClient

    from router.worker_api import LEASE_OPS, lease_body

    engine = _LeaseEngine()
    with TestClient(_lease_app(engine)) as http:
        for op in LEASE_OPS:
            body = lease_body("req-1", 90.0 if op == "extend" else None)
            assert http.post(f"/internal/lease/{op}", json=body).json() == {"lease_id": "req-1", "op": op}
        assert http.post("/internal/lease/demote", json={"lease_id": ""}).status_code == 400
        assert http.post("/internal/lease/prefetch", json={}).status_code == 400
        assert http.post("/internal/lease/extend", json={"lease_id": "req-1"}).status_code == 400
        assert http.post("/internal/lease/extend", json={"lease_id": "req-1", "ttl_s": 0}).status_code == 400
        assert http.post("/internal/lease/pin", json={"lease_id": "req-1"}).status_code == 404
    assert engine.calls == [("extend", "req-1", 90.0), ("release", "req-1", None), ("demote", "req-1", None),
                            ("prefetch", "req-1", None)]


def test_a_routers_lease_calls_reach_the_engine_client_of_the_worker_that_holds_the_lease(monkeypatch):
    """``RemoteEngine``'s lease methods post to the worker named (a session record's last worker) or, with
    none, the worker the request ran on, and that worker's route calls its own engine client. A worker this
    replica has marked dead still gets the call at its last URL; one it never saw is left to expire (nothing
    is sent). A call that does not get through (a connection error, a 5xx) is tried again, up to
    ``LEASE_ATTEMPTS`` times; a refused one (4xx) is not."""
    import asyncio
    import types

    import httpx

    import router.remote as remote_module
    from router.remote import LEASE_ATTEMPTS, RemoteEngine

    monkeypatch.setattr(remote_module, "LEASE_RETRY_S", 0.0)
    workers = {name: _LeaseEngine() for name in ("w-1", "w-2", "w-dead", "w-flaky", "w-down")}
    live = ("w-1", "w-2", "w-flaky", "w-down")
    core = types.SimpleNamespace(config=types.SimpleNamespace(heartbeat_interval_s=1.0), refresh_interval_s=1.0,
                                 vllm=None, workers={name: types.SimpleNamespace(url=f"http://{name}") for name in live},
                                 last_urls={name: f"http://{name}" for name in workers})
    tries: dict[str, int] = {}

    async def route(request: httpx.Request) -> httpx.Response:   # each worker's own app, by host
        host = request.url.host
        tries[host] = tries.get(host, 0) + 1
        if host == "w-flaky" and tries[host] == 1:
            raise httpx.ConnectError("connection refused", request=request)
        if host == "w-flaky" and tries[host] == 2:
            return httpx.Response(503, content=b"busy")
        if host == "w-down":
            raise httpx.ReadTimeout("no answer", request=request)
        app = _lease_app(workers[host])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as http:
            answer = await http.post(request.url.path, content=request.content,
                                     headers={"content-type": "application/json"})
        return httpx.Response(answer.status_code, content=answer.content)

    async def body():
        remote = RemoteEngine(core, max_model_len=64)
        remote.http = httpx.AsyncClient(transport=httpx.MockTransport(route))
        remote._remember("req-1", "w-1")
        remote.extend_lease("req-1", 90.0)                    # where it ran
        remote.demote_lease("req-1")
        remote.release_lease("req-0", worker="w-2")           # a lease another replica made, on w-2
        remote.prefetch_lease("req-0", worker="w-2")
        remote.release_lease("req-unknown")                   # never ran here: nothing to send
        remote.release_lease("req-1", worker="w-gone")        # a worker this replica never saw: it expires there
        remote.release_lease("req-5", worker="w-dead")        # marked dead here, maybe only slow: still sent
        remote.release_lease("req-6", worker="w-flaky")       # refused connection, then a 503, then through
        remote.release_lease("req-7", worker="w-down")        # never answers: tried, then dropped
        remote._lease("pin", "req-8", "w-2")                  # refused (404): not tried again
        await asyncio.gather(*remote._background)
        await remote.http.aclose()

    asyncio.run(body())
    # fire and forget: the calls run as tasks, in no promised order
    assert sorted(workers["w-1"].calls) == [("demote", "req-1", None), ("extend", "req-1", 90.0)]
    assert sorted(workers["w-2"].calls) == [("prefetch", "req-0", None), ("release", "req-0", None)]
    assert workers["w-dead"].calls == [("release", "req-5", None)]
    assert workers["w-flaky"].calls == [("release", "req-6", None)]
    assert tries == {"w-1": 2, "w-2": 3, "w-dead": 1, "w-flaky": 3, "w-down": LEASE_ATTEMPTS}


def test_a_generate_body_refuses_unknown_fields_and_reads_the_old_lease_name():
    """A field the worker does not know is refused by name, not dropped; an older router's ``pin_ttl_s``
    is the lease it always was."""
    import pydantic

    from router.worker_api import GenerateBody

    base = {"request_id": "r1", "prompt_token_ids": [1, 2]}
    assert GenerateBody(**base, lease_ttl_s=30.0).lease_ttl_s == 30.0
    assert GenerateBody(**base, pin_ttl_s=45.0).lease_ttl_s == 45.0
    assert GenerateBody(**base).lease_ttl_s is None
    with pytest.raises(pydantic.ValidationError, match="lease_seconds"):
        GenerateBody(**base, lease_seconds=30.0)
