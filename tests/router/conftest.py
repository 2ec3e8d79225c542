"""A real ``redis-server`` for router tests, on a free port with its own temp dir.

Fixtures:
* ``redis_server`` (session scope): one server shared by the session.
* ``redis_url`` (function scope): that server's URL, flushed before each test.
* ``redis_server_factory`` (function scope): ``factory()`` starts a fresh private
  server (for tests that kill or restart it); all are stopped at teardown.

``RedisServer`` has ``start()``, ``stop()`` (graceful), ``kill()`` (SIGKILL) and
``restart()`` (same port, same dir). Never touches the machine's shared 6379.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis
from agentrt.procs import free_port  # noqa: E402



class RedisServer:
    def __init__(self, port: int | None = None, appendonly: bool = False) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH; the router tests need a real one")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="agentrt-redis-"))
        self.proc: subprocess.Popen | None = None
        self.appendonly = appendonly  # persist (AOF) so a restart keeps the data

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.dir), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode()}")
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)
        client.close()

    def _wait(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self._wait()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self._wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server):
    redis_server.start()  # a test may have stopped it
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_server_factory():
    servers: list[RedisServer] = []

    def factory(appendonly: bool = False) -> RedisServer:
        server = RedisServer(appendonly=appendonly)
        server.start()
        servers.append(server)
        return server

    yield factory
    for server in servers:
        server.cleanup()
