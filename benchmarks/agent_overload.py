"""Agent sessions offered past the fleet's capacity: FCFS against session priority, in one run.

    python benchmarks/agent_overload.py --json OUT            # about 30 minutes on 2 CPU workers
    python benchmarks/agent_overload.py --quick --json OUT    # a smoke run of a few minutes

Each side starts ``agentrt up --workers N --scheduling-policy fcfs|session`` (the policy goes to the
workers) with two tenants of equal weight (a tenants file, ``AGENTRT_TENANTS_FILE``); the session side
also keeps ``--concurrency-reserve`` of the HTTP concurrency limit for started sessions. The first
side measures the fleet's capacity once: how many sessions a second it completes with ``2 x workers``
sessions running back to back (and one session alone, for the unloaded turn time). Then, per load factor
(``--loads``, default 1.5 and 3), new sessions arrive at random (Poisson, seeded) at factor x capacity
for ``--duration-s``; both sides get the same sessions.

A session is shaped like the repository's agent traces (benchmarks/traces/conversation_trace.jsonl):
requests whose blocks extend an earlier request's are the next turns of one conversation, which gives
the distribution of turns per session and of the pauses between turns (scaled by ``--pause-scale``,
at most ``--max-pause-s``). Each turn sends a tool result and asks for ``--max-tokens`` of reply. A 429
waits its ``Retry-After`` and retries the turn (a shed request); a session gives up at
``--give-up-factor`` x its SLO. Its SLO is ``--slo-factor`` x (turns x the unloaded turn time + its
pauses).

Reported per load and side (the JSON's ``load_<f>x`` -> ``fcfs`` | ``priority``): sessions finished within
their SLO, session completion p50 / p99 (finished sessions), requests shed, and beside them sessions
offered and finished, shed first turns against later turns, and sessions within SLO per tenant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from agentrt.bench.text import WORDS  # noqa: E402
from agentrt.procs import Procs, free_port  # noqa: E402
from agentrt.core.tenants import hash_key  # noqa: E402
from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT / "benchmarks" / "traces" / "conversation_trace.jsonl"
SIDES = {"fcfs": "fcfs", "priority": "session"}   # the JSON's name -> --scheduling-policy
TENANTS = ("tenant-a", "tenant-b")
QUICK = {"duration_s": 12.0, "calibrate_s": 10.0, "max_turns": 3, "max_tokens": 8, "tool_result_words": 24,
         "kv_cache_tokens": 4096, "drain_cap_s": 15.0}


def trace_shape(path: Path) -> tuple[list[int], list[float]]:
    """(turns per conversation, seconds between a conversation's turns) of a Mooncake-format trace. A
    block id names its block with everything before it, so a request whose ids include an earlier
    request's last id continues that request's conversation (the longest such prefix is its parent)."""
    by_last: dict[int, tuple[float, int]] = {}   # a request's last block id -> (its time s, its conversation)
    turns: list[int] = []
    gaps: list[float] = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        ids, t = r["hash_ids"], r["timestamp"] / 1000
        parent = next((by_last[h] for h in reversed(ids[:-1]) if h in by_last), None)
        if parent is None:
            conv = len(turns)
            turns.append(1)
        else:
            conv = parent[1]
            turns[conv] += 1
            gaps.append(max(0.0, t - parent[0]))
        if ids:
            by_last[ids[-1]] = (t, conv)
    if not turns or not gaps:
        raise SystemExit(f"{path}: no multi-turn conversations found (is it a Mooncake-format trace?)")
    return turns, gaps


@dataclass
class Plan:
    """One session of the workload: its tenant, turns' tool results and the pauses after each turn."""

    index: int
    tenant: str
    results: list[str]
    pauses: list[float]
    arrival_s: float = 0.0
    slo_s: float = 0.0


def make_plans(args: argparse.Namespace, turns: list[int], gaps: list[float], count: int, rate: float,
               seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans, t = [], 0.0
    for i in range(count):
        n = min(args.max_turns, rng.choice(turns))
        pauses = [min(args.max_pause_s, rng.choice(gaps) * args.pause_scale) for _ in range(n - 1)]
        results = [" ".join(rng.choice(WORDS) for _ in range(args.tool_result_words)) for _ in range(n)]
        plans.append(Plan(i, TENANTS[i % len(TENANTS)], results, pauses, arrival_s=t))
        t += rng.expovariate(rate)
    return plans


@dataclass
class Outcome:
    """What happened to the sessions of one phase."""

    completion_s: dict[int, float] = field(default_factory=dict)   # finished sessions
    within_slo: dict[int, bool] = field(default_factory=dict)
    shed_first: int = 0
    shed_later: int = 0
    errors: int = 0


async def post_retrying(http: httpx.AsyncClient, url: str, body: dict, headers: dict, give_up: float,
                        first: bool, out: Outcome) -> httpx.Response | None:
    """POST until it is not a 429 (each one counted shed, after its Retry-After); None past ``give_up``."""
    while time.monotonic() < give_up:
        try:
            r = await http.post(url, json=body, headers=headers)
        except httpx.HTTPError:
            out.errors += 1
            return None
        if r.status_code != 429:
            return r
        if first:
            out.shed_first += 1
        else:
            out.shed_later += 1
        await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), max(0.0, give_up - time.monotonic())))
    return None


async def run_session(http: httpx.AsyncClient, url: str, plan: Plan, args: argparse.Namespace, out: Outcome,
                      keys: dict[str, str]) -> None:
    start = time.monotonic()
    give_up = start + args.give_up_factor * plan.slo_s
    headers = {"authorization": f"Bearer {keys[plan.tenant]}"}
    created = await post_retrying(http, f"{url}/v1/sessions", {"sampling": {"temperature": 0, "max_tokens": args.max_tokens},
                                                               "system": "You are a build agent. Answer briefly."},
                                  headers, give_up, True, out)
    if created is None or created.status_code != 201:
        out.errors += created is not None
        return
    sid = created.json()["id"]
    try:
        for t, text in enumerate(plan.results):
            body = {"messages": [{"role": "user", "content": "Tool result:\n" + text}]}
            r = await post_retrying(http, f"{url}/v1/sessions/{sid}/turns", body, headers, give_up, t == 0, out)
            if r is None or r.status_code != 200:
                out.errors += r is not None
                return
            if t < len(plan.pauses):
                await asyncio.sleep(plan.pauses[t])
        took = time.monotonic() - start
        out.completion_s[plan.index] = took
        out.within_slo[plan.index] = took <= plan.slo_s
    finally:
        try:
            await http.delete(f"{url}/v1/sessions/{sid}", headers=headers)
        except httpx.HTTPError:
            pass


async def offer(url: str, plans: list[Plan], args: argparse.Namespace, keys: dict[str, str]) -> Outcome:
    """Start each session at its arrival time; wait for them (at most ``drain_cap_s`` past the last arrival)."""
    out = Outcome()
    limits = httpx.Limits(max_connections=len(plans) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        t0 = time.monotonic()
        tasks = []
        for plan in plans:
            await asyncio.sleep(max(0.0, t0 + plan.arrival_s - time.monotonic()))
            tasks.append(asyncio.create_task(run_session(http, url, plan, args, out, keys)))
        done, pending = await asyncio.wait(tasks, timeout=args.drain_cap_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return out


async def calibrate(url: str, args: argparse.Namespace, turns: list[int], gaps: list[float],
                    keys: dict[str, str]) -> tuple[float, float]:
    """(sessions completed per second with 2 x workers sessions back to back, seconds per turn alone)."""
    probe = make_plans(args, [args.max_turns], [0.0], 1, 1.0, args.seed + 7)[0]
    probe.slo_s = 3600.0
    alone = Outcome()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        await run_session(http, url, probe, args, alone, keys)
    if not alone.completion_s:
        raise SystemExit("calibration: a session alone did not finish; see the cluster's log")
    turn_s = alone.completion_s[0] / len(probe.results)
    done = 0
    deadline = time.monotonic() + args.calibrate_s
    rng_seed = args.seed + 11

    async def loop(i: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
            k = 0
            while time.monotonic() < deadline:
                plan = make_plans(args, turns, gaps, 1, 1.0, rng_seed + 1000 * i + k)[0]
                plan.slo_s, k = 3600.0, k + 1
                out = Outcome()
                await run_session(http, url, plan, args, out, keys)
                done += len(out.completion_s) if time.monotonic() <= deadline else 0

    started = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(2 * args.workers)))
    return max(done, 1) / (time.monotonic() - started), turn_s


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def figures(plans: list[Plan], out: Outcome) -> dict:
    times = list(out.completion_s.values())
    by_tenant = {t: sum(1 for p in plans if p.tenant == t and out.within_slo.get(p.index)) for t in TENANTS}
    return {"sessions_within_slo": sum(out.within_slo.values()),
            "session_completion_p50_s": percentile(times, 50), "session_completion_p99_s": percentile(times, 99),
            "requests_shed": out.shed_first + out.shed_later, "sessions_offered": len(plans),
            "sessions_finished": len(times), "shed_first_turns": out.shed_first, "shed_later_turns": out.shed_later,
            "errors": out.errors, "within_slo_by_tenant": by_tenant}


def start_cluster(args: argparse.Namespace, policy: str, tenants_file: Path) -> tuple[Procs, object]:
    procs = Procs(log_dir=args.log_dir, cwd=ROOT)
    # the router (and workers) read these from the environment: the tenants, and for the session side the
    # share of --max-concurrent-requests kept for started sessions (the router's own 429s spare them too)
    env = {"AGENTRT_TENANTS_FILE": str(tenants_file)}
    if policy == "session":
        env["AGENTRT_CONCURRENCY_RESERVE"] = str(args.concurrency_reserve)
    up = procs.agentrt(f"overload-{policy}", "up", "--workers", str(args.workers), "--redis",
                       f"redis://127.0.0.1:{free_port()}/0", "--kv-cache-tokens", str(args.kv_cache_tokens),
                       "--scheduling-policy", policy, "--log-level", "warning", env=env)
    try:
        up.wait_ready(600.0)
    except BaseException as exc:   # not up (or interrupted while starting): stop what did start
        procs.stop()
        if isinstance(exc, RuntimeError):
            raise SystemExit(f"agentrt up: {exc}") from None
        raise
    return procs, up


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="workers agentrt up starts")
    p.add_argument("--kv-cache-tokens", type=int, default=8192, help="KV pool per worker")
    p.add_argument("--loads", default="1.5,3", help="load factors over the measured capacity, comma-separated")
    p.add_argument("--duration-s", type=float, default=180.0, help="seconds new sessions arrive, per load")
    p.add_argument("--drain-cap-s", type=float, default=300.0,
                   help="after the last arrival, seconds to wait for sessions still running (then cancelled)")
    p.add_argument("--calibrate-s", type=float, default=90.0, help="seconds the capacity measurement runs")
    p.add_argument("--max-turns", type=int, default=6, help="most turns a session has (drawn from the trace)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each reply")
    p.add_argument("--tool-result-words", type=int, default=48, help="words of tool result each turn sends")
    p.add_argument("--pause-scale", type=float, default=0.02, help="the trace's gaps between turns times this")
    p.add_argument("--max-pause-s", type=float, default=5.0, help="longest tool pause, in seconds")
    p.add_argument("--slo-factor", type=float, default=3.0,
                   help="a session's SLO: this times (turns x unloaded turn time + its pauses)")
    p.add_argument("--give-up-factor", type=float, default=2.0, help="a session gives up at this times its SLO")
    p.add_argument("--concurrency-reserve", type=float, default=0.25,
                   help="the session side's --concurrency-reserve (router and workers): the share of concurrent "
                        "requests kept for later turns of started sessions")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace the sessions' shape "
                                                                     "is drawn from")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (both sides get the same sessions)")
    p.add_argument("--log-dir", default=None, help="where the clusters' logs go (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES),
                   help="the sides to run (default both: fcfs and priority, the session policy)")
    harness.add_common_args(p)
    args = p.parse_args(argv)
    args.sides = list(dict.fromkeys(args.sides))
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    try:
        args.load_factors = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        p.error(f"--loads must be numbers separated by commas, got {args.loads!r}")
    if not args.load_factors or min(args.load_factors) <= 0 or args.workers < 1 or args.max_turns < 1:
        p.error("--loads must be > 0, --workers and --max-turns >= 1")
    return args


def run_side(args, policy: str, tenants_file: Path, keys: dict, shape, state: dict) -> dict[str, dict]:
    """One side's phases on a fresh cluster: {load name: figures}. The first side also calibrates."""
    procs, up = start_cluster(args, policy, tenants_file)
    try:
        if "capacity" not in state:
            state["capacity"], state["turn_s"] = asyncio.run(calibrate(up.url, args, *shape, keys))
            print(f"capacity {state['capacity']:.3f} sessions/s, unloaded turn {state['turn_s']:.2f} s", flush=True)
        results = {}
        for f in args.load_factors:
            rate = f * state["capacity"]
            plans = make_plans(args, *shape, max(1, round(rate * args.duration_s)), rate, args.seed + int(f * 100))
            for plan in plans:
                plan.slo_s = args.slo_factor * (len(plan.results) * state["turn_s"] + sum(plan.pauses))
            results[f"load_{f:g}x"] = figures(plans, asyncio.run(offer(up.url, plans, args, keys)))
            print(policy, f"load_{f:g}x", json.dumps(results[f"load_{f:g}x"]), flush=True)
        return results
    finally:
        procs.stop(timeout_s=60.0)


def summarize(runs: dict[str, list[dict]], loads: list[str]) -> dict:
    """Per load and side the median over repeats of each figure (per-run values under ``runs``)."""
    body: dict = {}
    for load in loads:
        body[load] = {}
        for side in runs:
            per_run = [r[load] for r in runs[side]]
            merged = {k: (statistics.median([x[k] for x in per_run if x[k] is not None])
                          if any(x[k] is not None for x in per_run) else None)
                      for k in per_run[0] if not isinstance(per_run[0][k], dict)}
            body[load][side] = {**merged, "within_slo_by_tenant": per_run[-1]["within_slo_by_tenant"],
                                "runs": per_run}
    return body


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = harness.Run(args, __file__, argv)
    shape = trace_shape(args.trace)
    keys = {t: f"bench-key-{t}" for t in TENANTS}
    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    state: dict = {}
    with tempfile.TemporaryDirectory(prefix="agent-overload-") as tmp:
        tenants_file = Path(tmp) / "tenants.json"
        tenants_file.write_text(json.dumps({"tenants": {t: {"key_sha256": [hash_key(k)], "weight": 1}
                                                        for t, k in keys.items()}}))
        for _, side in harness.ab_order(args.sides, args.repeats, args.order):
            runs[side].append(run_side(args, SIDES[side], tenants_file, keys, shape, state))
            run.add_server(f"agentrt up ({side})", ["agentrt", "up", "--workers", str(args.workers)],
                           {"--kv-cache-tokens": args.kv_cache_tokens, "--scheduling-policy": SIDES[side],
                            "AGENTRT_CONCURRENCY_RESERVE": args.concurrency_reserve if side == "priority" else 0})
    loads = [f"load_{f:g}x" for f in args.load_factors]
    body = summarize(runs, loads)
    body["calibration"] = {"capacity_sessions_per_s": state["capacity"], "unloaded_turn_s": state["turn_s"]}
    print(json.dumps(body, indent=2))
    run.write(body, settings=harness.serve_settings(["--kv-cache-tokens", str(args.kv_cache_tokens)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
