"""Soak: N agent sessions against a local cluster for M minutes; errors by kind, p99 TTFT over
time, and each process's RSS over time.

    python benchmarks/soak.py --sessions 200 --minutes 5 --json out/soak.json

Without ``--url`` it starts ``agentrt up`` (its own Redis, ``--workers`` workers, a router)
and stops it at the end; with ``--url`` it drives that server and samples no RSS unless
``--pids`` names the processes. Each session runs turns back to back (a short user message,
``--max-tokens`` of reply, streamed), starting a new session every ``--turns-per-session``
turns so histories stay bounded; a 429 waits its ``Retry-After`` and counts as ``429``.

Reported: requests and errors by kind (HTTP status, or the exception's name), p50/p99 TTFT
per ``--window-s`` window, RSS per process per window, and RSS growth from the end of the
warm-up (the first ``--warmup-frac`` of the run) to the end (target: under 10%). A CPU worker's KV pool
takes memory as its pages are first written (engine/kv_pool.py ``zeros_on_first_write``), so growth up to
the pool's bytes (8,192 tokens x 46,080 bytes, 377 MB, for the default model in float32) is the pool filling
when it was not yet full at the end of the warm-up; a leak goes on past that bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psutil
from httpx_sse import EventSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from agentrt.procs import Proc, Procs, free_port  # noqa: E402
from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def children(pid: int) -> dict[int, str]:
    """Descendants of ``pid`` that run agentrt (pid -> role: worker id, router, redis)."""
    out = {}
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for child in descendants:
        try:
            args = child.cmdline()
        except psutil.Error:
            continue
        if "--worker-id" in args:
            out[child.pid] = args[args.index("--worker-id") + 1]
        elif "router" in args:
            out[child.pid] = "router"
        elif args and args[0].endswith("redis-server"):
            out[child.pid] = "redis"
    return out


class Stats:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.started = time.monotonic()
        self.kinds: Counter = Counter()
        self.ttft: dict[int, list[float]] = defaultdict(list)
        self.rss: dict[int, dict[str, float]] = defaultdict(dict)
        self.error_events: list[dict] = []   # every error but 429: when, what, how long it took

    def error(self, kind: str, sent: float, detail: str = "") -> None:
        self.kinds[kind] += 1
        if not kind.endswith("429"):
            now = time.monotonic()
            self.error_events.append({"t_s": round(now - self.started, 1), "kind": kind,
                                      "after_s": round(now - sent, 1), "detail": detail[:300]})

    def window(self) -> int:
        return int((time.monotonic() - self.started) // self.window_s)


async def one_turn(http: httpx.AsyncClient, url: str, sid: str, text: str, stats: Stats) -> bool:
    """One streamed turn; True if it completed."""
    sent = time.monotonic()
    first = None
    headers = False
    body = {"messages": [{"role": "user", "content": text}], "stream": True}
    try:
        async with http.stream("POST", f"{url}/v1/sessions/{sid}/turns", json=body) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                stats.error(str(resp.status_code), sent, body.decode(errors="replace"))
                if resp.status_code == 429:
                    await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                return False
            headers = True
            completed = False
            async for sse in EventSource(resp).aiter_sse():
                if sse.data == "[DONE]":
                    continue
                event = json.loads(sse.data)
                if "error" in event:
                    stats.error("stream_error", sent, json.dumps(event["error"]))
                    return False
                if first is None and event.get("type") in ("turn.delta", "turn.completed"):
                    first = time.monotonic()
                if event.get("type") == "turn.completed":
                    completed = True
            if not completed:
                stats.error("incomplete_stream", sent, f"session {sid}")
                return False
    except httpx.HTTPError as exc:
        stats.error(type(exc).__name__, sent, f"session {sid}, headers {headers}, first token {first is not None}: {exc!r}")
        return False
    stats.kinds["ok"] += 1
    stats.ttft[stats.window()].append(first - sent)
    return True


async def session_loop(i: int, http: httpx.AsyncClient, url: str, args: argparse.Namespace, stats: Stats,
                       deadline: float) -> None:
    await asyncio.sleep(i * args.ramp_s / max(1, args.sessions))  # ramp up
    while time.monotonic() < deadline:
        try:
            r = await http.post(f"{url}/v1/sessions", json={
                "system": f"You are build agent {i}. Answer in a few words.",
                "sampling": {"temperature": 0, "max_tokens": args.max_tokens}})
        except httpx.HTTPError as exc:
            stats.error("create:" + type(exc).__name__, time.monotonic(), str(exc))
            await asyncio.sleep(1)
            continue
        if r.status_code != 201:
            stats.kinds[f"create:{r.status_code}"] += 1
            await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            continue
        sid = r.json()["id"]
        turns = 0
        while turns < args.turns_per_session and time.monotonic() < deadline:
            if await one_turn(http, url, sid, f"Step {turns} of job {i}: status?", stats):
                turns += 1
        try:
            await http.delete(f"{url}/v1/sessions/{sid}")
        except httpx.HTTPError:
            pass


async def sample_rss(pids: dict[int, str], stats: Stats, deadline: float) -> None:
    while time.monotonic() < deadline:
        w = stats.window()
        for pid, role in pids.items():
            mb = rss_mb(pid)
            if mb is not None:
                stats.rss[w][role] = max(stats.rss[w].get(role, 0.0), mb)
        await asyncio.sleep(2.0)


async def drive(url: str, args: argparse.Namespace, pids: dict[int, str]) -> Stats:
    stats = Stats(args.window_s)
    deadline = time.monotonic() + args.minutes * 60
    limits = httpx.Limits(max_connections=args.sessions + 16, max_keepalive_connections=args.sessions + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        tasks = [asyncio.create_task(session_loop(i, http, url, args, stats, deadline))
                 for i in range(args.sessions)]
        sampler = asyncio.create_task(sample_rss(pids, stats, deadline))
        await asyncio.gather(*tasks)
        await sampler
    return stats


def report(stats: Stats, args: argparse.Namespace) -> dict:
    windows = sorted(set(stats.ttft) | set(stats.rss))
    timeline = [{"t_s": w * args.window_s, "turns": len(stats.ttft.get(w, [])),
                 "ttft_p50_s": percentile(stats.ttft.get(w, []), 50),
                 "ttft_p99_s": percentile(stats.ttft.get(w, []), 99), "rss_mb": stats.rss.get(w, {})}
                for w in windows]
    sampled = [w for w in windows if stats.rss.get(w)]
    warm = max(0, int(len(sampled) * args.warmup_frac) - 1)
    growth = {}
    if sampled:
        start, end = stats.rss[sampled[warm]], stats.rss[sampled[-1]]
        growth = {role: round(100 * (end[role] - start[role]) / start[role], 1)
                  for role in start if role in end and start[role]}
    errors = {k: v for k, v in stats.kinds.items() if k != "ok"}
    return {"sessions": args.sessions, "minutes": args.minutes, "max_tokens": args.max_tokens,
            "completed_turns": stats.kinds["ok"], "errors": errors,
            "errors_other_than_429": sum(v for k, v in errors.items() if not k.endswith("429")),
            "ttft_p99_s_overall": percentile([t for v in stats.ttft.values() for t in v], 99),
            "rss_growth_pct_after_warmup": growth, "error_events": stats.error_events, "timeline": timeline}



def start_cluster(args: argparse.Namespace) -> tuple[Procs, Proc]:
    """``agentrt up`` with a private Redis (nothing answers on the free port it is given, so it starts
    one), its output in ``--log-dir``/soak-cluster.log."""
    procs = Procs(log_dir=args.log_dir, cwd=ROOT)
    (procs.dir / "soak-cluster.log").unlink(missing_ok=True)
    up = procs.agentrt("soak-cluster", "up", "--workers", str(args.workers),
                       "--redis", f"redis://127.0.0.1:{free_port()}/0", "--kv-cache-tokens", str(args.kv_cache_tokens),
                       "--log-level", "warning")
    try:
        up.wait_ready(600.0)
    except RuntimeError as exc:
        raise SystemExit(f"agentrt up: {exc}") from None
    return procs, up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=200, help="concurrent agent sessions at full ramp")
    p.add_argument("--minutes", type=float, default=5.0, help="how long to drive the cluster")
    p.add_argument("--url", default=None, help="drive this server instead of starting agentrt up")
    p.add_argument("--pids", default="", help="with --url: pid=role,... to sample RSS of")
    p.add_argument("--workers", type=int, default=2, help="workers agentrt up starts (when started here)")
    p.add_argument("--kv-cache-tokens", type=int, default=8192, help="KV pool per worker (when started here)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each reply")
    p.add_argument("--turns-per-session", type=int, default=8, help="turns before a session ends and a new one starts")
    p.add_argument("--ramp-s", type=float, default=10.0, help="seconds over which sessions are started")
    p.add_argument("--window-s", type=float, default=30.0, help="seconds per reporting window (RSS, latency)")
    p.add_argument("--warmup-frac", type=float, default=0.2,
                   help="share of the run left out of the steady-state figures at its start")
    p.add_argument("--log-dir", default=".", help="where agentrt up's output goes (when started here): "
                                                  "DIR/soak-cluster.log")
    harness.add_common_args(p, repeats=None)
    args = p.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    if args.sessions < 1 or args.minutes <= 0:
        p.error("--sessions must be >= 1 and --minutes > 0")
    procs = None
    if args.url:
        url = args.url.rstrip("/")
        pids = {int(k): v for k, v in (item.split("=") for item in args.pids.split(",") if item)}
    else:
        procs, up = start_cluster(args)
        url, pids = up.url, children(up.pid)
        run.add_server("agentrt up", up.cmd, harness.non_default_flags(up.cmd[up.cmd.index("up") + 1:]))
    try:
        stats = asyncio.run(drive(url, args, pids))
    finally:
        if procs is not None:
            procs.stop(timeout_s=60.0)
    result = report(stats, args)
    print(json.dumps(result, indent=2))
    run.write(result, settings=harness.serve_settings(["--kv-cache-tokens", str(args.kv_cache_tokens)]))
    return 0 if result["errors_other_than_429"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
