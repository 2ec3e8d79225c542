"""The path of one session turn, counted: which of our files run while ``POST /v1/sessions/{id}/turns`` is
served, and how many times it calls the session store.

The app is the real one (``agentrt.server.create_app`` over the default model, in this process), driven
through httpx's ASGI transport. A session is created and given one turn first (so the measured turn is a
later one, with history); then ``sys.setprofile`` records every function entered on the serving thread
(the event loop: the route, the surfaces, the core, the store, the engine client) during the next turn.
The engine's own thread (scheduling, the model's forward) is not traced: the count is "from the route
to the engine and back". Store calls are counted at the store's public methods, outermost calls only.

    python scripts/turn_path.py [--json OUT] [--verbose]

``--verbose`` lists, under each file, the functions entered in it and how many times.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from agentrt.config import ServerConfig  # noqa: E402
from agentrt.server import create_app  # noqa: E402

PACKAGES = ("agentrt/", "engine/", "router/")


class _StoreCalls:
    """Counts the outermost calls of the store's public async methods (not those one makes of another)."""

    def __init__(self, store) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.depth, self.recording = 0, False
        for name in dir(type(store)):
            method = getattr(store, name)
            if not name.startswith("_") and asyncio.iscoroutinefunction(method):
                setattr(store, name, self._wrap(name, method))

    def _wrap(self, name, method):
        async def counted(*args, **kwargs):
            if self.recording and self.depth == 0:
                self.counts[name] += 1
            self.depth += 1
            try:
                return await method(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted


async def _measure(app) -> dict:
    files: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(ROOT) + "/"):
                rel = path[len(str(ROOT)) + 1:]
                if rel.startswith(PACKAGES):
                    files[rel] += 1
                    functions[(rel, frame.f_code.co_qualname)] += 1

    async with app.router.lifespan_context(app):
        store = _StoreCalls(app.state.services.sessions.store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=300) as http:
            created = await http.post("/v1/sessions", json={"model": app.state.services.generator.model_name,
                                                           "system": "You are terse."})
            sid = created.json()["id"]
            first = await http.post(f"/v1/sessions/{sid}/turns",
                                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            if first.status_code != 200:
                raise SystemExit(f"the first turn failed: {first.status_code} {first.text}")
            store.recording = True
            sys.setprofile(profile)
            try:
                turn = await http.post(f"/v1/sessions/{sid}/turns",
                                       json={"messages": [{"role": "user", "content": "and again"}], "max_tokens": 4})
            finally:
                sys.setprofile(None)
                store.recording = False
            if turn.status_code != 200:
                raise SystemExit(f"the measured turn failed: {turn.status_code} {turn.text}")
    by_package = collections.Counter(f.split("/")[0] for f in files)
    by_function: dict[str, dict[str, int]] = {}
    for (path, name), calls in sorted(functions.items()):
        by_function.setdefault(path, {})[name] = calls
    return {"files": len(files), "by_package": dict(by_package), "calls_by_file": dict(sorted(files.items())),
            "calls_by_function": by_function,
            "store_calls": sum(store.counts.values()), "store_calls_by_method": dict(store.counts)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the counts here as JSON")
    ap.add_argument("--verbose", action="store_true", help="list the functions entered in each file")
    args = ap.parse_args(argv)
    app = create_app(ServerConfig(kv_cache_tokens=4096, default_max_tokens=4, log_level="warning"))
    result = asyncio.run(_measure(app))
    for path, calls in result["calls_by_file"].items():
        print(f"{calls:6d}  {path}")
        if args.verbose:
            for name, n in result["calls_by_function"][path].items():
                print(f"{n:14d}  {name}")
    print(f"{result['files']} files ({result['by_package']}), {result['store_calls']} store calls "
          f"({result['store_calls_by_method']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
