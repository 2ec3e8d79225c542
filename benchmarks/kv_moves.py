"""A turn moved to another worker: its KV pulled from the worker that holds it, or recomputed.

Starts a Redis and two workers on this machine (``agentrt worker`` processes through ``agentrt.procs``,
the launcher ``agentrt up`` uses; one process per worker). Each sample is a fresh agent context of
``--tokens`` token ids (seeded): the holder computes it first (as the session's earlier turns would
have), then the same context is sent to the other worker as the moved turn, with ``kv_source`` naming
the holder (``pull``) or without (``recompute``), one reply token, greedy. Sides run in ABBA order over
``--repeats``; TTFT is measured by the client from sending the turn to its first token.

Reported per side: TTFT p50 / min / max over its samples, the prompt tokens the target served from its
cache, the bytes it pulled, and whether every reply token equals the holder's.

Scale-in (``scale_in``): three workers and a router; ``--sessions`` conversations (each named by a
``prompt_cache_key``, so pinned between turns, each its own ``--scale-in-tokens`` context) run their first
turn; then the worker holding the most of them is stopped (SIGTERM: it drains), and every session runs
its second turn. ``handover``: KV moves on (the draining worker hands its pinned sessions over);
``no_handover``: every process with ``--kv-moves false``. Reported: the prompt tokens of the stopped
worker's sessions' second turns recomputed (not served from a cache), in all and within their first
turn's context (``recomputed_pinned_tokens``).

    python benchmarks/kv_moves.py --json out/kv_moves.json [--tokens 8000] [--samples 3] [--repeats 2]
    python benchmarks/kv_moves.py --tokens 1024 --samples 1 --sessions 3 --scale-in-tokens 512   # smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentrt.procs import Procs  # noqa: E402
from benchmarks import harness  # noqa: E402

SIDES = ("pull", "recompute")
HEARTBEAT = ("--heartbeat-ttl-s", "3", "--heartbeat-interval-s", "0.5")


def context(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def turn(http: httpx.Client, url: str, prompt: list[int], kv_source: str | None) -> dict:
    """One turn to a worker's ``/internal/generate``: its TTFT (client side), reply tokens, cached tokens."""
    body = {"request_id": f"kvm-{time.monotonic_ns()}", "prompt_token_ids": prompt,
            "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}}
    if kv_source is not None:
        body["kv_source"] = {"url": kv_source}
    started = time.perf_counter()
    ttft, tokens, cached = None, [], 0
    with http.stream("POST", url + "/internal/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url} answered {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line:
                continue
            out = msgspec.json.decode(line)
            if out["token_ids"] and ttft is None:
                ttft = time.perf_counter() - started
            tokens += out["token_ids"]
            if out["finished"]:
                if out["error"]:
                    raise RuntimeError(f"{url}: {out['error']}")
                cached = out["cached_tokens"]
    return {"ttft_s": ttft, "tokens": tokens, "cached_tokens": cached}


def start_cluster(procs: Procs, pool_tokens: int, flags: list[str]) -> tuple[str, str, Procs]:
    redis = procs.redis(appendonly=False)
    workers = [procs.agentrt(wid, "worker", "--redis", redis.url, "--worker-id", wid, "--kv-cache-tokens",
                             str(pool_tokens), "--log-level", "warning", *HEARTBEAT, *flags) for wid in ("wa", "wb")]
    return workers[0].wait_ready().url, workers[1].wait_ready().url, procs


def summary(samples: list[dict]) -> dict:
    ttfts = [s["ttft_s"] for s in samples]
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_min_s": min(ttfts), "ttft_max_s": max(ttfts),
            "ttft_runs_s": ttfts, "cached_tokens": [s["cached_tokens"] for s in samples],
            "pulled_bytes": sum(s.get("pulled_bytes", 0) for s in samples),
            "same_tokens_as_holder": all(s["same"] for s in samples), "samples": len(samples)}


def scale_in(args: argparse.Namespace, side: str, run_: harness.Run) -> dict:
    """One scale-in of 1 of 3 workers (see the module docstring); ``side`` handover or no_handover."""
    off = [] if side == "handover" else ["--kv-moves", "false"]
    procs = Procs(Path(tempfile.mkdtemp(prefix=f"kv-moves-{side}-")), cwd=harness.REPO)
    try:
        redis = procs.redis(appendonly=False)
        workers = {f"w{i}": procs.agentrt(f"w{i}", "worker", "--redis", redis.url, "--worker-id", f"w{i}",
                                          "--log-level", "warning", *HEARTBEAT, *off) for i in range(3)}
        for w in workers.values():
            w.wait_ready()
        router = procs.agentrt("router", "router", "--redis", redis.url, "--log-level", "warning", *HEARTBEAT,
                               *off).wait_ready()
        for w in (*workers.values(), router):
            run_.add_server(f"{side}-{w.name}", w.cmd, harness.non_default_flags(off))
        http = httpx.Client(timeout=httpx.Timeout(30.0, read=1800.0))
        model = http.get(router.url + "/v1/models").json()["data"][0]["id"]
        chats = [[{"role": "user", "content": " ".join(f"line {s}.{i}: step {i * 7 % 13} passed"
                                                          for i in range(args.scale_in_tokens // 12))}]
                 for s in range(args.sessions)]
        first = [_chat(http, router.url, model, f"s{s}", chats[s]) for s in range(args.sessions)]
        where = [f["worker"] for f in first]
        gone = max(workers, key=where.count)
        workers[gone].stop()
        while gone in [w["id"] for w in http.get(router.url + "/router/state").json()["workers"]]:
            time.sleep(0.1)
        time.sleep(2.0)   # the targets' KV events reach the router
        recomputed = context = 0
        for s in range(args.sessions):
            msgs = chats[s] + [{"role": "assistant", "content": first[s]["text"]},
                               {"role": "user", "content": "And which one failed?"}]
            second = _chat(http, router.url, model, f"s{s}", msgs)
            if where[s] == gone:
                recomputed += second["prompt_tokens"] - second["cached_tokens"]
                context += max(0, first[s]["prompt_tokens"] // 16 * 16 - second["cached_tokens"])
        return {"stopped_worker_sessions": where.count(gone), "sessions": args.sessions,
                "recomputed_pinned_tokens": context, "recomputed_prompt_tokens": recomputed}
    finally:
        procs.stop()


def _chat(http: httpx.Client, url: str, model: str, key: str, messages: list[dict]) -> dict:
    resp = http.post(url + "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 8,
                                                         "temperature": 0, "prompt_cache_key": key})
    if resp.status_code != 200:
        raise RuntimeError(f"router answered {resp.status_code}: {resp.text[:300]}")
    body = resp.json()
    return {"worker": resp.headers["x-agentrt-worker"], "text": body["choices"][0]["message"]["content"] or "",
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def run(args: argparse.Namespace) -> dict:
    run_ = harness.Run(args, __file__)
    pool = 2 * args.tokens + 1024
    flags = list(args.worker_flag or [])
    log_dir = Path(tempfile.mkdtemp(prefix="kv-moves-"))
    procs = Procs(log_dir, cwd=harness.REPO)
    results: dict[str, list[dict]] = {s: [] for s in SIDES}
    try:
        holder, target, _ = start_cluster(procs, pool, flags)
        for name in ("wa", "wb"):
            run_.add_server(name, procs.procs[-2 if name == "wa" else -1].cmd,
                            harness.non_default_flags(["--kv-cache-tokens", str(pool), *flags]))
        http = httpx.Client(timeout=httpx.Timeout(30.0, read=1800.0))
        seed = 0
        for repeat, side in harness.ab_order(SIDES, args.repeats, args.order):
            for _ in range(args.samples):
                seed += 1
                prompt = context(args.tokens, seed)
                ref = turn(http, holder, prompt, None)               # the holder computes the context
                stats_before = http.get(target + "/internal/kv/stats").json()
                got = turn(http, target, prompt, holder if side == "pull" else None)
                stats_after = http.get(target + "/internal/kv/stats").json()
                got["same"] = got["tokens"] == ref["tokens"]
                got["pulled_bytes"] = stats_after["pulled_bytes"] - stats_before["pulled_bytes"]
                results[side].append(got)
                print(f"repeat {repeat} {side:9s} ttft {got['ttft_s']:.3f} s cached {got['cached_tokens']} "
                      f"(holder's own ttft {ref['ttft_s']:.3f} s)", flush=True)
    finally:
        procs.stop()
    moved = {side: summary(results[side]) for side in SIDES}
    scaled = {side: scale_in(args, side, run_) for side in ("handover", "no_handover")} if args.sessions else {}
    body = {"tokens": args.tokens, "moved_turn": moved,
            "pull_speedup_p50": moved["recompute"]["ttft_p50_s"] / moved["pull"]["ttft_p50_s"],
            "scale_in": scaled, "logs": str(log_dir)}
    for side, got in scaled.items():
        print(f"scale-in {side}: {got['recomputed_pinned_tokens']} context tokens of the stopped worker's "
              f"{got['stopped_worker_sessions']} sessions recomputed", flush=True)
    print(f"TTFT p50 at {args.tokens} tokens: pull {moved['pull']['ttft_p50_s']:.3f} s, recompute "
          f"{moved['recompute']['ttft_p50_s']:.3f} s ({body['pull_speedup_p50']:.1f}x)", flush=True)
    return run_.write(body, settings=harness.serve_settings(flags))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8000, help="tokens of the moved context (default 8000: the "
                        "default model's window is 8192)")
    parser.add_argument("--samples", type=int, default=3, help="moved turns per side and repeat (default 3)")
    parser.add_argument("--worker-flag", action="append", metavar="FLAG",
                        help="a flag for both workers, as --worker-flag=--dtype --worker-flag=bfloat16 (repeatable)")
    parser.add_argument("--sessions", type=int, default=6, help="conversations of the scale-in run (default 6; "
                        "0 skips it)")
    parser.add_argument("--scale-in-tokens", type=int, default=2048, help="context tokens of each scale-in "
                        "conversation (default 2048)")
    harness.add_common_args(parser)
    args = parser.parse_args(argv)
    if args.tokens < 64 or args.samples < 1 or args.sessions < 0 or args.scale_in_tokens < 64:
        parser.error("--tokens and --scale-in-tokens must be >= 64, --samples >= 1 and --sessions >= 0")
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
