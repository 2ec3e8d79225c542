"""Batch-1 decode through each layer of the serving path, in one run: where the tokens per second go.

    python benchmarks/decode_path.py --repeats 2 --json OUT

Three sides decode the same fresh prompts (``--tokens`` each, greedy, ``ignore_eos``, speculation off so
no side replays an earlier reply), each in a process of its own (two engines in one process would run
two OpenMP thread teams against each other):

- ``engine``: ``LLMEngine.step()`` in a loop, the engine alone (engine/engine.py);
- ``async``: ``AsyncEngine.submit``, the engine thread and an asyncio consumer in one process, as a
  server runs them (``AsyncEngine``, engine/engine.py);
- ``http``: ``agentrt serve --speculative off``, streamed Chat Completions read through httpx-sse.

A side's rate is ``(tokens - 1) / (last token - first token)`` per prompt, the median over its
``--prompts``; the sides run in ABBA-style order over ``--repeats`` (engine, async, http, then reversed),
each on a fresh engine or server that answered a warm-up request first. The JSON has per side the per-run
rates with their median and range, and ``ms_per_token`` (1000 / median rate) with the milliseconds each
layer adds to a token over the one below it. Where ``http`` decodes slower than ``engine``, the serving
layer (the asyncio thread's per-token work holding the GIL while the engine thread returns from torch
between operations) is what a decode-speed comparison with llama-server measures beside the model step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("engine", "async", "http")
TOPICS = ("a lighthouse keeper", "a desert caravan", "a mountain monastery", "a harbour at dawn",
          "a forest village", "a city by a river", "an orbital station", "a night train")


def prompts(repeat: int, count: int) -> list[str]:
    """Distinct prompts per repeat (the same on every side of that repeat)."""
    return [f"Write a long story about {TOPICS[(repeat * count + i) % len(TOPICS)]}, part {repeat * count + i}."
            for i in range(count)]


def rate(stamps: list[float]) -> float | None:
    """Tokens per second from the first token to the last: ``(n - 1) / (t_last - t_first)``."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None


def _engine_config(args):
    from engine import EngineConfig
    return EngineConfig(dtype=args.dtype, speculative="off", kv_cache_tokens=8192)


def _encode(tokenizer, text: str) -> list[int]:
    from engine.tokenizer import encode_chat
    return encode_chat(tokenizer, [{"role": "user", "content": text}])


def side_engine(args, texts: list[str]) -> list[float | None]:
    from engine import LLMEngine, SamplingParams

    eng = LLMEngine(_engine_config(args))
    try:
        eng.generate([_encode(eng.tokenizer, "Hello.")], SamplingParams(max_tokens=4, temperature=0))
        rates = []
        for text in texts:
            eng.add_request(_encode(eng.tokenizer, text), SamplingParams(max_tokens=args.tokens, temperature=0,
                                                                          ignore_eos=True))
            stamps: list[float] = []
            while eng.has_unfinished():
                for out in eng.step():
                    stamps += [time.perf_counter()] * len(out.token_ids)
            rates.append(rate(stamps))
        return rates
    finally:
        eng.close()


def side_async(args, texts: list[str]) -> list[float | None]:
    from engine import AsyncEngine, SamplingParams

    async def run() -> list[float | None]:
        ae = AsyncEngine.from_config(_engine_config(args))
        try:
            tok = ae.engine.tokenizer
            async for _ in ae.submit(_encode(tok, "Hello."), SamplingParams(max_tokens=4, temperature=0)):
                pass
            rates = []
            for text in texts:
                stamps: list[float] = []
                params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
                async for out in ae.submit(_encode(tok, text), params):
                    stamps += [time.perf_counter()] * len(out.token_ids)
                rates.append(rate(stamps))
            return rates
        finally:
            await ae.shutdown()

    return asyncio.run(run())


def side_http(args, texts: list[str], run: harness.Run | None) -> list[float | None]:
    import httpx
    from httpx_sse import connect_sse

    from agentrt.procs import Procs

    flags = ["--speculative", "off", "--dtype", args.dtype, "--log-level", "warning"]
    procs = Procs(args.log_dir, cwd=ROOT)
    try:
        server = procs.agentrt("decode-path-http", "serve", *flags).wait_ready(600.0)
        if run is not None and not run.servers:
            run.add_server("agentrt serve", ["agentrt", "serve", *flags], harness.non_default_flags(flags))
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]

            def stream(text: str, n: int) -> list[float]:
                body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n,
                        "temperature": 0, "stream": True, "ignore_eos": True}
                stamps: list[float] = []
                with connect_sse(http, "POST", "/v1/chat/completions", json=body) as events:
                    if events.response.status_code != 200:
                        raise SystemExit(f"agentrt serve answered {events.response.status_code}: "
                                         f"{events.response.read()[:300]!r}")
                    for event in events.iter_sse():
                        if event.data == "[DONE]":
                            break
                        chunk = json.loads(event.data)
                        if "error" in chunk:
                            raise SystemExit(f"agentrt serve failed the request: {chunk['error']}")
                        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                            stamps.append(time.perf_counter())
                return stamps

            stream("Hello.", 4)
            return [rate(stream(text, args.tokens)) for text in texts]
    finally:
        procs.stop()


def run_side_process(args, side: str, repeat: int) -> list[float | None]:
    """Run ``side`` in a fresh Python process (one OpenMP thread team per process) and read its rates."""
    cmd = [sys.executable, __file__, "--side", side, "--repeat", str(repeat), "--tokens", str(args.tokens),
           "--prompts", str(args.prompts), "--dtype", args.dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"side {side} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["rates"]


def summarize(rates: dict[str, list[list[float | None]]]) -> dict:
    """Per side: per-run medians with their median and range; ms per token and what each layer adds."""
    sides = {}
    for side, runs in rates.items():
        medians = [statistics.median([r for r in run if r is not None]) if any(r is not None for r in run) else None
                   for run in runs]
        sides[side] = {"tok_s": harness.spread(medians), "per_prompt": runs}
    ms = {side: (1000.0 / s["tok_s"]["median"] if s["tok_s"]["median"] else None) for side, s in sides.items()}
    added = {}
    for lower, upper in (("engine", "async"), ("async", "http"), ("engine", "http")):
        if ms.get(lower) is not None and ms.get(upper) is not None:
            added[f"{upper}_over_{lower}"] = ms[upper] - ms[lower]
    return {"sides": sides, "ms_per_token": ms, "ms_added": added}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens each decode run generates (ignore_eos)")
    p.add_argument("--prompts", type=int, default=3, help="decode runs per side and repeat, each its own prompt")
    p.add_argument("--dtype", default="auto", help="engine dtype on every side (auto: what agentrt serve picks)")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="the sides to run")
    p.add_argument("--log-dir", default=None, help="where the http side's server log goes (default: a temp dir)")
    p.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)     # one side, in a child
    p.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    harness.add_common_args(p, repeats=1)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.prompts < 1:
        p.error("--tokens must be >= 2 and --prompts >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.side is not None:   # a child: one side, its rates on the last line of stdout
        texts = prompts(args.repeat, args.prompts)
        fn = {"engine": side_engine, "async": side_async}.get(args.side)
        rates = fn(args, texts) if fn else side_http(args, texts, None)
        print(json.dumps({"rates": rates}))
        return 0
    run = harness.Run(args, __file__, argv)
    rates: dict[str, list] = {side: [] for side in args.sides}
    for repeat, side in harness.ab_order(args.sides, args.repeats, args.order):
        if side == "http":
            got = side_http(args, prompts(repeat, args.prompts), run)
        else:
            got = run_side_process(args, side, repeat)
        rates[side].append(got)
        print(f"repeat {repeat} {side}: " + ", ".join(f"{r:.1f}" if r else "-" for r in got) + " tok/s", flush=True)
    body = summarize(rates)
    body["workload"] = {"tokens": args.tokens, "prompts": args.prompts, "temperature": 0.0, "ignore_eos": True,
                        "speculative": "off"}
    print(json.dumps({k: body[k] for k in ("ms_per_token", "ms_added")}, indent=2))
    run.write(body, settings=harness.serve_settings(["--speculative", "off", "--dtype", args.dtype]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
