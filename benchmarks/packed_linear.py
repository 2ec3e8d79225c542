"""A decode step's float32 projections and LM head: torch's ``F.linear`` against oneDNN's packed GEMM.

    python benchmarks/packed_linear.py --json OUT

What engine/models/packed_linear.py changes for float32 on dense weights: every projection of the default model's
layers (q/k/v fused, o, gate/up fused, down: 30 layers of weights of their own, so they stream from memory as a
step's do) and its LM head, multiplied at each of ``--rows`` rows (1: a batch-1 decode step; 3-23: speculative
verifications and small batches; 256: a prefill chunk) by the two sides on the same random weights and inputs,
in ABBA order over ``--repeats``, the best of ``--calls`` a side a block:

- ``f_linear``: ``torch.nn.functional.linear`` (MKL's sgemm in torch's CPU builds);
- ``packed``: ``PackedLinear`` (oneDNN's GEMM on weights reordered once at load).

``max_abs_diff``: the largest difference of the two sides' outputs at each row count (float32 rounding: they sum
in different orders). The engine's own choice between them is engine/models/cpu_pick.py ``pick_packed_linear``.

    python benchmarks/packed_linear.py --engine --json OUT

compares the two sides through the engine instead: benchmarks/engine_sessions.py's agentic workload (``--sessions``
sessions sharing a ~1,500-token system prompt, ``--turns`` turns each, 32-token greedy replies, speculation off)
on a float32 engine of the default model built with each side whatever the start-up pick, its prefix cache flushed
before every run, the runs in ABBA order over ``--repeats``: wall time, generated tokens a second, TTFT of turns 2+,
and how many replies came out token for token the same on both sides.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: benchmarks/ importable

from benchmarks import harness  # noqa: E402

SIDES = ("f_linear", "packed")
# the default model's (out, in) per layer, and its (tied) LM head
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,3,4,16,23,64,256", help="comma-separated row counts (default "
                        "1,3,4,16,23,64,256)")
    parser.add_argument("--layers", type=int, default=30, help="layers of weights of their own (default 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, a test worker's)")
    parser.add_argument("--calls", type=int, default=3, help="timed passes a side a block; the best is kept")
    parser.add_argument("--engine", action="store_true", help="compare the sides through the engine on "
                        "engine_sessions.py's agentic workload instead of the matmuls alone")
    parser.add_argument("--sessions", type=int, default=4, help="with --engine: agent sessions (default 4)")
    parser.add_argument("--turns", type=int, default=3, help="with --engine: turns per session (default 3)")
    harness.add_common_args(parser, repeats=3)
    args = parser.parse_args(argv)
    if min(args.sessions, args.turns) < 1:
        parser.error("--sessions and --turns must be >= 1")
    try:
        rows = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        parser.error(f"--rows: comma-separated integers, got {args.rows!r}")
    if not rows or min(rows) < 1 or min(args.layers, args.threads, args.calls) < 1:
        parser.error("--rows, --layers, --threads and --calls must be >= 1")

    import torch
    import torch.nn.functional as F

    from engine.models.packed_linear import PackedLinear, available
    if not available():
        raise SystemExit("this torch has no oneDNN packed linear: nothing to compare")
    torch.set_num_threads(args.threads)
    run = harness.Run(args, __file__, argv)
    if args.engine:
        return engine_ab(args, run)
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(args.layers) for s in LAYER.values()] + [HEAD]
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    layers = {"f_linear": [lambda x, w=w: F.linear(x, w) for w in weights],
              "packed": [PackedLinear(w) for w in weights]}
    body: dict = {"workload": {"layers": args.layers, "layer_shapes": LAYER, "head": HEAD, "threads": args.threads,
                               "calls_per_block": args.calls}, "rows": {}}
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
            diff = max(float((layers["packed"][i](xs[k]) - layers["f_linear"][i](xs[k])).abs().max())
                       for i, (_, k) in enumerate(shapes))
            blocks: dict[str, list[float]] = {s: [] for s in SIDES}
            for _, side in harness.ab_order(SIDES, args.repeats, args.order):
                best = float("inf")
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    for fn, (_, k) in zip(layers[side], shapes):
                        fn(xs[k])
                    best = min(best, (time.perf_counter() - t0) * 1000)
                blocks[side].append(best)
            ms = {s: harness.spread(v) for s, v in blocks.items()}
            body["rows"][str(m)] = {"step_ms": ms, "f_linear_over_packed": ms["f_linear"]["median"]
                                    / ms["packed"]["median"], "max_abs_diff": diff}
            print(f"{m} rows: F.linear {ms['f_linear']['median']:.1f} ms, packed {ms['packed']['median']:.1f} ms "
                  f"({body['rows'][str(m)]['f_linear_over_packed']:.2f}x), max |diff| {diff:.2e}", flush=True)
    return run.write(body)


def engine_ab(args, run) -> dict:
    """The two sides through the engine (module docstring)."""
    from unittest import mock

    import torch

    from agentrt.bench.text import system_prompt
    from benchmarks.engine_sessions import run_engine
    from benchmarks.workload import AgenticWorkload
    from engine import EngineConfig, LLMEngine
    from engine.models import cpu_pick

    wl = AgenticWorkload(sessions=args.sessions, turns=args.turns, system_tokens=1500)
    engines = {}
    for side in SIDES:
        # the builder asks the pick at build time (engine/builder.py _pack_projections): each side its own answer
        with mock.patch.object(cpu_pick, "pick_packed_linear", lambda shapes, on=side == "packed": on):
            engines[side] = LLMEngine(EngineConfig(dtype="float32", quantization="off", kv_cache_tokens=131072,
                                                   max_batched_tokens=512, speculative="off"))
        if engines[side].active_kernels["packed_linear"] != (side == "packed"):
            raise SystemExit(f"--engine: the {side} engine did not build as asked (cpu_kernels off, or no oneDNN?)")
    system = system_prompt(engines["f_linear"].tokenizer, wl.system_tokens)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    replies: dict[str, dict] = {}
    with torch.inference_mode():
        for _, side in harness.ab_order(SIDES, args.repeats, args.order):
            engine = engines[side]
            engine.flush_cache()
            engine.step()                                   # applies the flush: every run starts cold
            result = run_engine(engine, wl, system)
            replies.setdefault(side, result.pop("_replies"))
            runs[side].append(result)
    keys = ("wall_s", "tokens_per_s", "ttft_p50_s_turns2plus")
    sides = {s: {k: harness.spread(r[k] for r in runs[s]) for k in keys} for s in SIDES}
    same = sum(replies["f_linear"][k] == replies["packed"][k] for k in replies["f_linear"])
    body = {"workload": {**vars(wl), "dtype": "float32", "speculative": "off", "threads": args.threads},
            "engine": sides,
            "f_linear_over_packed_wall": sides["f_linear"]["wall_s"]["median"] / sides["packed"]["wall_s"]["median"],
            "replies_identical": same, "replies": len(replies["f_linear"])}
    for s in SIDES:
        print(f"{s}: wall {sides[s]['wall_s']['median']:.1f} s, {sides[s]['tokens_per_s']['median']:.1f} tok/s, "
              f"TTFT p50 turns 2+ {sides[s]['ttft_p50_s_turns2plus']['median']:.3f} s", flush=True)
    print(f"wall F.linear / packed {body['f_linear_over_packed_wall']:.2f}x; {same}/{body['replies']} replies "
          f"identical", flush=True)
    return run.write(body, engine=engines["packed"])


if __name__ == "__main__":
    main()
