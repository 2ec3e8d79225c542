"""Routing benchmark, part (b): real workers behind our router and behind ``sglang-router``.

    python benchmarks/routing.py --live --workers 3 --json out/routing_live.json

One run starts a private Redis, N real ``agentrt worker`` processes (the default model),
``agentrt router`` and ``sglang-router`` (``--policy cache_aware``, launched as FACTS.md
says) in front of the *same* workers, and drives the same agentic workload through each
front in turn, flushing every worker's cache before each pass so both start cold. Both routers run
at their defaults (``--live-tuning defaults``, the default) or both fitted to the workload
(``tuned``: agentrt's ``tokens_per_queued_request`` = an average prompt, sglang-router's
``--balance-abs-threshold`` = sessions per worker); ``router_tuning`` in the JSON says which. Before
the first pass every worker serves one warm-up turn (the first pass on fresh processes
otherwise pays first-use costs the later ones do not); with ``--repeats N`` each front runs N
passes in ABBA order (A B B A ...) and its figures pool all its passes' turns, each pass's own
figures listed under ``runs``.

Workload: ``benchmarks/workload.py``'s sessions (a long system prompt with tool
definitions, then turns that each append a ~200-token tool result and ask for a short
reply at temperature 0), with four agent types whose system prompts differ (coding,
research, support, data; session ``s`` is type ``s % 4``). Sessions run concurrently,
turns within a session one after another. Because ``sglang-router`` only forwards the
OpenAI API, the client keeps each conversation and sends it whole to
``/v1/chat/completions`` (streaming, ``include_usage``) on both fronts.

Figures per front: hit rate (sum of ``usage.prompt_tokens_details.cached_tokens`` over
sum of prompt tokens), client-side TTFT p50/p99 (first content token), throughput
(completion tokens/s and turns/s over the pass), each worker's share of prompt tokens, and
per pass the CPU seconds the front process itself used (on a small machine the router
competes with the workers for the same cores).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from httpx_sse import EventSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402
from agentrt.procs import Procs, free_port  # noqa: E402

AGENTS = ("coding", "research", "support", "data")


@dataclass(frozen=True)
class LiveOptions:
    workers: int = 3
    sessions: int = 8
    turns: int = 4
    system_tokens: int = 1000
    tool_result_tokens: int = 150
    reply_tokens: int = 16
    kv_cache_tokens: int = 8192
    fronts: tuple[str, ...] = ("agentrt", "sglang")
    repeats: int = 1   # passes per front, in ABBA order
    policy_options: tuple[str, ...] = ()  # extra KEY=VALUE options for agentrt router's policy (tuned only)
    tuning: str = "defaults"   # "defaults": both routers as started plainly; "tuned": both fitted to the workload
    order: str = "alternate"   # pass order over the repeats (benchmarks/harness.py ab_order)


TUNINGS = ("defaults", "tuned")


def router_settings(opts: LiveOptions) -> dict:
    """The non-default settings each front gets: none with ``defaults``; with ``tuned``, each fitted to
    the workload the same way: agentrt's ``tokens_per_queued_request`` (what a queued request weighs
    against cached tokens) = one of its average prompts, sglang-router's ``--balance-abs-threshold``
    (the queue imbalance past which it balances instead of following the cache, 64 by default) = the
    sessions' fair share per worker."""
    if opts.tuning not in TUNINGS:
        raise ValueError(f"tuning must be one of {TUNINGS}, got {opts.tuning!r}")
    if opts.tuning == "defaults":
        if opts.policy_options:
            raise ValueError("policy options tune agentrt's router only: with tuning 'defaults' both routers run "
                             "their defaults (use tuning 'tuned', which fits both)")
        return {"agentrt": [], "sglang": []}
    per_request = opts.system_tokens + opts.turns * (opts.tool_result_tokens + opts.reply_tokens) // 2
    return {"agentrt": ["--policy-option", f"tokens_per_queued_request={per_request}",
                        *[a for opt in opts.policy_options for a in ("--policy-option", opt)]],
            "sglang": ["--balance-abs-threshold", str(max(1, opts.sessions // opts.workers))]}


def start_fleet(procs: Procs, opts: LiveOptions) -> dict:
    redis_url = procs.redis().url
    common = ["--log-level", "warning", "--heartbeat-interval-s", "0.5", "--heartbeat-ttl-s", "5"]
    workers = [procs.agentrt(f"worker-{i}", "worker", "--redis", redis_url, "--worker-id", f"worker-{i}",
                             "--kv-cache-tokens", str(opts.kv_cache_tokens), *common) for i in range(opts.workers)]
    for worker in workers:
        worker.wait_ready()
    fronts = {}
    tuned = router_settings(opts)
    if "agentrt" in opts.fronts:
        fronts["agentrt"] = procs.agentrt("agentrt-router", "router", "--redis", redis_url, *common,
                                          *tuned["agentrt"]).wait_ready()
    if "sglang" in opts.fronts:
        sport = free_port()
        fronts["sglang"] = procs.spawn("sglang-router", [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(sport),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *[w.url for w in workers], "--policy", "cache_aware", *tuned["sglang"]],
            url=f"http://127.0.0.1:{sport}", port=sport).wait_ready(timeout_s=120)
    return {"redis": redis_url, "workers": [w.url for w in workers], "tuned": tuned,
            "cmds": {name: list(p.cmd) for name, p in fronts.items()},
            "fronts": {name: p.url for name, p in fronts.items()}, "pids": {name: p.pid for name, p in fronts.items()}}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its reaped children; NaN if it cannot be read."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return float("nan")
    return t.user + t.system + t.children_user + t.children_system


async def _turn(http: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, content, usage = None, [], None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        worker = resp.headers.get("x-agentrt-worker")  # agentrt router's, or the worker's own passed on
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for event in EventSource(resp).aiter_sse():
            if event.data == "[DONE]":
                continue
            chunk = json.loads(event.data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    content.append(text)
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError(f"{url}: the stream carried no usage")
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - start, "reply": "".join(content),
            "start_s": start, "end_s": time.perf_counter(), "worker": worker,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


async def _session(http, url, model, wl: AgenticWorkload, tokenizer, systems, s: int, out: list,
                   t0: float = 0.0) -> None:
    messages = [{"role": "system", "content": systems[s % len(systems)]}]
    for t in range(wl.turns):
        messages += wl.turn_messages(tokenizer, s, t)
        r = await _turn(http, url, model, messages, wl.reply_tokens)
        messages.append({"role": "assistant", "content": r["reply"]})
        r["start_s"] -= t0  # seconds since the pass started
        r["end_s"] -= t0
        out.append({"session": s, "turn": t, **{k: v for k, v in r.items() if k != "reply"}})


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


async def _worker_totals(http: httpx.AsyncClient, workers: list[str]) -> list[int]:
    return [int((await http.get(w + "/get_load")).json()[0]["prompt_tokens_total"]) for w in workers]


async def _warm_up(workers: list[str], model: str, wl: AgenticWorkload, tokenizer, systems) -> None:
    """One first turn on every worker directly, so no measured pass pays the workers' first-use costs
    (allocator growth, first kernels); caches are flushed before each pass anyway."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=900.0)) as http:
        await asyncio.gather(*(_turn(http, w, model, [{"role": "system", "content": systems[i % len(systems)]},
                                                       *wl.turn_messages(tokenizer, i, 0)], wl.reply_tokens)
                               for i, w in enumerate(workers)))


async def run_pass(front: str, url: str, workers: list[str], wl: AgenticWorkload, tokenizer, systems,
                   model: str) -> dict:
    """One pass of the whole workload through ``url`` on cold caches: its turns and worker totals."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=900.0)) as http:
        for w in workers:  # start cold: every pass sees the same empty caches
            (await http.post(w + "/flush_cache")).raise_for_status()
        await asyncio.sleep(1.0)
        before = await _worker_totals(http, workers)
        turns: list[dict] = []
        start = time.perf_counter()
        await asyncio.gather(*(_session(http, url, model, wl, tokenizer, systems, s, turns, start)
                               for s in range(wl.sessions)))
        wall = time.perf_counter() - start
        after = await _worker_totals(http, workers)
    return {"turns": turns, "wall_s": wall, "share": [a - b for a, b in zip(after, before)]}


def summarize(front: str, passes: list[dict]) -> dict:
    """Figures over every turn of ``passes`` (one front's repeats pooled), plus each pass's own."""
    turns = [t for p in passes for t in p["turns"]]
    wall = sum(p["wall_s"] for p in passes)
    share = [sum(col) for col in zip(*(p["share"] for p in passes))]

    def figures(ts: list[dict], wall_s: float) -> dict:
        ttfts = [t["ttft_s"] for t in ts]
        return {"hit_rate": sum(t["cached_tokens"] for t in ts) / max(sum(t["prompt_tokens"] for t in ts), 1),
                "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
                "ttft_later_turns_p50_s": _pct([t["ttft_s"] for t in ts if t["turn"] > 0], 0.5),
                "throughput_tok_s": sum(t["completion_tokens"] for t in ts) / wall_s,
                "turns_per_s": len(ts) / wall_s}
    return {"front": front, "turns": len(turns), "wall_s": round(wall, 2), **figures(turns, wall),
            "worker_prompt_share": [round(x / max(sum(share), 1), 3) for x in share],
            "front_cpu_s": round(sum(p.get("front_cpu_s", float("nan")) for p in passes), 2),
            "runs": [{"position": p["position"], "wall_s": round(p["wall_s"], 2), **figures(p["turns"], p["wall_s"]),
                      "front_cpu_s": round(p.get("front_cpu_s", float("nan")), 2),
                      "first_turns": first_turns(p["turns"])} for p in passes],
            "per_turn": sorted(({k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()} | {"run": i}
                                for i, p in enumerate(passes) for t in p["turns"]),
                               key=lambda t: (t["run"], t["session"], t["turn"]))}


def first_turns(turns: list[dict]) -> dict[str, dict]:
    """Per worker (as the responses named it; "?" where none did): the first turns it served, their
    sessions' agent types, uncached prompt tokens, and when its last first token came (s into the pass)."""
    out: dict[str, dict] = {}
    for t in sorted((t for t in turns if t["turn"] == 0), key=lambda t: t["session"]):
        w = out.setdefault(t.get("worker") or "?", {"n": 0, "agents": [], "uncached_tokens": 0,
                                                      "last_first_token_s": 0.0})
        w["n"] += 1
        w["agents"] = sorted(set(w["agents"]) | {t["session"] % len(AGENTS)})
        w["uncached_tokens"] += t["prompt_tokens"] - t["cached_tokens"]
        w["last_first_token_s"] = round(max(w["last_first_token_s"], t.get("start_s", 0.0) + t["ttft_s"]), 3)
    return dict(sorted(out.items()))


def pass_order(fronts: tuple[str, ...], repeats: int, order: str = "alternate") -> list[str]:
    """Fronts in ABBA order (A B, B A, A B, ...): drift and the position in the run weigh on both alike."""
    from benchmarks.harness import ab_order
    return [f for _, f in ab_order(fronts, repeats, order)]


def run_live(opts: LiveOptions) -> dict:
    from router.model_info import load_router_model

    if "sglang" in opts.fronts and not _has_sglang_router():
        raise RuntimeError("sglang-router is not installed: pip install sglang-router (or --live-fronts agentrt)")
    model = load_router_model(None)
    wl = AgenticWorkload(sessions=opts.sessions, turns=opts.turns, system_tokens=opts.system_tokens,
                         tool_result_tokens=opts.tool_result_tokens, reply_tokens=opts.reply_tokens)
    systems = [system_prompt(model.tokenizer, opts.system_tokens, seed=i, agent=a) for i, a in enumerate(AGENTS)]
    procs = Procs(prefix="agentrt-live-", cwd=str(ROOT))  # logs in a temporary directory, not in the cwd
    try:
        fleet = start_fleet(procs, opts)
        asyncio.run(_warm_up(fleet["workers"], model.model_id, wl, model.tokenizer, systems))
        raw: dict[str, list[dict]] = {f: [] for f in opts.fronts}
        for position, front in enumerate(pass_order(opts.fronts, opts.repeats, opts.order)):
            url = fleet["fronts"][front]
            print(f"pass {position + 1}: {front} ({url}) ...", flush=True)
            cpu = cpu_seconds(fleet["pids"][front])
            result = asyncio.run(run_pass(front, url, fleet["workers"], wl, model.tokenizer, systems,
                                          model.model_id))
            raw[front].append(result | {"position": position, "front_cpu_s": cpu_seconds(fleet["pids"][front]) - cpu})
    finally:
        procs.stop()
    return {"options": opts.__dict__ | {"fronts": list(opts.fronts)},
            "router_tuning": {"mode": opts.tuning, "non_default_flags": {f: fleet["tuned"][f] for f in opts.fronts}},
            "front_cmds": fleet["cmds"], "passes": {f: summarize(f, raw[f]) for f in opts.fronts}}


def _has_sglang_router() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


def print_live(out: dict) -> None:
    o = out["options"]
    print(f"{o['workers']} workers, {o['sessions']} sessions x {o['turns']} turns, {len(AGENTS)} agent types, "
          f"system {o['system_tokens']} tok, tool result {o['tool_result_tokens']} tok, reply {o['reply_tokens']} tok")
    print(f"{'front':10s} {'hit':>6s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'tok/s':>7s} {'turns/s':>8s}  worker share")
    for name, f in out["passes"].items():
        print(f"{name:10s} {f['hit_rate']:6.3f} {f['ttft_p50_s']:9.3f} {f['ttft_p99_s']:9.3f} "
              f"{f['throughput_tok_s']:7.2f} {f['turns_per_s']:8.3f}  {f['worker_prompt_share']}")
        if len(f["runs"]) > 1:
            for r in f["runs"]:
                print(f"  pass {r['position'] + 1:2d}  {r['hit_rate']:6.3f} {r['ttft_p50_s']:9.3f} "
                      f"{r['ttft_p99_s']:9.3f} {r['throughput_tok_s']:7.2f} {r['turns_per_s']:8.3f}  "
                      f"front CPU {r['front_cpu_s']:.1f} s")
                print("           first turns: " + ", ".join(
                    f"{w} {v['n']} (agents {v['agents']}, last {v['last_first_token_s']:.1f} s)"
                    for w, v in r["first_turns"].items()))
