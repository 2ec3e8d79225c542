"""Fixtures shared across the test suite: the real agentrt server in a subprocess.

``agentrt_server`` is started once per test session (loading the model takes a while on
two cores) and shared; tests that need different limits call :func:`start_server` with
their own flags. Servers run with a small KV pool and low default token limits so the
whole suite stays fast.
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
import pytest
from agentrt.procs import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0  # model load is ~10 s alone, several times that on a busy 2-core machine



@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (graceful shutdown), then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(tmp_dir: Path, *flags: str, env: dict[str, str] | None = None) -> RunningServer:
    """``python -m agentrt.cli serve`` on a free port; returns once /health answers 200."""
    port = free_port()
    log_path = tmp_dir / f"agentrt-serve-{port}.log"
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), "--kv-cache-tokens", "16384",
           "--default-max-tokens", "16", "--log-level", "warning", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    server = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agentrt serve exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"agentrt serve did not become healthy in {STARTUP_TIMEOUT_S} s:\n{server.log()[-4000:]}")


@pytest.fixture(scope="session")
def agentrt_server(tmp_path_factory: pytest.TempPathFactory):
    """One real server for most API tests (default limits, no API keys)."""
    server = start_server(tmp_path_factory.mktemp("agentrt"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def start_agentrt_server():
    """``start_agentrt_server(tmp_dir, *flags)`` starts another server; the caller stops it."""
    return start_server
