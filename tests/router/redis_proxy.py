"""A TCP proxy in front of a real ``redis-server`` that can hold or lose traffic on purpose.

Tests use it to put a Redis command's request or reply exactly where a race needs it: held
before Redis sees it, executed but its reply held back, or its connection cut after Redis
ran it (the reply lost). Holds apply to the connections open when they are set, so a client
that opens a new connection meanwhile (its pool, a retry) gets through.
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class _Link:
    """One client connection and its upstream connection to Redis."""

    def __init__(self) -> None:
        self.requests_open = asyncio.Event()
        self.replies_open = asyncio.Event()
        self.requests_open.set()
        self.replies_open.set()
        self.reply_chunks = 0  # chunks Redis sent on this link (whether or not they were passed on)
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task] = []


class RedisProxy:
    def __init__(self, redis_port: int) -> None:
        self.redis_port = redis_port
        self.links: list[_Link] = []
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> "RedisProxy":
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Link()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        link.writers = [writer, up_writer]
        self.links.append(link)
        link.tasks = [asyncio.create_task(self._pump(reader, up_writer, link.requests_open, link, False)),
                      asyncio.create_task(self._pump(up_reader, writer, link.replies_open, link, True))]

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: asyncio.Event,
                    link: _Link, replies: bool) -> None:
        # Data read before the other side went away is still delivered once the gate opens: a
        # request the client gave up on reaches Redis late, as it can on a real network.
        try:
            while data := await reader.read(65536):
                if replies:
                    link.reply_chunks += 1
                await gate.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def hold_requests(self) -> list[_Link]:
        """Stop passing requests on the connections open now (they wait in the proxy); returns those links."""
        for link in self.links:
            link.requests_open.clear()
        return list(self.links)

    def hold_replies(self) -> list[_Link]:
        """Let Redis run what arrives on the connections open now, but keep its replies back."""
        for link in self.links:
            link.replies_open.clear()
        return list(self.links)

    def release(self, links: list[_Link]) -> None:
        for link in links:
            link.requests_open.set()
            link.replies_open.set()

    def cut(self, links: list[_Link]) -> None:
        """Close these connections on both sides: whatever was held back is lost."""
        for link in links:
            for task in link.tasks:
                task.cancel()
            for w in link.writers:
                w.close()

    async def aclose(self) -> None:
        self.cut(self.links)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def until(predicate, what: str, timeout_s: float = 10.0) -> None:
    """Poll ``await predicate()`` until it is true; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.01)
