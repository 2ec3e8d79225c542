"""``make demo``: start ``agentrt serve``, run examples/agent_loop.py against it, stop the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from agentrt.procs import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)  # graceful: finishes in-flight streams, drains the engine
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"starting agentrt serve on {url} (loading the model takes a few seconds)", flush=True)
    server = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port),
                               "--log-level", "warning"], cwd=ROOT, env=os.environ.copy())
    try:
        wait_healthy(url, server)
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
