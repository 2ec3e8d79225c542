"""``make demo``: start ``agentrt serve``, run examples/agent_loop.py against it, stop the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"agentrt serve exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"agentrt serve was not healthy after {STARTUP_TIMEOUT_S:.0f} s")


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)  # graceful: finishes in-flight streams, drains the engine
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting agentrt serve on {url} (loading the model takes a few seconds)", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port),
                               "--log-level", "warning"], cwd=ROOT, env=os.environ.copy())
    try:
        _wait_healthy(url, server)
        print("server ready; running examples/agent_loop.py\n", flush=True)
        agent = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_loop.py"), "--url", url,
                                "--folder", str(ROOT / "examples" / "agent_files")], cwd=ROOT)
        return agent.returncode
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop(server)
        print("server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
