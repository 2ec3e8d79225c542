"""Process launchers for cluster tests: real ``agentrt worker`` / ``agentrt router`` subprocesses.

Each process runs on a free port with its output in a log file; ``stop()`` is SIGTERM (a
graceful shutdown), ``kill()`` is SIGKILL. Workers use a small KV pool and short token
limits, and a short heartbeat so expiry tests do not wait long.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from agentrt.procs import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0
HEARTBEAT = ("--heartbeat-ttl-s", "3", "--heartbeat-interval-s", "0.5")



@dataclass
class Proc:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()


def launch(tmp_dir: Path, name: str, *args: str) -> Proc:
    """Start ``python -m agentrt.cli <args> --port P`` and return without waiting."""
    port = free_port()
    log_path = tmp_dir / f"{name}-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", *args, "--port", str(port)], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    return Proc(name, f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(*procs: Proc, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        p = pending[0]
        if not p.alive():
            raise RuntimeError(f"{p.name} exited with {p.process.returncode}:\n{p.log()[-4000:]}")
        try:
            if httpx.get(p.url + "/health", timeout=2.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{p.name} did not become healthy:\n{p.log()[-4000:]}")
        time.sleep(0.3)


def worker(tmp_dir: Path, redis_url: str, worker_id: str, *flags: str) -> Proc:
    return launch(tmp_dir, worker_id, "worker", "--redis", redis_url, "--worker-id", worker_id,
                  "--kv-cache-tokens", "8192", "--default-max-tokens", "8", "--log-level", "warning",
                  *HEARTBEAT, *flags)


def router(tmp_dir: Path, redis_url: str, name: str, *flags: str) -> Proc:
    return launch(tmp_dir, name, "router", "--redis", redis_url, "--default-max-tokens", "8",
                  "--log-level", "warning", *HEARTBEAT, *flags)


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
