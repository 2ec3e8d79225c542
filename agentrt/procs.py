"""The one launcher of local child processes: ``agentrt up``, the demo, ``agentrt bench``, the
benchmark scripts and the tests start ``agentrt serve|worker|router|up``, ``redis-server`` and any
other server through it.

``Procs`` is a group. ``agentrt(name, subcommand, *flags)`` starts ``python -m agentrt_cli`` on a
free port (``--host``/``--port`` passed), ``redis(...)`` a ``redis-server`` from PATH (its data in
the group's directory), ``spawn(name, cmd, url)`` anything else. Each child's output goes to
``<dir>/<name>.log`` or, with ``echo=True``, to our stdout with a ``[name]`` prefix. ``stop()``
stops the children one at a time, the last started first: a router before its workers, the
workers (which unregister) before their Redis.

``Proc`` is one child: ``wait_ready()`` until it answers (``GET /health`` 200, or ``PING`` for a
``redis://`` URL), ``log()``, ``stop()`` (SIGTERM, then SIGKILL), ``kill()`` (SIGKILL), and
``start()``, which starts it again with the same command and port and waits until it answers.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import redis

START_TIMEOUT_S = 300.0  # a model load is ~10 s alone, several times that on a busy 2-core machine
AGENTRT = (sys.executable, "-m", "agentrt_cli")


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


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one SSL context for short-lived httpx clients (``verify=tls_context()``): a client
    built without one loads the CA certificates into a context of its own, 28 ms of CPU on a 2-core EPYC
    against 1.3 ms with this one, taken from the processes a wait is for."""
    return httpx.create_ssl_context()


def _answers(url: str, http: httpx.Client) -> bool:
    if url.startswith(("redis://", "rediss://")):
        return redis_answers(url)
    try:
        return http.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


class Proc:
    """One child process of a ``Procs`` group (see the module docstring)."""

    def __init__(self, name: str, cmd: list[str], url: str | None, port: int | None, log_path: Path | None,
                 cwd: str | Path | None, env: dict[str, str], echo_lock: threading.Lock) -> None:
        self.name, self.cmd, self.url, self.port, self.log_path = name, cmd, url, port, log_path
        self._cwd, self._env, self._echo_lock = cwd, env, echo_lock
        self.process = self._launch()

    def _launch(self) -> subprocess.Popen:
        env = {**os.environ, **self._env}
        if self.log_path is None:
            proc = subprocess.Popen(self.cmd, cwd=self._cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            threading.Thread(target=self._echo, args=(proc.stdout,), daemon=True).start()
            return proc
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(self.cmd, cwd=self._cwd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _echo(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            with self._echo_lock:
                sys.stdout.write(f"[{self.name}] {raw.decode(errors='replace')}")
                sys.stdout.flush()
        stream.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Proc":
        """Wait until ``url`` answers; if the process exits first, or ``timeout_s`` passes (it is then
        killed), RuntimeError with the tail of its log."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, verify=tls_context()) as http:   # one client for the whole wait
            while True:
                if not self.alive():
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}{self._tail()}")
                if _answers(self.url, http):
                    return self
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"{self.name} ({self.url}) did not answer in {timeout_s:g} s{self._tail()}")
                time.sleep(0.1)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "Proc":
        """Start it again (same command and port, output appended to the same log) if it is not
        running, and wait until it answers."""
        if not self.alive():
            self.process = self._launch()
        return self.wait_ready(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful shutdown), SIGKILL if it has not exited after ``timeout_s``; its exit code."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def kill(self) -> int:
        """SIGKILL; its exit code."""
        if self.alive():
            self.process.kill()
        return self.process.wait()

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> "Proc":
        self.stop()
        return self.start(timeout_s)

    def log(self) -> str:
        """Its whole log ('' when its output is echoed)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _tail(self) -> str:
        tail = self.log()[-4000:]
        return f":\n{tail}" if tail else ""


class Procs:
    """A group of child processes, stopped together (see the module docstring).

    ``log_dir``: where the logs (and a Redis's data) go; by default a temporary directory that
    ``stop`` removes. ``cwd``: the children's working directory (default: ours). ``echo``: print
    the children's output with a ``[name]`` prefix instead of writing log files, a line at a
    time under ``echo_lock`` (hold it to print between them).
    """

    def __init__(self, log_dir: str | Path | None = None, prefix: str = "agentrt-procs-",
                 cwd: str | Path | None = None, echo: bool = False) -> None:
        self._own_dir = log_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix=prefix)) if log_dir is None else Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cwd, self.echo = cwd, echo
        self.procs: list[Proc] = []
        self.echo_lock = threading.Lock()

    def spawn(self, name: str, cmd: Sequence[str], url: str | None = None, port: int | None = None,
              env: dict[str, str] | None = None) -> Proc:
        """Start ``cmd`` (``env`` on top of ours) and return at once; ``url`` is where it answers."""
        proc = Proc(name, list(cmd), url, port, None if self.echo else self._log_path(name), self.cwd,
                    dict(env or {}), self.echo_lock)
        self.procs.append(proc)
        return proc

    def agentrt(self, name: str, subcommand: str, *flags: str, host: str = "127.0.0.1", port: int | None = None,
                env: dict[str, str] | None = None) -> Proc:
        """``python -m agentrt_cli SUBCOMMAND --host HOST --port PORT *flags`` (a free port by default)."""
        port = port or free_port(host)
        return self.spawn(name, [*AGENTRT, subcommand, "--host", host, "--port", str(port), *flags],
                          f"http://{host}:{port}", port, env)

    def redis(self, name: str = "redis", port: int | None = None, appendonly: bool = True,
              password: str | None = None, args: Sequence[str] = ()) -> Proc:
        """``redis-server`` from PATH on 127.0.0.1:``port`` (a free one by default) with its data (AOF
        when ``appendonly``) in ``<dir>/<name>-data``, ``args`` added; returns once it answers."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH: install Redis, or pass the URL of a running one")
        port = port or free_port()
        data = self.dir / f"{name}-data"
        data.mkdir(exist_ok=True)
        auth = f":{password}@" if password is not None else ""
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
               "--appendonly", "yes" if appendonly else "no", "--save", "", "--daemonize", "no",
               *(["--requirepass", password] if password is not None else []), *args]
        return self.spawn(name, cmd, f"redis://{auth}127.0.0.1:{port}/0", port).wait_ready(30.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every child (``Proc.stop``), the last started first; remove the directory if it is ours."""
        for proc in reversed(self.procs):
            proc.stop(timeout_s)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _log_path(self, name: str) -> Path:
        """``<dir>/<name>.log``, or ``<name>-2.log``, ... when a child of that name logged there before."""
        path, n = self.dir / f"{name}.log", 1
        while path.exists():
            n += 1
            path = self.dir / f"{name}-{n}.log"
        return path
