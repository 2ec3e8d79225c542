"""An engine's start: the GGUF's blocks decoded in C (engine/loader/csrc/gguf_dequant.c) against numpy.

    python benchmarks/engine_start.py --json OUT

Each start is a fresh Python process (``python benchmarks/engine_start.py --child SIDE``) that imports
torch, then times ``LLMEngine(EngineConfig(...))`` on the default model (or ``--model``): loading the
GGUF (its metadata, its blocks decoded to float32), building the model, the KV pool and the rest. Two
sides, the same work, in ABBA order over ``--repeats``:

- ``numpy``: ``engine.loader.gguf_file.dequantize`` with the C decoder turned off (``dequantize_numpy``);
- ``c``: the C decoder (built and loaded before the clock starts: its build is cached on disk).

Both decode to the same float32 values bit for bit (tests/engine/test_gguf_dequant.py). ``--threads``
sets the children's ``OMP_NUM_THREADS`` (default 1: what each process of the test suite gets on two
cores); the import of torch is outside the timed part.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = ("numpy", "c")


def child(side: str, model: str | None, kv_cache_tokens: int) -> None:
    """One start, in this process: prints ``{"build_s", "cpu_s"}``."""
    import torch  # noqa: F401  (outside the clock, as in every process that builds an engine)

    from engine.loader import gguf_file
    if side == "numpy":
        gguf_file._c_dequant = lambda: None
    elif gguf_file._c_dequant() is None:
        raise SystemExit("the C decoder could not be built here (no C compiler?): nothing to compare")
    from engine import EngineConfig, LLMEngine
    t, c = time.perf_counter(), time.process_time()
    LLMEngine(EngineConfig(model=model, kv_cache_tokens=kv_cache_tokens))
    print(json.dumps({"build_s": time.perf_counter() - t, "cpu_s": time.process_time() - c}))


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--kv-cache-tokens", type=int, default=16384,
                        help="the engine's KV pool in tokens (default 16384, the test suite's servers')")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each start (default 1)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)   # internal: one start, in this process
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
    subprocess.run([*cmd, "--child", "c"], env=env, check=True, capture_output=True)   # builds the kernels once
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for _, side in harness.ab_order(SIDES, args.repeats, args.order):
        out = subprocess.run([*cmd, "--child", side], env=env, check=True, capture_output=True, text=True)
        runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    build = {s: harness.spread(r["build_s"] for r in runs[s]) for s in SIDES}
    cpu = {s: harness.spread(r["cpu_s"] for r in runs[s]) for s in SIDES}
    body = {"workload": {"model": args.model or "SmolLM2-135M-Instruct (embedded)",
                         "kv_cache_tokens": args.kv_cache_tokens, "threads": args.threads},
            "build_s": build, "cpu_s": cpu,
            "numpy_over_c": build["numpy"]["median"] / build["c"]["median"]}
    print(f"engine build at {args.threads} thread(s): numpy {build['numpy']['median']:.3f} s, "
          f"C {build['c']['median']:.3f} s ({body['numpy_over_c']:.2f}x)")
    return run.write(body)


if __name__ == "__main__":
    main()
