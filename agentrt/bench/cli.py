"""``agentrt bench``: flags, then :func:`agentrt.bench.run_bench` or the ablation ladder."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes numbers separated by commas, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be positive session arrivals per second, got {text!r}")
    return rates


def configure(p: argparse.ArgumentParser) -> None:
    from agentrt.bench.workload import PRESETS

    g = p.add_argument_group("target and workload")
    g.add_argument("--target", default=None, help="OpenAI-compatible base URL (ours, a router or a peer)")
    g.add_argument("--preset", default="swe", choices=sorted(PRESETS), help="agentic workload preset")
    g.add_argument("--sessions", type=int, default=None,
                   help="sessions (trace: records) to run (default: the preset's, sized for a few CPU minutes; trace: 8)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated workload (same seed, same text)")
    g.add_argument("--rates", type=_rates, default=(), metavar="A,B,C",
                   help="session arrivals/s to sweep (default: the preset's rate); reports the best that meets the SLO")
    g.add_argument("--max-turns", type=int, default=None, help="cap calls per session")
    g.add_argument("--max-reply-tokens", type=int, default=None, help="cap each reply's max_tokens")
    g.add_argument("--think-scale", type=float, default=None, help="multiply tool/think pauses (0 = none)")
    g.add_argument("--trace", default=None, help="replay a Mooncake-format JSONL trace instead of a preset")
    g.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per trace hash id (512 = as traced)")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="multiply trace timestamps")
    g.add_argument("--api", choices=("chat", "sessions"), default="chat",
                   help="chat: /v1/chat/completions with the full history; sessions: agentrt's session API")
    g.add_argument("--session-pin-ttl-s", type=float, default=None, help="sessions API: pin TTL asked per session")
    g.add_argument("--model", default=None, help="model name to send (default: the target's first /v1/models)")
    g.add_argument("--api-key", default=None, help="API key sent to the server under test")
    g.add_argument("--tokenizer", default=None, help="GGUF whose tokenizer sizes the text (default model if unset)")
    b = p.add_argument_group("bounding the run")
    b.add_argument("--duration", type=float, default=None, metavar="S",
                   help="start no session or turn after S seconds; the figures cover the turns that completed")
    b.add_argument("--grace", type=float, default=15.0, metavar="S",
                   help="with --duration: cut turns still running at duration + S seconds (default 15)")
    b.add_argument("--no-estimate", action="store_true",
                   help="skip the probe request and the planned-volume/estimate lines printed at start")
    s = p.add_argument_group("figures")
    s.add_argument("--slo-ttft-s", type=float, default=2.0, help="SLO bound on time to first token")
    s.add_argument("--slo-tpot-s", type=float, default=0.25, help="SLO bound on time per output token")
    s.add_argument("--slo-attainment", type=float, default=0.9, help="share of calls that must meet the SLO")
    s.add_argument("--workers", type=int, default=1, help="workers behind the target (per-worker and cost figures)")
    s.add_argument("--price-per-worker-hour", type=float, default=None, help="dollars per worker-hour, for cost")
    s.add_argument("--metrics-url", action="append", default=None,
                   help="scrape this server's /metrics before and after (repeatable; default: the target)")
    s.add_argument("--no-metrics", action="store_true", help="scrape no /metrics")
    s.add_argument("--flush-url", action="append", default=[], help="POST <url>/flush_cache before each run")
    s.add_argument("--json", dest="json_out", default=None, help="write the result as JSON here")
    s.add_argument("--report", default=None, help="Markdown report (default: beside --json, .md); PNGs beside it")
    s.add_argument("--no-progress", action="store_true",
                   help="draw no progress bar (bars go to stderr and only when it is a terminal)")
    a = p.add_argument_group("ablation (--ablate starts its own deployments; --target is not used)")
    a.add_argument("--ablate", action="store_true", help="run the component ladder on local deployments")
    a.add_argument("--ablate-workers", type=int, default=2, help="workers in each deployment")
    a.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool per worker, tokens")
    a.add_argument("--model-path", default=None, help="model the deployments serve (default: the default model)")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per worker (MoE placement rungs)")
    a.add_argument("--steps", default=None, help="comma-separated ladder step names to run (default: all)")


def _options(args: argparse.Namespace):
    from agentrt.bench.bench import BenchOptions
    from agentrt.bench.summary import SLO

    metrics = () if args.no_metrics else (tuple(args.metrics_url) if args.metrics_url else None)
    return BenchOptions(
        target=(args.target or "http://unused").rstrip("/"), preset=args.preset, sessions=args.sessions,
        seed=args.seed, rates=args.rates, max_turns=args.max_turns, max_reply_tokens=args.max_reply_tokens,
        think_scale=args.think_scale, trace=args.trace, trace_block_tokens=args.trace_block_tokens,
        trace_time_scale=args.trace_time_scale, api=args.api, model=args.model, api_key=args.api_key,
        tokenizer=args.tokenizer, slo=SLO(args.slo_ttft_s, args.slo_tpot_s, args.slo_attainment),
        workers=args.workers, price_per_worker_hour=args.price_per_worker_hour, metrics_urls=metrics,
        flush_urls=tuple(args.flush_url), session_pin_ttl_s=args.session_pin_ttl_s, progress=not args.no_progress,
        duration_s=args.duration, grace_s=args.grace, estimate=not args.no_estimate)


def run(args: argparse.Namespace) -> int:
    from agentrt.bench.bench import run_bench
    from agentrt.bench.report import write_json, write_report

    if not args.ablate and not args.target:
        print("agentrt bench: --target URL is required (or --ablate to start local deployments)", file=sys.stderr)
        return 2
    try:
        opts = _options(args)
    except ValueError as exc:
        print(f"agentrt bench: {exc}", file=sys.stderr)
        return 2
    command = "agentrt bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else None
    md = args.report or (str(Path(args.json_out).with_suffix(".md")) if args.json_out else None)
    try:
        if args.ablate:
            from agentrt.bench.ablation import AblationOptions, run_ablation, write_ablation

            aopts = AblationOptions(workers=args.ablate_workers, kv_cache_tokens=args.kv_cache_tokens,
                                    model=args.model_path, ep=args.ep,
                                    steps=tuple(args.steps.split(",")) if args.steps else None)
            result = run_ablation(opts, aopts)
            if args.json_out:
                write_json(result, args.json_out)
            write_ablation(result, md, command)
            return 0
        result = run_bench(opts)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"agentrt bench: {exc}", file=sys.stderr)
        return 1
    if args.json_out:
        write_json(result, args.json_out)
    if md:
        write_report(result, md, command=command)
    from agentrt.bench.report import bounded_lines, run_table

    print("\n".join(run_table(result["runs"]) + bounded_lines(result["runs"])))
    if opts.rates:
        print(f"highest rate meeting the SLO: {result['best_rate']}")
    return 0
