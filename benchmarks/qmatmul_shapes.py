"""The weight matmuls of one decode step, per shape, for each quantized path: where the kernels stand.

A step of the default model's shapes (read from its GGUF header, engine/models/cpu_pick.model_shapes):
every layer's fused q/k/v, o, fused gate/up and down projection, each layer with weights of its own so
that they stream from memory as a real step's do, then the LM head; ``--rows`` activation rows
(1: batch-1 decode), bfloat16 in and out. Sides:

* ``int4``: torch's packed int4 kernel for the layers, its int8 kernel for the head
  (engine/models/quant.py, what ``quantization=int4`` runs);
* ``gguf``: the file's blocks with 8-bit activations through engine/models/csrc/qmatmul.c as this
  machine builds it (``quantization=gguf``), the head Q8_0;
* ``gguf-avx2`` (``--avx2``): the same kernel built without AVX-512 (``-mno-avx512f``), the path a CPU
  with AVX2 only runs.

Weights are random blocks (the time does not depend on the values). Sides alternate step by step in
ABBA order over ``--repeats`` steps; per side and shape the milliseconds a step spends there (median,
min and max over the steps), and the whole step.

    python benchmarks/qmatmul_shapes.py [--rows 1] [--repeats 16] [--avx2] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402
from engine.cpu_build import build  # noqa: E402
from engine.models.cpu_pick import model_shapes  # noqa: E402
from engine.models.qlinear import BlockLinear  # noqa: E402
from engine.models.qmatmul import SOURCE, Q4Blocks, Q8Blocks, QMatmulLib, load  # noqa: E402
from engine.models.quant import Int4Groups, Int4Linear, Int8Linear  # noqa: E402

LAYER_SHAPES = ("qkv", "o", "gate_up", "down")


def random_groups(n: int, k: int, gen: torch.Generator) -> Int4Groups:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    return Int4Groups(q, torch.rand(n, k // 32, generator=gen) * 0.02, -torch.rand(n, k // 32, generator=gen) * 0.1)


def build_sides(shapes: dict, layers: int, avx2: bool) -> tuple[dict, dict]:
    """side -> (layers' {shape: module}, head module); gguf side -> the kernel variant it runs."""
    gen = torch.Generator().manual_seed(0)
    groups = [{s: random_groups(*shapes[s], gen) for s in LAYER_SHAPES} for _ in range(layers)]
    head = torch.randn(*shapes["head"], generator=gen) * 0.02
    sides = {"int4": ([{s: Int4Linear(g) for s, g in layer.items()} for layer in groups], Int8Linear(head))}
    libs = {"gguf": load()}
    if avx2:
        libs["gguf-avx2"] = QMatmulLib(build(SOURCE, ("-mno-avx512f",)))
    q8 = Q8Blocks.quantize(head)
    def block(lib, blocks, shape):
        return BlockLinear(lib, blocks, torch.zeros(()).expand(*shape))       # dense never read: few rows

    for name, lib in libs.items():
        if lib is None:
            raise SystemExit("the qmatmul kernel did not build (see the log)")
        sides[name] = ([{s: block(lib, Q4Blocks.from_groups(g), shapes[s]) for s, g in layer.items()}
                        for layer in groups], block(lib, q8, shapes["head"]))
    return sides, {name: lib.variant for name, lib in libs.items()}


def step(layers: list, head, xs: dict, shapes: dict) -> dict[str, float]:
    """One step's matmuls in a step's order: milliseconds per shape and in all."""
    t = dict.fromkeys([*LAYER_SHAPES, "head"], 0.0)
    start = time.perf_counter()
    for layer in layers:
        for s in LAYER_SHAPES:
            t0 = time.perf_counter()
            layer[s](xs[shapes[s][1]])
            t[s] += time.perf_counter() - t0
    t0 = time.perf_counter()
    head(xs[shapes["head"][1]])
    t["head"] = time.perf_counter() - t0
    t["step"] = time.perf_counter() - start
    return {k: v * 1000 for k, v in t.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=16)   # --repeats: timed steps per side
    ap.add_argument("--rows", type=int, default=1, help="activation rows per matmul (1: batch-1 decode; at most 8)")
    ap.add_argument("--layers", type=int, default=None, help="layers per step (default: the model's)")
    ap.add_argument("--model", default=None, help="GGUF file whose shapes to use (default: the default model)")
    ap.add_argument("--avx2", action="store_true", help="also time the kernel built without AVX-512")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    if not 1 <= args.rows <= 8:
        ap.error("--rows must be 1..8 (the gguf path's rows; more run on dense weights)")
    shapes = model_shapes(args.model)
    from engine.loader import resolve_model
    from engine.loader.gguf_file import GGUFFile

    n_layers = args.layers or sum(1 for t in GGUFFile(resolve_model(args.model)[0]).tensors
                                  if t.name.endswith(".attn_output.weight"))
    sides, variants = build_sides(shapes, n_layers, args.avx2)
    xs = {k: torch.randn(args.rows, k).bfloat16() for k in {k for _, k in shapes.values()}}
    times: dict[str, list[dict]] = {s: [] for s in sides}
    with torch.inference_mode():
        for name in sides:                                                     # warm-up: one step each
            step(*sides[name], xs, shapes)
        for _, name in harness.ab_order(list(sides), args.repeats, args.order):
            times[name].append(step(*sides[name], xs, shapes))
    body = {"rows": args.rows, "layers": n_layers, "shapes": shapes,
            "variants": variants,
            "ms_per_step": {name: {k: harness.spread(t[k] for t in ts) for k in ts[0]} for name, ts in times.items()}}
    print(f"rows {args.rows}, {n_layers} layers, ms per step: median [min-max] over {args.repeats} steps a side")
    for k in [*LAYER_SHAPES, "head", "step"]:
        cells = []
        for name in sides:
            sp = body["ms_per_step"][name][k]
            cells.append(f"{name} {sp['median']:7.3f} [{sp['min']:.3f}-{sp['max']:.3f}]")
        print(f"  {k:8s}", "   ".join(cells), flush=True)
    run.write(body)


if __name__ == "__main__":
    main()
