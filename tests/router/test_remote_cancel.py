"""A client that goes away just as its worker's response arrives (router/remote.py, ``RemoteEngine._response``).

The router waits for a worker's response headers with a deadline. With ``asyncio.wait_for`` (Python 3.11), a
cancellation that lands in the same turn of the event loop as the response is lost: ``wait_for`` returns the
response, and the request streams on for a client that has gone (its turn then recorded). The fake client here
answers exactly so; the request must end cancelled, its response closed.
"""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest

from router.config import RouterConfig
from router.core import RouterCore
from router.remote import RemoteEngine, WorkerUnavailable

ROUTE = types.SimpleNamespace(worker=types.SimpleNamespace(url="http://w0.invalid", worker_id="w0"))


class Body(httpx.AsyncByteStream):
    """A response body whose first read waits on the network, then ends."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self):
        await asyncio.sleep(0.01)
        for chunk in ():
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class Client:
    """The httpx calls RemoteEngine makes. ``send`` answers as ``victim`` is cancelled, in one turn of the loop
    (``answer_as_cancelled``), or never (a hung worker)."""

    def __init__(self, answer_as_cancelled: bool = True) -> None:
        self.answer_as_cancelled, self.victim, self.bodies = answer_as_cancelled, None, []

    def build_request(self, method, url, **kw) -> httpx.Request:
        return httpx.Request(method, url, **kw)

    async def send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        if not self.answer_as_cancelled:
            await asyncio.sleep(3600)
        asyncio.get_running_loop().call_soon(self.victim.cancel)
        self.bodies.append(Body())
        return httpx.Response(200, stream=self.bodies[-1], request=request)

    async def aclose(self) -> None:
        pass


async def _remote(client: Client, **kw) -> RemoteEngine:
    """A RemoteEngine over a RouterCore that is never started (``_send`` asks it nothing: no Redis is reached)."""
    core = RouterCore(RouterConfig(redis_url="redis://127.0.0.1:1", deployment="cancel"), "m")
    remote = RemoteEngine(core, 2048, **kw)
    await remote.http.aclose()
    remote.http = client
    return remote


def test_a_cancellation_landing_as_the_response_arrives_ends_the_request():
    async def body():
        client = Client()
        remote = await _remote(client)

        async def relay():
            return [out async for out in remote._send(ROUTE, {"request_id": "r1"})]
        task = client.victim = asyncio.create_task(relay())
        done, _ = await asyncio.wait({task}, timeout=5.0)
        assert done, "the request was still running 5 s after its cancellation"
        # with asyncio.wait_for the cancellation was lost: the stream ran on and ended in a RemoteProtocolError
        assert task.cancelled(), f"the request ran on after its cancellation and ended with {task.exception()!r}"
        assert len(client.bodies) == 1 and client.bodies[0].closed
    asyncio.run(body())


def test_a_worker_that_sends_no_response_is_unavailable_after_the_header_timeout():
    async def body():
        remote = await _remote(Client(answer_as_cancelled=False), header_timeout_s=0.2)
        with pytest.raises(WorkerUnavailable, match=r"worker w0 sent no response in 0.2 s \(hung\)"):
            async for _ in remote._send(ROUTE, {"request_id": "r2"}):
                pass
    asyncio.run(body())
