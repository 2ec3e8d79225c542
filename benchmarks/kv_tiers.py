"""Agent sessions with tool pauses, on a device pool too small for them: the KV tiers off and on.

The engine benchmark's workload (benchmarks/workload.py: S sessions on one shared system prompt,
every turn a tool result and a short greedy reply), 16 sessions by default. After each turn the
session's "tool" runs for a pause drawn uniformly from [0, 2 x --pause-s] (seeded) before its next
turn arrives; each turn is pinned for a quarter of the mean pause (a session turn's pin, as the
server sets one), so most pins expire while the tool runs. The device pool is sized to hold about a
quarter of the sessions' live contexts at once (``--pool-fraction``): while a session pauses,
the others' turns evict its pages. Tier off, its next turn recomputes them; tier on, they come
back from the disk tier (the CPU default; ``--host-tokens`` adds a host tier), read either warm (the
files as written, so recent pages come back from the OS page cache) or cold (``tier_on_cold``: each
page file fsynced and dropped from the page cache after writing, ``kv_disk_drop_page_cache``, so
every read goes to the device).

Arrivals. Every session's start (spread over ``--start-spread-s``, default the mean pause) and every
tool pause is drawn from the seed BEFORE the runs (``schedule`` in the JSON: the same numbers for
every run). A turn is sent its pause after the session's previous reply finished (an agent cannot
send the next turn before it has the reply), so the arrival times themselves depend on each run's
own reply times: a run that answers sooner gets its next turns sooner. The runs (tier off, on warm,
on cold) go in ABBA-style alternating order over ``--repeats``, each on a fresh engine.

Reported per run: TTFT p50/p99 of turns 2+, prompt tokens served from the device pool, the host
and the disk tier (turns 2+), the tiers' bytes written and read, and the wall time. Greedy replies
of both runs are compared (they must be identical).

    python benchmarks/kv_tiers.py --json out/kv_tiers.json [--quick] [--repeats 2]
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.workload import AgenticWorkload, finished_turns  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.tokenizer import encode_chat  # noqa: E402
from engine.loader import load_tokenizer  # noqa: E402

PAGE = 16


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def live_context_tokens(wl: AgenticWorkload, tok, system: str) -> int:
    """Every session's context at its middle turn, the shared system prompt counted once."""
    mid = max(1, wl.turns // 2)
    history = [{"role": "system", "content": system}]
    sys_len = len(encode_chat(tok, history))
    total = 0
    for s in range(wl.sessions):
        h = list(history)
        for t in range(mid):
            h.extend(wl.turn_messages(tok, s, t))
            h.append({"role": "assistant", "content": "x " * wl.reply_tokens})
        total += len(encode_chat(tok, h)) - sys_len
    return sys_len + total


def draw_schedule(sessions: int, turns: int, pause_s: float, start_spread_s: float, seed: int) -> dict:
    """Drawn before any run, the same for all: each session's start offset (s) and the tool pause
    (s) after each of its turns but the last; seeded per (session, turn)."""
    def draw(s: int, t: int, hi: float) -> float:
        return random.Random(seed * 1_000_003 + s * 1009 + t).uniform(0, hi)
    return {"start_s": [draw(s, -1, start_spread_s) for s in range(sessions)],
            "pause_s": [[draw(s, t, 2 * pause_s) for t in range(1, turns)] for s in range(sessions)]}


def run(engine: LLMEngine, wl: AgenticWorkload, system: str, pause_s: float, schedule: dict) -> dict:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=wl.reply_tokens, temperature=0, ignore_eos=True)
    pin_ttl = pause_s / 4
    history = {s: [{"role": "system", "content": system}] for s in range(wl.sessions)}
    turn = {s: 0 for s in range(wl.sessions)}
    live: dict[str, tuple[int, float, list[int]]] = {}
    due: list[tuple[float, int]] = []   # (when the tool result arrives, session)
    ttft: dict[tuple[int, int], float] = {}
    by_tier = {"device": 0, "host": 0, "disk": 0}
    replies: dict[tuple[int, int], list[int]] = {}
    prompt_later = 0

    def submit(s: int) -> None:
        history[s].extend(wl.turn_messages(tok, s, turn[s]))
        rid = engine.add_request(encode_chat(tok, history[s]), params, pin_ttl_s=pin_ttl)
        live[rid] = (s, time.perf_counter(), [])

    start = time.perf_counter()
    for s in range(wl.sessions):   # sessions start spread over [0, start_spread_s] (seeded), not in one burst
        heapq.heappush(due, (start + schedule["start_s"][s], s))
    while live or due:
        now = time.perf_counter()
        while due and due[0][0] <= now:
            submit(heapq.heappop(due)[1])
        if not live and due:
            time.sleep(max(0.0, due[0][0] - now))
            continue
        if not engine.has_unfinished():   # only pins left: let them expire on schedule
            time.sleep(0.001)
        for s, out, ids in finished_turns(engine, live, turn, ttft, replies):
            if turn[s] >= 1:
                prompt_later += out.prompt_tokens
                for k, v in out.cached_tokens_by_tier.items():
                    by_tier[k] += v
            history[s].append({"role": "assistant", "content": tok.decode(ids)})
            turn[s] += 1
            if turn[s] < wl.turns:
                heapq.heappush(due, (time.perf_counter() + schedule["pause_s"][s][turn[s] - 1], s))
    wall = time.perf_counter() - start
    later = [v for (s, t), v in ttft.items() if t >= 1]
    tiers = engine.stats().kv_tiers
    return {
        "ttft_p50_s_turns2plus": statistics.median(later),
        "ttft_p99_s_turns2plus": pct(later, 99),
        "ttft_p50_s_turn1": statistics.median(v for (s, t), v in ttft.items() if t == 0),
        "prompt_tokens_turns2plus": prompt_later,
        "hit_tokens_by_tier": by_tier,
        "hit_rate_by_tier": {k: v / prompt_later for k, v in by_tier.items()} if prompt_later else {},
        "bytes_written": {m: t["bytes_written"] for m, t in tiers.items()},
        "bytes_read": {m: t["bytes_read"] for m, t in tiers.items()},
        "tier_load_time_s": {m: t["load_time_s"] for m, t in tiers.items()},
        "tier_pages_loaded": {m: t["loads"] for m, t in tiers.items()},
        "tier_errors": {m: t["errors"] + t["corrupt"] for m, t in tiers.items()},
        "preemptions": engine.stats().num_preemptions,
        "wall_s": wall,
        "_replies": replies,
    }


RUNS = {"tier_off": (False, False), "tier_on": (True, False), "tier_on_cold": (True, True)}  # (tier, cold)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, repeats=1, json_required=True)
    ap.add_argument("--quick", action="store_true",
                    help="16 sessions x 3 turns, a 256-token system prompt, 64-token tool results, 8-token replies")
    ap.add_argument("--sessions", type=int, default=16, help="agent sessions")
    ap.add_argument("--turns", type=int, default=6, help="turns per session")
    ap.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    ap.add_argument("--tool-result-tokens", type=int, default=200, help="tokens of each turn's tool result")
    ap.add_argument("--reply-tokens", type=int, default=32, help="tokens of each reply (EOS ignored)")
    ap.add_argument("--pause-s", type=float, default=2.0, help="mean tool pause (uniform on [0, 2x])")
    ap.add_argument("--start-spread-s", type=float, default=None,
                    help="sessions start uniformly over [0, this] (default: --pause-s)")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="device pool size as a fraction of the sessions' live contexts")
    ap.add_argument("--disk-tokens", type=int, default=262144, help="disk tier size with the tier on")
    ap.add_argument("--host-tokens", type=int, default=0, help="host tier size with the tier on")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the starts and pauses (drawn before the runs)")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.system_tokens, args.tool_result_tokens, args.reply_tokens = 3, 256, 64, 8
        args.pause_s = min(args.pause_s, 0.5)
    if args.start_spread_s is None:
        args.start_spread_s = args.pause_s
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run_info = harness.Run(args, __file__, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    schedule = draw_schedule(wl.sessions, wl.turns, args.pause_s, args.start_spread_s, args.seed)
    results: dict = {"workload": vars(wl) | {"pause_s": args.pause_s, "pool_fraction": args.pool_fraction,
                                             "start_spread_s": args.start_spread_s},
                     "dtype": args.dtype, "schedule": schedule,
                     "arrivals": "starts and pauses drawn before the runs (schedule), the same for every run; "
                                 "a turn is sent its pause after the session's previous reply finished, so arrival "
                                 "times depend on each run's own reply times"}
    tok, _, _ = load_tokenizer(None)   # size the pool from the workload's contexts
    system = system_prompt(tok, wl.system_tokens)
    live = live_context_tokens(wl, tok, system)
    longest = len(encode_chat(tok, [{"role": "system", "content": system}])) + \
        wl.turns * (wl.tool_result_tokens + wl.reply_tokens + 64)
    results["pool_tokens"] = max(int(args.pool_fraction * live), longest + 4 * PAGE) // PAGE * PAGE + PAGE
    results["live_context_tokens"] = live
    runs: dict[str, list[dict]] = {name: [] for name in RUNS}
    for r, name in harness.ab_order(list(RUNS), args.repeats, args.order):
        runs[name].append(run_one(name, r, args, wl, system, results["pool_tokens"], schedule))
        print(f"{name}: pool {results['pool_tokens']} tokens for ~{live} live; {_line(runs[name][-1])}", flush=True)
    replies = [x.pop("_replies") for rs in runs.values() for x in rs]
    results["replies_identical"] = all(rep == replies[0] for rep in replies)
    results["runs"] = runs
    for name, rs in runs.items():
        results[name] = {k: harness.spread(x[k] for x in rs) for k in ("ttft_p50_s_turns2plus",
                                                                       "ttft_p99_s_turns2plus", "wall_s")}
    for name in ("tier_on", "tier_on_cold"):
        for q in ("p50", "p99"):
            key = f"ttft_{q}_s_turns2plus"
            results[f"{name}_ttft_{q}_speedup_turns2plus"] = results["tier_off"][key]["median"] / \
                results[name][key]["median"]
    print(f"speedup turns 2+ (median): warm p50 {results['tier_on_ttft_p50_speedup_turns2plus']:.2f}x, "
          f"cold p50 {results['tier_on_cold_ttft_p50_speedup_turns2plus']:.2f}x; "
          f"replies identical {results['replies_identical']}")
    run_info.write(results, settings=harness.engine_settings(EngineConfig(dtype=args.dtype)))
    return 0


def run_one(name: str, repeat: int, args, wl, system: str, pool_tokens: int, schedule: dict) -> dict:
    """One run on a fresh engine, its disk tier in a directory of its own (removed after)."""
    tier, cold = RUNS[name]
    tier_dir = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    try:
        cfg = dict(dtype=args.dtype, max_batched_tokens=512, kv_disk_tokens=args.disk_tokens if tier else 0,
                   kv_host_tokens=args.host_tokens if tier else 0, kv_disk_drop_page_cache=cold,
                   max_waiting_tokens=1 << 30,   # every session queues its turn: no 429s here
                   kv_disk_path=os.path.join(tier_dir, name))
        engine = LLMEngine(EngineConfig(kv_cache_tokens=pool_tokens, **cfg))
        try:
            return {"repeat": repeat, **run(engine, wl, system, args.pause_s, schedule)}
        finally:
            engine.close()
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)


def _line(r: dict) -> str:
    return (f"TTFT turns 2+ p50 {r['ttft_p50_s_turns2plus']:.3f}s p99 {r['ttft_p99_s_turns2plus']:.3f}s, "
            f"hits {r['hit_tokens_by_tier']} of {r['prompt_tokens_turns2plus']}, wall {r['wall_s']:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
