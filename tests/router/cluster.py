"""Cluster tests' processes: real ``agentrt worker`` / ``agentrt router`` subprocesses, started
through ``agentrt.procs`` (the launcher ``agentrt up`` uses) in the test's ``Procs`` group.

Each runs on a free port with its output in a log file of the group's directory; ``stop()`` is
SIGTERM (a graceful shutdown), ``kill()`` is SIGKILL. Workers use a small KV pool and short token
limits, and a short heartbeat so expiry tests do not wait long.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

from agentrt.procs import Proc, Procs

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT = ("--heartbeat-ttl-s", "3", "--heartbeat-interval-s", "0.5")


def procs(tmp_dir: Path) -> Procs:
    """A group with its logs in ``tmp_dir``, run from the repository root."""
    return Procs(tmp_dir, cwd=ROOT)


@contextmanager
def redis_group(tmp_dir: Path, appendonly: bool = False, stop_timeout_s: float = 30.0) -> Iterator[tuple[Procs, Proc]]:
    """``procs(tmp_dir)`` and a Redis server started in it (``appendonly``: with AOF, so it can be restarted);
    the whole group stops on exit (``Procs.stop(stop_timeout_s)``)."""
    group = procs(tmp_dir)
    try:
        yield group, group.redis(appendonly=appendonly)
    finally:
        group.stop(timeout_s=stop_timeout_s)


def worker(group: Procs, redis_url: str, worker_id: str, *flags: str) -> Proc:
    """Start ``agentrt worker`` and return without waiting (``wait_ready()`` waits)."""
    return group.agentrt(worker_id, "worker", "--redis", redis_url, "--worker-id", worker_id,
                         "--kv-cache-tokens", "8192", "--default-max-tokens", "8", "--log-level", "warning",
                         *HEARTBEAT, *flags)


def router(group: Procs, redis_url: str, name: str, *flags: str) -> Proc:
    """Start ``agentrt router`` and return without waiting (``wait_ready()`` waits)."""
    return group.agentrt(name, "router", "--redis", redis_url, "--default-max-tokens", "8",
                         "--log-level", "warning", *HEARTBEAT, *flags)


def up(group: Procs, redis_url: str, *flags: str) -> Proc:
    """``agentrt up --workers 2`` on ``redis_url`` (8,192 KV tokens a worker, warnings only), once it is
    ready."""
    return group.agentrt("up", "up", "--workers", "2", "--redis", redis_url, "--kv-cache-tokens", "8192",
                         "--log-level", "warning", *flags).wait_ready()


def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.1, what: str = "condition"):
    """Poll ``predicate()`` until it returns a truthy value; return it (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def up_worker_pid(up: Proc, worker_id: str) -> int:
    """The pid of ``agentrt up``'s child (``up``) that runs the worker ``worker_id``."""
    for child in psutil.Process(up.pid).children():
        try:
            if worker_id in child.cmdline():
                return child.pid
        except psutil.Error:
            continue
    raise LookupError(f"no child of agentrt up runs {worker_id}")
