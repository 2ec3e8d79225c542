"""A GGUF tensor's blocks decoded to float32: engine/loader/csrc/gguf_dequant.c against numpy, per block type.

    python benchmarks/gguf_dequant.py --json OUT

What loading a GGUF file costs per weight matrix, by block type: for each of ``--types``, a
``--rows`` x ``--cols`` tensor of random blocks (finite float16 scales; the default shape is one
4,096 x 4,096 projection of an 8B model), decoded by the two sides on the same bytes in ABBA order over
``--repeats``, ``--calls`` decodes a side a block:

- ``numpy``: ``engine.loader.gguf_file.dequantize_numpy`` (its own numpy code for Q4_0 / Q4_1 / Q8_0,
  gguf-py's ``gguf.quants.dequantize`` for the K types);
- ``c``: ``dequantize`` through the C decoder (torch's threads: ``torch.set_num_threads(--threads)``).

``same_output``: the two sides' float32 bits equal, per type (tests/engine/test_gguf_dequant.py checks
it too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = ("numpy", "c")
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SCALES_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_tensor(name: str, rows: int, cols: int, seed: int):
    """A tensor of random ``name`` blocks whose float16 scales are finite (random bytes would hold NaNs)."""
    import numpy as np

    from engine.loader.gguf_file import GGML_TYPES, GGUFTensor
    ggml_type = TYPES[name]
    _, per, size = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in SCALES_AT[name]:
        raw[:, at:at + 2] = rng.normal(0, 0.05, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return GGUFTensor(name, (cols, rows), ggml_type, 0, raw.size, raw.reshape(-1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    parser.add_argument("--rows", type=int, default=4096, help="the tensor's rows (default 4096)")
    parser.add_argument("--cols", type=int, default=4096, help="its columns, a multiple of 256 (default 4096)")
    parser.add_argument("--calls", type=int, default=3, help="decodes a side makes a block (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the C side (default 2)")
    harness.add_common_args(parser, repeats=4)
    args = parser.parse_args(argv)
    types = [t for t in args.types.split(",") if t]
    unknown = sorted(set(types) - set(TYPES))
    if unknown or not types:
        parser.error(f"--types: unknown {unknown}; choose from {', '.join(TYPES)}")
    if args.cols % 256 or min(args.rows, args.cols, args.calls, args.threads) < 1:
        parser.error("--cols must be a multiple of 256; --rows, --calls and --threads >= 1")

    import torch

    from engine.loader.gguf_file import _c_dequant, dequantize, dequantize_numpy
    torch.set_num_threads(args.threads)
    if _c_dequant() is None:
        raise SystemExit("the C decoder could not be built here (no C compiler?): nothing to compare")
    run = harness.Run(args, __file__, argv)
    sides = {"numpy": dequantize_numpy, "c": dequantize}
    body: dict = {"workload": {"rows": args.rows, "cols": args.cols, "calls_per_block": args.calls,
                               "threads_c": args.threads}, "types": {}}
    for i, name in enumerate(types):
        t = random_tensor(name, args.rows, args.cols, seed=i)
        same = torch.equal(sides["numpy"](t).view(torch.int32), sides["c"](t).view(torch.int32))
        blocks: dict[str, list[float]] = {s: [] for s in SIDES}
        for _, side in harness.ab_order(SIDES, args.repeats, args.order):
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                sides[side](t)
                times.append((time.perf_counter() - t0) * 1000)
            blocks[side].append(statistics.median(times))
        ms = {s: harness.spread(v) for s, v in blocks.items()}
        body["types"][name] = {"decode_ms": ms, "numpy_over_c": ms["numpy"]["median"] / ms["c"]["median"],
                               "same_output": bool(same)}
        print(f"{name}: numpy {ms['numpy']['median']:.1f} ms, C {ms['c']['median']:.1f} ms "
              f"({body['types'][name]['numpy_over_c']:.1f}x); same output: {same}", flush=True)
    return run.write(body)


if __name__ == "__main__":
    main()
