"""A non-streaming request whose client goes away (agentrt/api/http.py, ``unless_disconnected``).

Its work is cancelled and its cleanup runs (the request aborted, its pages freed, the session unchanged). On
Python 3.11 a cancellation can be lost inside the work (redis-py's connection set-up, an ``asyncio.wait_for``
getting its result in the same turn of the loop): cancelled once, the turn then ran on to its end for nobody.
The work here loses its first cancellation on purpose.
"""

from __future__ import annotations

import asyncio

from agentrt.api.http import unless_disconnected


class Client:
    """What ``unless_disconnected`` reads of a Starlette request: ``receive()``, which says ``http.disconnect``
    once the client has gone."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def run(lose_first_cancel: bool, disconnect: bool, steps: int = 40) -> tuple[object, list[str]]:
    async def body():
        events: list[str] = []
        inside = asyncio.Event()

        async def work() -> str:          # a turn: steps of 50 ms (2 s by default: a client leaves well before)
            lost = False
            for _ in range(steps):
                try:
                    inside.set()
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    if lost or not lose_first_cancel:
                        events.append("cancelled")
                        raise
                    lost = True
                    events.append("lost a cancellation")
            events.append("ran to its end")
            return "reply"

        async def cleanup() -> None:
            events.append("cleanup")

        client = Client()
        call = asyncio.create_task(unless_disconnected(client, work(), cleanup))
        await inside.wait()
        if disconnect:
            client.gone.set()
        done, _ = await asyncio.wait({call}, timeout=10.0)
        assert done
        return call.result(), events
    return asyncio.run(body())


def test_a_client_gone_cancels_the_work_and_cleans_up():
    reply, events = run(lose_first_cancel=False, disconnect=True)
    assert reply.status_code == 499 and events == ["cancelled", "cleanup"]


def test_a_client_gone_ends_the_work_even_if_it_lost_its_first_cancellation():
    """Cancelled once and awaited (before agentrt/core/tasks.py), the work ran to its end: events were
    ["lost a cancellation", "ran to its end", "cleanup"]."""
    reply, events = run(lose_first_cancel=True, disconnect=True)
    assert reply.status_code == 499
    assert events == ["lost a cancellation", "cancelled", "cleanup"]


def test_a_client_still_there_gets_the_reply():
    reply, events = run(lose_first_cancel=True, disconnect=False, steps=4)   # nobody leaves: 0.2 s of work
    assert reply == "reply" and events == ["ran to its end"]
