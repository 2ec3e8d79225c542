"""Local child processes for ``agentrt up``, the demo, ``agentrt bench`` and the benchmark scripts:
a free port, a ``redis-server`` from PATH, waiting for ``/health``, and a group of processes with
their logs in one temporary directory, stopped together.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import redis

START_TIMEOUT_S = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def start_redis(port: int, data_dir: str) -> subprocess.Popen:
    """``redis-server`` from PATH on 127.0.0.1:``port`` with AOF persistence in ``data_dir``."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("no Redis answers and redis-server is not on PATH: install Redis or pass --redis URL")
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", data_dir,
                             "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while not redis_answers(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    return proc


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


class Procs:
    """Child processes with logs in one temp dir; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, prefix: str = "agentrt-procs-", cwd: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.cwd = cwd
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "wb")
        proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        self.procs.append(proc)
        return proc

    def log_tail(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
