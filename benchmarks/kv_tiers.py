"""Agent sessions with tool pauses, on a device pool too small for them: the KV tiers off and on.

The engine benchmark's workload (benchmarks/workload.py: S sessions on one shared system prompt,
every turn a tool result and a short greedy reply), 16 sessions by default. After each turn the
session's "tool" runs for a pause drawn uniformly from [0, 2 x --pause-s] (seeded) before its next
turn arrives; each turn is pinned for a quarter of the mean pause (a session turn's pin, as the
server sets one), so most pins expire while the tool runs. The device pool is sized to hold about a
quarter of the sessions' live contexts at once (``--pool-fraction``): while a session pauses,
the others' turns evict its pages. Tier off, its next turn recomputes them; tier on, they come
back from the disk tier (the CPU default; ``--host-tokens`` adds a host tier).

Sessions start spread over ``--start-spread-s`` (default: the mean pause) and every start and pause is
drawn per (session, turn) from the seed, so both runs see the same arrivals.

Reported per run: TTFT p50/p99 of turns 2+, prompt tokens served from the device pool, the host
and the disk tier (turns 2+), the tiers' bytes written and read, and the wall time. Greedy replies
of both runs are compared (they must be identical).

    python benchmarks/kv_tiers.py --json out/kv_tiers.json [--quick]
"""

from __future__ import annotations

import argparse
import heapq
import json
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
from benchmarks.workload import AgenticWorkload  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.chat import encode_chat  # noqa: E402
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


def run(engine: LLMEngine, wl: AgenticWorkload, system: str, pause_s: float, seed: int,
        start_spread_s: float = 0.0) -> dict:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=wl.reply_tokens, temperature=0, ignore_eos=True)
    def draw(s: int, t: int, hi: float) -> float:
        """Seeded per (session, turn): both runs give every session the same start and pauses."""
        return random.Random(seed * 1_000_003 + s * 1009 + t).uniform(0, hi)
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
        heapq.heappush(due, (start + draw(s, -1, start_spread_s), s))
    while live or due:
        now = time.perf_counter()
        while due and due[0][0] <= now:
            submit(heapq.heappop(due)[1])
        if not live and due:
            time.sleep(max(0.0, due[0][0] - now))
            continue
        if not engine.has_unfinished():   # only pins left: let them expire on schedule
            time.sleep(0.001)
        for out in engine.step():
            s, t0, ids = live[out.request_id]
            if out.token_ids and (s, turn[s]) not in ttft:
                ttft[(s, turn[s])] = time.perf_counter() - t0
            ids.extend(out.token_ids)
            if not out.finished:
                continue
            if out.finish_reason != "length":
                raise RuntimeError(f"session {s} turn {turn[s]} ended with {out.finish_reason}: {out.error}")
            del live[out.request_id]
            replies[(s, turn[s])] = ids
            if turn[s] >= 1:
                prompt_later += out.prompt_tokens
                for k, v in out.cached_tokens_by_tier.items():
                    by_tier[k] += v
            history[s].append({"role": "assistant", "content": tok.decode(ids)})
            turn[s] += 1
            if turn[s] < wl.turns:
                heapq.heappush(due, (time.perf_counter() + draw(s, turn[s], 2 * pause_s), s))
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true",
                    help="16 sessions x 3 turns, a 256-token system prompt, 64-token tool results, 8-token replies")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--tool-result-tokens", type=int, default=200)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--pause-s", type=float, default=2.0, help="mean tool pause (uniform on [0, 2x])")
    ap.add_argument("--start-spread-s", type=float, default=None,
                    help="sessions start uniformly over [0, this] (default: --pause-s)")
    ap.add_argument("--pool-fraction", type=float, default=0.25,
                    help="device pool size as a fraction of the sessions' live contexts")
    ap.add_argument("--disk-tokens", type=int, default=262144, help="disk tier size with the tier on")
    ap.add_argument("--host-tokens", type=int, default=0, help="host tier size with the tier on")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.system_tokens, args.tool_result_tokens, args.reply_tokens = 3, 256, 64, 8
        args.pause_s = min(args.pause_s, 0.5)
    if args.start_spread_s is None:
        args.start_spread_s = args.pause_s
    if args.threads:
        torch.set_num_threads(args.threads)
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    results: dict = {"workload": vars(wl) | {"pause_s": args.pause_s, "pool_fraction": args.pool_fraction,
                                       "start_spread_s": args.start_spread_s},
                     "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
                     "dtype": args.dtype}
    tok, _, _ = load_tokenizer(None)   # size the pool from the workload's contexts
    system = system_prompt(tok, wl.system_tokens)
    live = live_context_tokens(wl, tok, system)
    longest = len(encode_chat(tok, [{"role": "system", "content": system}])) + \
        wl.turns * (wl.tool_result_tokens + wl.reply_tokens + 64)
    results["pool_tokens"] = max(int(args.pool_fraction * live), longest + 4 * PAGE) // PAGE * PAGE + PAGE
    results["live_context_tokens"] = live
    tier_dir = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    try:
        for name, disk, host in (("tier_off", 0, 0), ("tier_on", args.disk_tokens, args.host_tokens)):
            cfg = dict(dtype=args.dtype, max_batched_tokens=512, kv_disk_tokens=disk, kv_host_tokens=host,
                       max_waiting_tokens=1 << 30,   # every session queues its turn: no 429s here
                       kv_disk_path=os.path.join(tier_dir, name))
            engine = LLMEngine(EngineConfig(kv_cache_tokens=results["pool_tokens"], **cfg))
            print(f"{name}: pool {results['pool_tokens']} tokens for ~{results['live_context_tokens']} live", flush=True)
            results[name] = run(engine, wl, system, args.pause_s, args.seed, args.start_spread_s)
            engine.close()
            r = results[name]
            print(f"{name}: TTFT turns 2+ p50 {r['ttft_p50_s_turns2plus']:.3f}s p99 {r['ttft_p99_s_turns2plus']:.3f}s, "
                  f"hits {r['hit_tokens_by_tier']} of {r['prompt_tokens_turns2plus']}, wall {r['wall_s']:.1f}s",
                  flush=True)
            del engine
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    off, on = results["tier_off"], results["tier_on"]
    results["replies_identical"] = off.pop("_replies") == on.pop("_replies")
    results["ttft_p50_speedup_turns2plus"] = off["ttft_p50_s_turns2plus"] / on["ttft_p50_s_turns2plus"]
    results["ttft_p99_speedup_turns2plus"] = off["ttft_p99_s_turns2plus"] / on["ttft_p99_s_turns2plus"]
    print(f"speedup turns 2+: p50 {results['ttft_p50_speedup_turns2plus']:.2f}x, "
          f"p99 {results['ttft_p99_speedup_turns2plus']:.2f}x; replies identical {results['replies_identical']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
