"""A real ``redis-server`` for router tests, on a free port with its own temp dir.

Fixtures:
* ``redis_server`` (session scope): one server shared by the session.
* ``redis_url`` (function scope): that server's URL, flushed before each test.
* ``redis_server_factory`` (function scope): ``factory(appendonly=False)`` starts a fresh
  private server (for tests that kill or restart it); all are stopped at teardown.

A server is an ``agentrt.procs.Proc`` (``Procs.redis``): ``url``, ``port``, ``stop()``
(graceful), ``kill()`` (SIGKILL), ``start()`` (again, same port and data, back once it answers)
and ``restart()``. Never touches the machine's shared 6379.
"""

from __future__ import annotations

import pytest
import redis

from agentrt.procs import Proc, Procs


@pytest.fixture(scope="session")
def redis_server():
    procs = Procs(prefix="agentrt-redis-")
    yield procs.redis(appendonly=False)
    procs.stop()


@pytest.fixture
def redis_url(redis_server):
    redis_server.start()  # a test may have stopped it
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_server_factory():
    procs = Procs(prefix="agentrt-redis-")

    def factory(appendonly: bool = False) -> Proc:
        return procs.redis(f"redis-{len(procs.procs)}", appendonly=appendonly)

    yield factory
    procs.stop()
