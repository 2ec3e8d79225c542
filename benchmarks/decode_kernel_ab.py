"""The CPU decode-attention kernel against another version of its source, in one process on the same pages.

    git show b4d1f61:engine/attention/csrc/decode_attention.c > /tmp/base.c
    python benchmarks/decode_kernel_ab.py --base-source /tmp/base.c --json OUT

Two sides, each the C source built by engine/cpu_build.py with this tree's flags and headers
(``AGENTRT_KERNEL_MARCH`` holds both to one ISA, e.g. ``x86-64-v3``):

- ``base``: ``--base-source`` (a file; an older revision of engine/attention/csrc/decode_attention.c);
- ``tree``: this tree's engine/attention/csrc/decode_attention.c: built with every int8 loop nest, as the
  base is, or with ``--tree-build engine`` as the engine builds it for this pool (its pair's nest only, none
  for a float pool: ``engine.attention.cpu_kernel.i8_case_flags``). With this tree's source as the base, that
  measures the engine's build against the full one:

    python benchmarks/decode_kernel_ab.py --base-source engine/attention/csrc/decode_attention.c \
        --tree-build engine --json OUT

The work is one layer's decode call, as a ``b{rows}_ctx{keys}`` step makes it: ``--rows`` rows of
``--keys`` keys each over a pool of ``--kv-dtype`` pages (SmolLM2's 9 query / 3 KV heads of 64, pages of
``--page-size`` in shuffled order, random keys and values written through the pool's own quantizer), the
same query on both sides. Each side makes ``--calls`` calls a block, blocks in ABBA order over
``--repeats``; a block's figure is its median call. ``same_output``: whether the two sides returned the
same tensor, bit for bit (a change that only reorders bookkeeping must keep it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = ("base", "tree")
HQ, HKV, D = 9, 3, 64


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-source", type=Path, required=True, metavar="PATH",
                        help="the C source of the base side (e.g. git show REV:engine/attention/csrc/"
                             "decode_attention.c > PATH)")
    parser.add_argument("--rows", type=int, default=64, help="decode rows in the call (default 64)")
    parser.add_argument("--keys", type=int, default=2048, help="keys of each row (default 2048)")
    parser.add_argument("--page-size", type=int, default=16, help="keys a page (default 16)")
    parser.add_argument("--kv-dtype", choices=("int8", "bfloat16", "float32"), default="int8",
                        help="the pool's pages (default int8)")
    parser.add_argument("--tree-build", choices=("full", "engine"), default="full",
                        help="the tree side built with every int8 loop nest (full, default) or as the engine "
                             "builds it for this pool (engine: its pair's nest only, none for a float pool)")
    parser.add_argument("--calls", type=int, default=20, help="calls a side makes a block (default 20)")
    parser.add_argument("--query-scale", type=float, default=1.0, metavar="X",
                        help="the query's entries are X times standard normal (default 1: a row's scores spread "
                             "about +-6; 10 spreads them about +-60, so that many keys' exp(s - max) fall to "
                             "float32's floor, as in a very peaked softmax)")
    harness.add_common_args(parser, repeats=5)
    args = parser.parse_args(argv)
    for name in ("rows", "keys", "page_size", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.base_source.is_file():
        parser.error(f"--base-source {args.base_source}: no such file")
    run = harness.Run(args, __file__, argv)

    import torch

    from engine.attention.cpu_kernel import SOURCE, DecodeKernel, KernelRows, i8_case_flags
    from engine.cpu_build import build
    from engine.kv_pool import KVCache

    tree_flags = () if args.tree_build == "full" else i8_case_flags((HQ // HKV, D) if args.kv_dtype == "int8" else None)
    kernels = {"base": DecodeKernel(build(args.base_source.resolve())), "tree": DecodeKernel(build(SOURCE, tree_flags))}
    torch.manual_seed(0)
    P, B, L = args.page_size, args.rows, args.keys
    per_row = -(-L // P)
    pages = B * per_row
    dtype = {"int8": torch.int8, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.kv_dtype]
    kv = KVCache(1, pages, P, HKV, D, torch.float32 if dtype == torch.int8 else dtype, "cpu", layout="HSD",
                 **({"kv_dtype": torch.int8} if dtype == torch.int8 else {}))
    slots = torch.arange(pages * P)
    kv.write(0, slots, torch.randn(len(slots), HKV, D) * 2, torch.randn(len(slots), HKV, D))
    free = list(range(pages))
    random.Random(0).shuffle(free)
    rows = KernelRows([[free.pop() for _ in range(per_row)] for _ in range(B)], [L] * B, P)
    q = torch.randn(B, HQ, D) * args.query_scale

    outputs = {side: k.paged(q, kv, 0, rows) for side, k in kernels.items()}   # also the first-call warm-up
    blocks: dict[str, list[float]] = {s: [] for s in SIDES}
    for _, side in harness.ab_order(SIDES, args.repeats, args.order):
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            kernels[side].paged(q, kv, 0, rows)
            times.append((time.perf_counter() - t0) * 1000)
        blocks[side].append(statistics.median(times))
    base, tree = statistics.median(blocks["base"]), statistics.median(blocks["tree"])
    body = {
        "workload": {"rows": B, "keys": L, "page_size": P, "kv_dtype": args.kv_dtype, "heads": [HQ, HKV, D],
                     "calls_per_block": args.calls, "kv_bytes_per_call": B * L * HKV * D * 2 * kv.k[0].element_size()},
        "base_source": str(args.base_source), "tree_build": args.tree_build, "tree_flags": list(tree_flags),
        "call_ms": {s: harness.spread(v) for s, v in blocks.items()},
        "base_over_tree": base / tree,
        "same_output": bool(torch.equal(outputs["base"], outputs["tree"])),
    }
    print(f"one call, {B} rows x {L} {args.kv_dtype} keys: base {base:.3f} ms, tree {tree:.3f} ms "
          f"({body['base_over_tree']:.2f}x); same output: {body['same_output']}")
    return run.write(body)


if __name__ == "__main__":
    main()
