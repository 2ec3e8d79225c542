"""S concurrent agent sessions through the HTTP session API: TTFT per turn and cache reuse.

    python benchmarks/api_sessions.py --url http://127.0.0.1:8000 --json out/api_sessions.json
    python benchmarks/api_sessions.py --against-engine --json out/api_vs_engine.json

The workload is the engine benchmark's (``benchmarks/workload.py``): S sessions share a
~1,500-token system prompt with tool definitions; every turn appends a ~200-token tool
result and asks for a 32-token reply at temperature 0. Sessions run concurrently, turns
within a session one after another. TTFT is measured at the client, from sending the turn
to the first streamed content event, so it includes the whole HTTP layer; compare it with
``benchmarks/engine_sessions.py`` on the same workload to see that layer's overhead.

``--against-engine`` does that comparison in one run: first the workload on the engine in
this process (``engine_sessions.run_engine``: each turn submitted the moment the previous
reply ends, TTFT from submission to the first token), then ``agentrt serve`` with the same
engine settings in a subprocess and the workload through its session API, and reports the
ratio of TTFT p50 on turns 2+ (HTTP over in-process; the target is at most 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import agentrt  # noqa: E402
from agentrt.bench.progress import bar  # noqa: E402
from benchmarks import harness  # noqa: E402
from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402


def load_tokenizer(path: str | None):
    """The model's tokenizer (no weights), to size the workload's text."""
    from engine.loader import load_tokenizer as load

    return load(path)[0]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def run_session(client: agentrt.AsyncClient, wl: AgenticWorkload, tokenizer, system: str, s: int,
                      records: list[dict], progress=None) -> None:
    session = await client.sessions.create(system=system, sampling={"temperature": 0, "max_tokens": wl.reply_tokens,
                                                                     "ignore_eos": True},
                                           metadata={"benchmark": "api_sessions"})
    try:
        for t in range(wl.turns):
            messages = wl.turn_messages(tokenizer, s, t)
            start = time.perf_counter()
            first = None
            stream = await session.send(messages, stream=True)
            async for delta in stream:
                if first is None and (delta.content or delta.tool_call):
                    first = time.perf_counter()
            end = time.perf_counter()
            usage = stream.reply.usage
            records.append({"session": s, "turn": t, "ttft_s": (first or end) - start, "latency_s": end - start,
                            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.cached_tokens,
                            "completion_tokens": usage.completion_tokens})
            if progress is not None:
                progress.update(1)
    finally:
        await session.close()


def summarize(records: list[dict], wl: AgenticWorkload, wall_s: float) -> dict:
    per_turn = []
    for t in range(wl.turns):
        rows = [r for r in records if r["turn"] == t]
        ttft = [r["ttft_s"] for r in rows]
        prompt = sum(r["prompt_tokens"] for r in rows)
        per_turn.append({"turn": t + 1, "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": percentile(ttft, 99),
                         "cached_fraction": sum(r["cached_tokens"] for r in rows) / max(1, prompt)})
    later = [r for r in records if r["turn"] > 0]
    prompt_all = sum(r["prompt_tokens"] for r in records)
    return {
        "workload": {"sessions": wl.sessions, "turns": wl.turns, "system_tokens": wl.system_tokens,
                     "tool_result_tokens": wl.tool_result_tokens, "reply_tokens": wl.reply_tokens},
        "wall_s": wall_s,
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in records),
        "ttft_p99_s": percentile([r["ttft_s"] for r in records], 99),
        "ttft_p50_turns_2_plus_s": statistics.median(r["ttft_s"] for r in later) if later else None,
        "cached_fraction": sum(r["cached_tokens"] for r in records) / max(1, prompt_all),
        "cached_fraction_turns_2_plus": (sum(r["cached_tokens"] for r in later)
                                         / max(1, sum(r["prompt_tokens"] for r in later))),
        "completion_tokens": sum(r["completion_tokens"] for r in records),
        "per_turn": per_turn,
        "records": records,
    }


async def main_async(args: argparse.Namespace) -> dict:
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    tokenizer = load_tokenizer(args.model_path)
    system = system_prompt(tokenizer, wl.system_tokens, seed=wl.seed)
    records: list[dict] = []
    async with agentrt.AsyncClient(args.url, api_key=args.api_key, timeout=600) as client:
        await client.health()
        start = time.perf_counter()
        with bar(wl.sessions * wl.turns, "HTTP sessions", unit="turn") as progress:
            await asyncio.gather(*(run_session(client, wl, tokenizer, system, s, records, progress)
                                   for s in range(wl.sessions)))
        wall = time.perf_counter() - start
    return summarize(records, wl, wall)


ENGINE_KV_TOKENS, ENGINE_BATCHED_TOKENS = 131072, 512   # benchmarks/engine_sessions.py's engine


def run_in_process(wl: AgenticWorkload) -> dict:
    """The same workload on the engine in this process; the engine is freed afterwards."""
    import gc

    from benchmarks.engine_sessions import run_engine
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(kv_cache_tokens=ENGINE_KV_TOKENS, max_batched_tokens=ENGINE_BATCHED_TOKENS))
    system = system_prompt(engine.tokenizer, wl.system_tokens, seed=wl.seed)
    result = run_engine(engine, wl, system)
    result.pop("_replies")
    del engine
    gc.collect()
    return result


def run_against_engine(args: argparse.Namespace) -> dict:
    from agentrt.procs import Procs

    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    print("in-process engine ...", flush=True)
    engine = run_in_process(wl)
    print(f"  TTFT p50 turns 2+ {engine['ttft_p50_s_turns2plus']:.3f} s, wall {engine['wall_s']:.1f} s", flush=True)
    procs = Procs(prefix="agentrt-api-sessions-", cwd=Path(__file__).resolve().parents[1], echo=True)
    try:
        server = procs.agentrt("serve", "serve", "--log-level", "warning", "--kv-cache-tokens", str(ENGINE_KV_TOKENS),
                               *args.serve_flag)
        print("HTTP session API: " + " ".join(server.cmd[2:]), flush=True)
        args.url = server.wait_ready().url
        http = asyncio.run(main_async(args))
    finally:
        procs.stop(timeout_s=60.0)
    ratio = http["ttft_p50_turns_2_plus_s"] / engine["ttft_p50_s_turns2plus"]
    return {"http": http, "engine": engine, "server_flags": server.cmd[3:],
            "ttft_p50_turns_2_plus_ratio": ratio, "target_ratio": 1.15, "target_met": ratio <= 1.15,
            "wall_ratio": http["wall_s"] / engine["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the agentrt server to drive")
    parser.add_argument("--api-key", default=None, help="bearer token for the server, if it wants one")
    harness.add_common_args(parser, repeats=None)
    parser.add_argument("--sessions", type=int, default=8, help="agent sessions in the workload")
    parser.add_argument("--turns", type=int, default=8, help="turns per session")
    parser.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    parser.add_argument("--tool-result-tokens", type=int, default=200, help="tokens of each turn's tool result")
    parser.add_argument("--reply-tokens", type=int, default=32, help="max_tokens of each reply")
    parser.add_argument("--model-path", default=None, help="GGUF whose tokenizer sizes the text (default model)")
    parser.add_argument("--quick", action="store_true", help="4 sessions x 4 turns")
    parser.add_argument("--against-engine", action="store_true",
                        help="run the workload in-process first, then through a server this starts")
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="extra flag for the server --against-engine starts (repeatable, e.g. "
                             "--serve-flag=--turn-coalesce-max-s=0)")
    args = parser.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    if args.quick:
        args.sessions, args.turns = 4, 4
    if args.against_engine:
        both = run_against_engine(args)
        result = both["http"]
    else:
        result = asyncio.run(main_async(args))
    print(f"{args.sessions} sessions x {args.turns} turns in {result['wall_s']:.1f} s; "
          f"TTFT p50 {result['ttft_p50_s'] * 1000:.0f} ms, p99 {result['ttft_p99_s'] * 1000:.0f} ms; "
          f"cached fraction {result['cached_fraction']:.2f} ({result['cached_fraction_turns_2_plus']:.2f} on turns 2+)")
    for row in result["per_turn"]:
        print(f"  turn {row['turn']}: TTFT p50 {row['ttft_p50_s'] * 1000:7.0f} ms  p99 {row['ttft_p99_s'] * 1000:7.0f} ms"
              f"  cached {row['cached_fraction']:.2f}")
    if args.against_engine:
        eng = both["engine"]
        print(f"in-process engine: TTFT p50 turns 2+ {eng['ttft_p50_s_turns2plus'] * 1000:.0f} ms, "
              f"wall {eng['wall_s']:.1f} s; HTTP/in-process TTFT p50 ratio "
              f"{both['ttft_p50_turns_2_plus_ratio']:.3f} (target <= 1.15), wall ratio {both['wall_ratio']:.3f}")
        result = both
    run.write(result, settings=harness.serve_settings(args.serve_flag) if args.against_engine else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
