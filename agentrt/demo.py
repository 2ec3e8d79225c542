"""``make demo``: start ``agentrt serve``, run examples/agent_loop.py against it, stop the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agentrt.procs import Procs

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    procs = Procs(prefix="agentrt-demo-", cwd=ROOT, echo=True)
    try:
        server = procs.agentrt("serve", "serve", "--log-level", "warning")
        print(f"starting agentrt serve on {server.url} (loading the model takes a few seconds)", flush=True)
        server.wait_ready()
        print("server ready; running examples/agent_loop.py\n", flush=True)
        agent = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_loop.py"), "--url", server.url,
                                "--folder", str(ROOT / "examples" / "agent_files")], cwd=ROOT)
        return agent.returncode
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.stop()  # SIGTERM: graceful, finishes in-flight streams and drains the engine
        print("server stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
