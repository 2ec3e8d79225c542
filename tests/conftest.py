"""Fixtures shared across the test suite: the real agentrt server in a subprocess.

``agentrt_server`` is started once per test session (loading the model takes a while on
two cores) and shared; tests that need different limits call :func:`start_server` with
their own flags. Servers run with a small KV pool and low default token limits so the
whole suite stays fast. Processes start through ``agentrt.procs`` (the launcher ``agentrt up``
and the benchmarks use); a server is an ``agentrt.procs.Proc``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrt.procs import Proc, Procs

ROOT = Path(__file__).resolve().parents[1]


def start_server(tmp_dir: Path, *flags: str, env: dict[str, str] | None = None) -> Proc:
    """``python -m agentrt.cli serve`` on a free port, its log in ``tmp_dir``; returns once /health
    answers 200. The caller stops it (``stop()`` returns the exit code)."""
    server = Procs(tmp_dir, cwd=ROOT).agentrt("agentrt-serve", "serve", "--kv-cache-tokens", "16384",
                                              "--default-max-tokens", "16", "--log-level", "warning", *flags, env=env)
    return server.wait_ready()


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
