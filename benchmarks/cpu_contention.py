"""Batch-1 decode while something else runs on the same CPU: how each OpenMP wait policy holds up.

    python benchmarks/cpu_contention.py --repeats 2 --json OUT
    python benchmarks/cpu_contention.py --llama-server out/llamacpp/build/bin/llama-server --json OUT

An agent's tools (a compiler, a test run, a linter) often run on the machine that serves its model. Torch
runs its parallel operations on an OpenMP team (libgomp); between operations its idle workers spin
(libgomp's default: ``GOMP_SPINCOUNT`` 300,000 turns, then sleep) or sleep at once (``OMP_WAIT_POLICY=
PASSIVE``). On an idle machine spinning wins (a sleeping worker's wake-up costs every parallel region
of a step); on a busy one a spinning worker holds a core that the worker it waits for, or the other
process, needs. Measured on 2 cores (docs/benchmarking.md, "Beside a busy process"): neither wins both.

Sides, each on a fresh ``agentrt serve --speculative off`` (a warm-up request first, then ``--decode-runs``
batch-1 decode runs of ``--decode-tokens`` tokens, each its own prompt, the same on every side):

- ``spin``: ``GOMP_SPINCOUNT=300000``, libgomp's own default, named (agentrt then sets no wait policy);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE``;
- ``spin_N`` for each ``--spincount N``: workers that spin N turns, then sleep;
- ``llama_server`` with ``--llama-server PATH``: the peer, its own thread pool, defaults.

Conditions: ``quiet``, and ``busy``: ``--busy N`` processes (default 1, one of two cores) each running a
pure-Python loop for the length of the side's decode runs, started after the server answered and stopped
before it is. Sides run in alternating order within each condition (``harness.ab_order``). Rates are
``(tokens - 1) / (last token - first token)`` at the client; the JSON has per condition and side the
per-run rates with their median and range, and ``busy / quiet`` per side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402
from benchmarks.vs_llamacpp import CPU_TARGETS, DECODE_SUBJECTS, decode_prompts, drive, serve  # noqa: E402

CONDITIONS = ("quiet", "busy")
POLICY_ENV = {"spin": {"GOMP_SPINCOUNT": "300000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
BURNER = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def policies(args) -> dict[str, dict[str, str]]:
    """Each agentrt side's OpenMP environment."""
    return {**POLICY_ENV, **{f"spin_{n}": {"GOMP_SPINCOUNT": str(n)} for n in args.spincount}}


def side_command(side: str, args) -> list[str]:
    """The server command of ``side`` (``{port}`` filled in at start), its wait policy set by ``env``."""
    if side == "llama_server":
        from engine.loader import resolve_model
        return [args.llama_server, "-m", resolve_model(None)[0], "--port", "{port}", "-np", "1", "-c", "8192"]
    clear = [f"-u{name}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]
    setting = [f"{k}={v}" for k, v in policies(args)[side].items()]
    return ["env", *clear, *setting, sys.executable, "-m", "agentrt_cli", "serve", "--port", "{port}",
            "--speculative", "off"]


def decode_under(url: str, condition: str, args, prompts: list[str]) -> dict:
    """The side's decode runs at ``url``, with ``--busy`` burners running through them when ``busy``."""
    burners = []
    if condition == "busy":
        code = BURNER.format(seconds=args.burn_limit_s)
        burners = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(args.busy)]
    try:
        ns = argparse.Namespace(decode_tokens=args.decode_tokens, reply_tokens=1, concurrency=1)
        return asyncio.run(drive(url, "", None, ns, prompts))
    finally:
        for b in burners:
            b.kill()
            b.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_args(p)
    p.add_argument("--decode-tokens", type=int, default=256, help="tokens of each decode run (ignore_eos)")
    p.add_argument("--decode-runs", type=int, default=2, help="decode runs per side and condition, each its own prompt")
    p.add_argument("--busy", type=int, default=1, help="busy processes in the busy condition")
    p.add_argument("--burn-limit-s", type=float, default=600.0, help="a burner's longest life (a safety stop)")
    p.add_argument("--cpu", choices=tuple(CPU_TARGETS), default="native",
                   help="native, or x86-64-v3: agentrt's kernels and torch held to AVX2 (as vs_llamacpp.py)")
    p.add_argument("--llama-server", default=None, help="a llama-server binary: add it as a side")
    p.add_argument("--spincount", type=int, action="append", default=[],
                   help="add an agentrt side whose workers spin this many turns, then sleep (repeatable)")
    args = p.parse_args(argv)
    if any(n < 0 for n in args.spincount):
        p.error("--spincount must be >= 0")
    for name in ("decode_tokens", "decode_runs", "busy"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.repeats * len(CONDITIONS) * args.decode_runs > len(DECODE_SUBJECTS):
        p.error(f"--repeats x 2 x --decode-runs must be <= {len(DECODE_SUBJECTS)} (each decode run its own prompt)")
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        p.error(f"--llama-server {args.llama_server}: not an executable file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(CPU_TARGETS[args.cpu][0])
    run = harness.Run(args, __file__, argv)
    env = policies(args)
    sides = [*env, *(["llama_server"] if args.llama_server else [])]
    cmds = {side: side_command(side, args) for side in sides}
    for side, cmd in cmds.items():
        run.add_server(side, cmd, {"env": env.get(side, {})})
    rates: dict[str, dict[str, list[float]]] = {c: {s: [] for s in sides} for c in CONDITIONS}
    for r in range(args.repeats):
        for c, condition in enumerate(CONDITIONS):
            block = r * len(CONDITIONS) + c        # its own prompts; sides reversed every other block
            prompts = decode_prompts(block, args.decode_runs)
            for _, side in (x for x in harness.ab_order(sides, block + 1, args.order) if x[0] == block):
                result, _ = serve(side, cmds[side], lambda url: decode_under(url, condition, args, prompts))
                rates[condition][side].extend(result["decode_tok_s_b1_runs"])
                print(f"  repeat {r} {condition:5s} {side:12s} "
                      f"{' '.join(f'{x:.1f}' for x in result['decode_tok_s_b1_runs'])} tok/s", flush=True)
    figures = {c: {s: harness.spread(v) for s, v in by_side.items()} for c, by_side in rates.items()}
    busy_over_quiet = {s: (figures["busy"][s]["median"] / figures["quiet"][s]["median"]
                           if figures["quiet"][s]["median"] else None) for s in sides}
    for c in CONDITIONS:
        print(f"{c:5s} " + "  ".join(f"{s} {figures[c][s]['median']:.1f}" for s in sides))
    print("busy / quiet: " + "  ".join(f"{s} {v:.2f}" for s, v in busy_over_quiet.items() if v is not None))
    run.write({"figures": figures, "busy_over_quiet": busy_over_quiet, "policy_env": env,
               "busy_processes": args.busy, "decode_tokens": args.decode_tokens, "cpu_target": args.cpu})
    return 0


if __name__ == "__main__":
    sys.exit(main())
