"""An engine's start: the GGUF's blocks decoded in C (engine/loader/csrc/gguf_dequant.c) against numpy, a
served GGUF model's load with and without the dense copies of its block layers, or a first start's kernel
builds with and without decode attention's 16 int8 loop nests.

    python benchmarks/engine_start.py --json OUT
    python benchmarks/engine_start.py --compare dense-load --json OUT
    python benchmarks/engine_start.py --compare first-start --json OUT

Each start is a fresh Python process (``python benchmarks/engine_start.py --child SIDE``) that imports
torch, then times ``LLMEngine(EngineConfig(...))`` on the default model (or ``--model``): loading the
GGUF (its metadata, its blocks decoded to float32), building the model, the KV pool and the rest. Two
sides, the same work, in ABBA order over ``--repeats``:

- ``numpy``: ``engine.loader.gguf_file.dequantize`` with the C decoder turned off (``dequantize_numpy``);
- ``c``: the C decoder (built and loaded before the clock starts: its build is cached on disk).

Both decode to the same float32 values bit for bit (tests/engine/test_gguf_dequant.py).

``--compare dense-load``: the engine a server builds (``dtype="auto"``), where it serves the GGUF's blocks, two sides:

- ``dense``: every layer weight decoded to float32, loaded into the model, dropped after the build (the build
  before engine/builder.py ``_blocks_only``);
- ``blocks``: as built now: where the prefill pick says blocks, the block layers' dense weights are not decoded.

Each child also reports its peak RSS and whether its load skipped the dense weights (``blocks_only``: false on
both sides where this machine's pick runs prefill on the dense weights, and then there is nothing to compare).
The tokens are the same (tests/engine/test_model_build.py).

``--compare first-start``: the same served engine's first start on a machine, every start with an empty kernel
cache of its own (``AGENTRT_KERNEL_CACHE``, a new temporary folder): the C kernels are compiled and the
picks measured inside the timed build, as on a fresh machine. Two sides:

- ``all-nests``: decode attention built with all 16 int8 loop nests (the build before
  ``engine.attention.cpu_kernel.i8_case_flags``);
- ``own-nest``: as built now: the pool's own nest, none for a float pool (this engine's).

Both compute the same (tests/engine/test_kv_int8.py); each side's other builds and picks are the same work.

``--threads`` sets the children's ``OMP_NUM_THREADS`` (default 1: what each process of the test suite gets on two
cores); the import of torch is outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

COMPARES = {"dequant": ("numpy", "c"), "dense-load": ("dense", "blocks"), "first-start": ("all-nests", "own-nest")}


def child(side: str, model: str | None, kv_cache_tokens: int) -> None:
    """One start, in this process: prints ``{"build_s", "cpu_s", "peak_rss_mb", "blocks_only"}``."""
    import resource

    import torch  # noqa: F401  (outside the clock, as in every process that builds an engine)

    import engine.builder as builder
    from engine.loader import gguf_file
    if side == "numpy":
        gguf_file._c_dequant = lambda: None
    elif side == "c" and gguf_file._c_dequant() is None:
        raise SystemExit("the C decoder could not be built here (no C compiler?): nothing to compare")
    decide = (lambda *args: False) if side == "dense" else builder._blocks_only
    asked = []

    def blocks_only(*args) -> bool:   # what the load was asked to do, for the record
        asked.append(decide(*args))
        return asked[-1]
    builder._blocks_only = blocks_only
    if side == "all-nests":
        from engine.attention import cpu_kernel
        cpu_kernel.i8_case_flags = lambda i8_shape: ()
    from engine import EngineConfig, LLMEngine
    served = side in COMPARES["dense-load"] + COMPARES["first-start"]
    t, c = time.perf_counter(), time.process_time()
    LLMEngine(EngineConfig(model=model, kv_cache_tokens=kv_cache_tokens, **({"dtype": "auto"} if served else {})))
    build_s, cpu_s = time.perf_counter() - t, time.process_time() - c
    print(json.dumps({"build_s": build_s, "cpu_s": cpu_s, "blocks_only": bool(asked and asked[0]),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384,
                        help="the engine's KV pool in tokens (default 16384, the test suite's servers')")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each start (default 1)")
    parser.add_argument("--compare", choices=tuple(COMPARES), default="dequant",
                        help="dequant: the C block decoder against numpy (default); dense-load: a served model's "
                             "load with and without its block layers' dense weights; first-start: a served "
                             "model's start on an empty kernel cache, decode attention with all 16 int8 loop "
                             "nests or its own")
    parser.add_argument("--child", choices=[s for sides in COMPARES.values() for s in sides],
                        help=argparse.SUPPRESS)   # internal: one start, in this process
    harness.add_common_args(parser, repeats=6)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.kv_cache_tokens)
        return None
    if args.threads < 1 or args.kv_cache_tokens < 1:
        parser.error("--threads and --kv-cache-tokens must be >= 1")
    run = harness.Run(args, __file__, argv)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    sides = COMPARES[args.compare]
    cold = args.compare == "first-start"
    for side in () if cold else sides:   # builds the kernels and measures the picks once, outside the timed starts
        subprocess.run([*cmd, "--child", side], env=env, check=True, capture_output=True)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for _, side in harness.ab_order(sides, args.repeats, args.order):
        with tempfile.TemporaryDirectory(prefix="agentrt-kernels-") as cache:
            start_env = {**env, "AGENTRT_KERNEL_CACHE": cache} if cold else env
            out = subprocess.run([*cmd, "--child", side], env=start_env, check=True, capture_output=True, text=True)
        runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    build = {s: harness.spread(r["build_s"] for r in runs[s]) for s in sides}
    cpu = {s: harness.spread(r["cpu_s"] for r in runs[s]) for s in sides}
    rss = {s: harness.spread(r["peak_rss_mb"] for r in runs[s]) for s in sides}
    old, new = sides
    ratio = f"{old}_over_{new}"
    body = {"workload": {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "compare": args.compare,
                         "kv_cache_tokens": args.kv_cache_tokens, "threads": args.threads,
                         "kernel_cache": "empty, one per start" if cold else "warm (built before the timed starts)"},
            "build_s": build, "cpu_s": cpu, "peak_rss_mb": rss,
            "blocks_only": {s: sorted({r["blocks_only"] for r in runs[s]}) for s in sides},
            ratio: build[old]["median"] / build[new]["median"]}
    print(f"engine build at {args.threads} thread(s): {old} {build[old]['median']:.3f} s, {new} "
          f"{build[new]['median']:.3f} s ({body[ratio]:.2f}x); peak RSS {rss[old]['median']:.0f} -> "
          f"{rss[new]['median']:.0f} MB")
    return run.write(body)


if __name__ == "__main__":
    main()
