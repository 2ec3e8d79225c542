"""One agent workload through every API surface of one server: TTFT and cache reuse per surface.

    python benchmarks/protocols.py --json out/protocols.json            # starts agentrt serve
    python benchmarks/protocols.py --url http://127.0.0.1:8000 --quick  # against a running server

The workload is the engine benchmark's (``benchmarks/workload.py``): S conversations share a
long system prompt; every turn appends a ~200-token tool result and asks for a short reply at
temperature 0; conversations run concurrently, turns one after another. It runs four times, one
surface after the other, each as its clients use it:

* ``chat``: Chat Completions, the client resending the whole history every turn (with
  ``prompt_cache_key``, which keeps the conversation on one worker behind a router and makes
  each call a pinned turn, ``--affinity-turns``);
* ``responses``: the Responses API, each turn continuing ``previous_response_id``;
* ``messages``: the Anthropic Messages API, the client resending the history (with the
  ``X-Claude-Code-Session-Id`` header Claude Code sends, an affinity key as above);
* ``sessions``: agentrt's session API, the server keeping the history.

Same work on every surface: one seed (``--seed``: the same system prompt, tool results and sampling
seed) and ``ignore_eos`` on every request, so every surface generates exactly ``--reply-tokens`` a
turn. Each surface runs on a fresh server this script starts (so no surface reads another's
conversations from the cache), which gets one warm-up request first; surfaces run in alternating
order over ``--repeats`` (forward, then reversed: never always ``sessions`` first). Against a
running server (``--url``) the surfaces share it, so each gets its own seed instead
(``seeds`` in the JSON) and the figures are not a headline. TTFT is measured at the client, from
sending the turn to the first streamed text. The figure to compare is TTFT p50 on turns 2+ of
each surface against the session API's (the target: within 1.15x), the median over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
from httpx_sse import EventSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrt.bench.text import system_prompt  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.api_sessions import load_tokenizer, percentile  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402

SURFACES = ("sessions", "chat", "responses", "messages")
TARGET_RATIO = 1.15
SAME = {"ignore_eos": True, "seed": 0}   # on every surface's requests: replies of exactly max tokens


async def _sse(http: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None) -> Any:
    """``(event name, data)`` of each server-sent event of a streamed POST (``[DONE]`` ends it)."""
    async with http.stream("POST", path, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"{path}: {resp.status_code} {resp.text[:300]}")
        async for event in EventSource(resp).aiter_sse():
            if event.data == "[DONE]":
                return
            yield event.event, json.loads(event.data)


class Turn:
    """One measured turn: TTFT at the first text, token counts from the surface's usage."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.text: list[str] = []
        self.prompt = self.cached = self.completion = 0

    def got(self, text: str) -> None:
        if text and self.first is None:
            self.first = time.perf_counter()
        self.text.append(text)

    def record(self, s: int, t: int) -> dict:
        end = time.perf_counter()
        return {"conversation": s, "turn": t, "ttft_s": (self.first or end) - self.start,
                "latency_s": end - self.start, "prompt_tokens": self.prompt, "cached_tokens": self.cached,
                "completion_tokens": self.completion}


def _text(messages: list[dict]) -> str:
    return "\n".join(m["content"] for m in messages)


async def chat(http, wl, tok, system, s, model, records) -> None:
    history = [{"role": "system", "content": system}]
    for t in range(wl.turns):
        history += wl.turn_messages(tok, s, t)
        turn = Turn()
        body = {"model": model, "messages": history, "max_tokens": wl.reply_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "prompt_cache_key": f"bench-{wl.seed}-{s}",
                **SAME}
        async for _, d in _sse(http, "/v1/chat/completions", body):
            if d.get("choices"):
                turn.got(d["choices"][0]["delta"].get("content") or "")
            if d.get("usage"):
                u = d["usage"]
                turn.prompt, turn.completion = u["prompt_tokens"], u["completion_tokens"]
                turn.cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        history.append({"role": "assistant", "content": "".join(turn.text)})
        records.append(turn.record(s, t))


async def responses(http, wl, tok, system, s, model, records) -> None:
    previous = None
    for t in range(wl.turns):
        turn = Turn()
        body = {"model": model, "instructions": system, "input": wl.turn_messages(tok, s, t),
                "max_output_tokens": wl.reply_tokens, "temperature": 0, "stream": True, **SAME,
                **({"previous_response_id": previous} if previous else {})}
        async for name, d in _sse(http, "/v1/responses", body):
            if name == "response.output_text.delta":
                turn.got(d["delta"])
            elif name in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
                previous, u = d["response"]["id"], d["response"]["usage"]
                turn.prompt, turn.completion = u["input_tokens"], u["output_tokens"]
                turn.cached = u["input_tokens_details"]["cached_tokens"]
        records.append(turn.record(s, t))


async def messages(http, wl, tok, system, s, model, records) -> None:
    history: list[dict] = []
    for t in range(wl.turns):
        history.append({"role": "user", "content": _text(wl.turn_messages(tok, s, t))})
        turn = Turn()
        body = {"model": model, "system": system, "messages": history, "max_tokens": wl.reply_tokens,
                "temperature": 0, "stream": True, **SAME}
        # the conversation named as Claude Code names it (agentrt/core/affinity.py)
        async for name, d in _sse(http, "/v1/messages", body, {"x-claude-code-session-id": f"bench-{wl.seed}-{s}"}):
            if name == "content_block_delta" and d["delta"].get("type") == "text_delta":
                turn.got(d["delta"]["text"])
            elif name == "message_start":
                u = d["message"]["usage"]  # Anthropic's input_tokens exclude the tokens read from cache
                turn.cached = u.get("cache_read_input_tokens") or 0
                turn.prompt = u["input_tokens"] + turn.cached
            elif name == "message_delta":
                turn.completion = d["usage"]["output_tokens"]
        history.append({"role": "assistant", "content": "".join(turn.text)})
        records.append(turn.record(s, t))


async def sessions(http, wl, tok, system, s, model, records) -> None:
    created = (await http.post("/v1/sessions", json={
        "model": model, "system": system, "sampling": {"temperature": 0, "max_tokens": wl.reply_tokens, **SAME}})).json()
    sid = created["id"]
    try:
        for t in range(wl.turns):
            turn = Turn()
            async for _, d in _sse(http, f"/v1/sessions/{sid}/turns",
                                   {"messages": wl.turn_messages(tok, s, t), "stream": True}):
                if d.get("type") == "turn.delta":
                    turn.got(d["content"])
                elif d.get("type") == "turn.completed":
                    u = d["turn"]["usage"]
                    turn.prompt, turn.cached, turn.completion = (u["prompt_tokens"], u["cached_tokens"],
                                                                 u["completion_tokens"])
            records.append(turn.record(s, t))
    finally:
        await http.delete(f"/v1/sessions/{sid}")


DRIVERS: dict[str, Callable[..., Awaitable[None]]] = {
    "sessions": sessions, "chat": chat, "responses": responses, "messages": messages}


def summarize(records: list[dict], wall_s: float) -> dict:
    later = [r for r in records if r["turn"] > 0]
    return {"wall_s": wall_s,
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in records),
            "ttft_p50_s_turns2plus": statistics.median(r["ttft_s"] for r in later),
            "ttft_p99_s_turns2plus": percentile([r["ttft_s"] for r in later], 99),
            "cached_fraction_turns2plus": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] for r in later)),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "records": records}


async def run_surface(url: str, api_key: str | None, wl: AgenticWorkload, name: str, tok, warm_up: bool) -> dict:
    """One surface's workload against ``url`` (after one warm-up request when the server is fresh)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        if warm_up:
            r = await http.post("/v1/chat/completions", json={"model": model, "max_tokens": 4, "temperature": 0,
                                                              "messages": [{"role": "user", "content": "Hello."}]})
            r.raise_for_status()
        system = system_prompt(tok, wl.system_tokens, seed=wl.seed)
        records: list[dict] = []
        start = time.perf_counter()
        await asyncio.gather(*(DRIVERS[name](http, wl, tok, system, s, model, records) for s in range(wl.sessions)))
        return summarize(records, time.perf_counter() - start)


def run_all(args, run: harness.Run, wl_args: dict, surfaces: list[str], flags: list[str]) -> dict:
    """Every surface ``--repeats`` times in alternating order; a fresh server for each unless ``--url``."""
    tok = load_tokenizer(args.model_path)
    runs: dict[str, list[dict]] = {name: [] for name in surfaces}
    for r, name in harness.ab_order(surfaces, args.repeats, args.order):
        seed = args.seed if args.url is None else args.seed + SURFACES.index(name)
        wl = AgenticWorkload(**wl_args, seed=seed)
        print(f"{name} (repeat {r + 1}) ...", flush=True)
        if args.url is not None:
            runs[name].append(asyncio.run(run_surface(args.url, args.api_key, wl, name, tok, warm_up=False)))
            continue
        from agentrt.procs import Procs
        procs = Procs(prefix="agentrt-protocols-", cwd=Path(__file__).resolve().parents[1])
        try:
            proc = procs.agentrt("serve", "serve", *flags)
            if not run.servers:
                run.add_server("agentrt", proc.cmd,
                               harness.non_default_flags(flags))
            url = proc.wait_ready().url
            runs[name].append(asyncio.run(run_surface(url, args.api_key, wl, name, tok, warm_up=True)))
        finally:
            procs.stop()
    return runs


def summarize_runs(runs: dict[str, list[dict]]) -> dict:
    """Per surface: each run, the median and range of its figures, and TTFT p50 (turns 2+) against
    the session API's in the same repeat."""
    base = runs.get("sessions")
    out = {}
    for name, rs in runs.items():
        ratios = [r["ttft_p50_s_turns2plus"] / b["ttft_p50_s_turns2plus"] for r, b in zip(rs, base)] if base else []
        out[name] = {"runs": rs, "ttft_ratio_vs_sessions": harness.spread(ratios),
                     **{k: harness.spread(r[k] for r in rs) for k in ("ttft_p50_s_turns2plus", "ttft_p99_s_turns2plus",
                                                                      "cached_fraction_turns2plus", "wall_s",
                                                                      "completion_tokens")}}
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start agentrt serve, one per surface run)")
    ap.add_argument("--api-key", default=None, help="bearer token for the server, if it wants one")
    harness.add_common_args(ap, repeats=1)
    ap.add_argument("--sessions", type=int, default=8, help="conversations, run concurrently")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    ap.add_argument("--tool-result-tokens", type=int, default=200, help="tokens of each turn's tool result")
    ap.add_argument("--reply-tokens", type=int, default=32, help="tokens of each reply (ignore_eos: exactly)")
    ap.add_argument("--seed", type=int, default=1, help="workload seed, the same on every surface")
    ap.add_argument("--quick", action="store_true", help="4 conversations x 4 turns")
    ap.add_argument("--surface", action="append", choices=SURFACES, help="only these (repeatable)")
    ap.add_argument("--model-path", default=None, help="GGUF whose tokenizer sizes the text (default model)")
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="extra flag for the server this starts (repeatable, e.g. --serve-flag=--dtype=float32)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sessions, args.turns = 4, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = harness.Run(args, __file__, argv)
    wl_args = {"sessions": args.sessions, "turns": args.turns, "system_tokens": args.system_tokens,
               "tool_result_tokens": args.tool_result_tokens, "reply_tokens": args.reply_tokens}
    surfaces = args.surface or list(SURFACES)
    flags = ["--log-level", "warning", "--kv-cache-tokens", "131072", *args.serve_flag]
    results = summarize_runs(run_all(args, run, wl_args, surfaces, flags if args.url is None else []))
    print(f"\n{'surface':10s} {'TTFT p50 t2+':>13s} {'vs sessions':>12s} {'cached t2+':>11s} {'wall':>8s}  (medians)")
    for name, r in results.items():
        ratio = r["ttft_ratio_vs_sessions"]["median"]
        print(f"{name:10s} {r['ttft_p50_s_turns2plus']['median'] * 1000:10.0f} ms "
              f"{ratio if ratio else float('nan'):11.3f}x {r['cached_fraction_turns2plus']['median']:10.3f} "
              f"{r['wall_s']['median']:7.1f}s")
    seeds = {name: args.seed if args.url is None else args.seed + SURFACES.index(name) for name in surfaces}
    run.write({"workload": wl_args, "seeds": seeds, "same_request_fields": SAME, "fresh_server_per_run": args.url is None,
               "headline": args.url is None, "target_ratio": TARGET_RATIO, "surfaces": results},
              settings=harness.serve_settings(flags) if args.url is None else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
