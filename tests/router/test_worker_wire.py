"""A worker's ``/internal/generate`` lines carry every field of a ``RequestOutput`` the router's
services read, the stop string that ended a reply included (Anthropic's ``stop_sequence``)."""

from __future__ import annotations

import pytest

from engine.types import RequestOutput, TokenLogprob
from router.worker_api import output_from_wire, output_to_wire


@pytest.mark.parametrize("stop_reason", ["###", 2, None])
def test_an_output_round_trips(stop_reason):
    out = RequestOutput(request_id="r", text="hi", token_ids=[5, 6], finished=True, finish_reason="stop",
                        stop_reason=stop_reason, prompt_tokens=40, cached_tokens=32, completion_tokens=2,
                        logprobs=[TokenLogprob(6, -0.5, [(6, -0.5), (7, -1.0)])])
    assert output_from_wire(output_to_wire(out).decode(), "r") == out


def test_a_malformed_stop_reason_is_refused():
    line = output_to_wire(RequestOutput(request_id="r", text="", token_ids=[])).decode()
    with pytest.raises(ValueError, match="stop_reason"):
        output_from_wire(line.replace('"stop_reason": null', '"stop_reason": [1]'), "r")


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
