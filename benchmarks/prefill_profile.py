"""Where an extend prefill's time goes: a long cached prefix, then one turn's new tokens over it.

The agent workload's turn (benchmarks/vs_llamacpp.py): ~750 new tokens over a 2-7k cached context. This
builds an engine on the default model, caches ``--prefix`` tokens, then times requests that add ``--extend``
new tokens each (one output token), splitting every step into the weight matmuls, attention, RoPE + K/V
write, the C layer ops and the rest. ``--ab`` alternates (ABBA, one process) the paths from before the
blocks' prefill and the split extend attention (A) with the ones picked now (B); ``--ab-prefill-kernel``
alternates torch's attention (A) with the C prefill kernel (B: bfloat16 on vdpbf16ps, or float32 on AVX).
``--cpu x86-64-v3`` caps torch, oneDNN and our kernels at AVX2 as vs_llamacpp.py does (set before torch is
imported).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


# the two A/B runs, one at a time: each flag's sides A and B
AB_SIDES = {
    "--ab-prefill-kernel": "A, torch's attention for the prefill chunks, with B, the C prefill kernel "
                           "(engine/attention/csrc/prefill_attention.c; bfloat16 on vdpbf16ps, float32 on AVX)",
    "--ab": "A, the dense prefill matmuls and the masked SDPA extend (the paths before prefill on the blocks and "
            "extend_attention), with B, the paths picked now",
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", choices=["native", "x86-64-v3"], default="native",
                   help="x86-64-v3: torch, oneDNN and the C kernels capped at AVX2, as vs_llamacpp.py --cpu does")
    p.add_argument("--prefix", type=int, default=5000, help="cached tokens before each turn")
    p.add_argument("--extend", type=int, default=750, help="new tokens a turn")
    p.add_argument("--repeats", type=int, default=4, help="timed rounds (after one warm-up round)")
    p.add_argument("--quantization", default="gguf", help="EngineConfig.quantization")
    p.add_argument("--dtype", default="float32", help="EngineConfig.dtype")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="write the runs and their medians here (the harness's header)")
    for flag, sides in AB_SIDES.items():
        p.add_argument(flag, action="store_true", help=f"alternate (ABBA) {sides}")
    args = p.parse_args()
    if args.ab and args.ab_prefill_kernel:
        p.error("--ab and --ab-prefill-kernel each alternate their own pair of sides: give one of them")
    return args


def main() -> None:
    args = parse()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.cpu == "x86-64-v3":
        from engine.cpu_info import AVX2_ONLY_ENV
        os.environ.update(AVX2_ONLY_ENV)
    import torch  # noqa: F401  (after the caps)

    if args.threads:
        torch.set_num_threads(args.threads)

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import qlinear

    from benchmarks import harness

    run_info = harness.Run(args, __file__)
    if args.ab_prefill_kernel:   # both sides whatever the start-up probe would pick (the JSON records the pick's rule)
        TorchAttentionBackend.force_prefill_kernel = True
    if args.ab:                  # side A multiplies the dense weights a build on the blocks would release
        from engine.models import qlinear
        qlinear.RELEASE_DENSE = False
    eng = LLMEngine(EngineConfig(dtype=args.dtype, quantization=args.quantization,
                                 kv_cache_tokens=args.prefix + args.extend * 4 * (args.repeats + 2) + 1024))
    times: dict[str, float] = {}

    def timed(cls, name, key):
        fn = getattr(cls, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - t0
        setattr(cls, name, wrapper)

    timed(qlinear.BlockLinear, "forward", "matmul")
    timed(qlinear.BlockLinear, "swiglu", "matmul")   # a whole MLP in one call, SiLU-multiply with it
    timed(TorchAttentionBackend, "forward", "attention")
    timed(TorchAttentionBackend, "rotate_and_store", "rope+kv write")
    ops = eng.model.cpu_ops
    if ops is not None:
        timed(type(ops.add_rms_norm), "__call__", "add+norm")
        timed(type(ops.silu_mul), "__call__", "silu*mul")
    timed(type(eng.model), "forward", "model")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu {args.cpu}, "
          f"quantization {eng.quantization}, kernels {eng.active_kernels}", file=sys.stderr)

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = eng.model.cfg.vocab_size

    def run(tokens) -> float:
        eng.add_request(tokens, params)
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t0

    prefix = torch.randint(100, vocab - 100, (args.prefix,), generator=g).tolist()
    run(prefix)
    from engine.attention import torch_backend
    from engine.models.qlinear import prefill_on_blocks

    flash, blocks = torch_backend._FLASH_CPU, getattr(eng, "prefill_on_blocks", False)
    prefill_kernel = eng.runner.attn.prefill_kernel
    if args.ab_prefill_kernel and prefill_kernel is None:
        raise SystemExit("--ab-prefill-kernel: this engine runs no C prefill kernel (bfloat16 on vdpbf16ps, float32 "
                         "on AVX, where the start-up probe measured it faster than torch's)")

    def config(side: str) -> None:
        if args.ab_prefill_kernel:
            eng.runner.attn.prefill_kernel = prefill_kernel if side == "B" else None
            return
        torch_backend._FLASH_CPU = flash if side == "B" else None
        prefill_on_blocks(eng.model, blocks and side == "B")

    ab = args.ab or args.ab_prefill_kernel
    sides = ["A", "B", "B", "A"] if ab else ["B"]
    by_side: dict[str, list[dict]] = {}
    for r in range(args.repeats + 1):
        for side in sides if r % 2 == 0 else sides[::-1]:
            config(side)
            times.clear()
            new = torch.randint(100, vocab - 100, (args.extend,), generator=g).tolist()
            wall = run(prefix + new)
            if r:   # the first round warms up
                by_side.setdefault(side, []).append({"wall": wall, **times})
    config("B")
    for side, rows in sorted(by_side.items()):
        if ab:
            print(f"-- {side} ({'before' if side == 'A' else 'after'}): {len(rows)} runs")
        report(rows)
    sides_desc = ({"A": "torch's attention for the prefill chunks", "B": f"the C prefill kernel ({args.dtype})"}
                  if args.ab_prefill_kernel else
                  {"A": "dense prefill matmuls, masked SDPA extend", "B": "the paths picked now"})
    body = {"prefix_tokens": args.prefix, "extend_tokens": args.extend, "cpu_target": args.cpu,
            "sides": {side: {"what": sides_desc[side] if ab else "the paths picked now",
                             "runs_ms": [{k: round(v * 1000, 1) for k, v in row.items()} for row in rows],
                             "median_ms": {k: round(statistics.median(row.get(k, 0.0) for row in rows) * 1000, 1)
                                           for k in KEYS}}
                      for side, rows in sorted(by_side.items())}}
    if ab:
        a, b = body["sides"]["A"]["median_ms"], body["sides"]["B"]["median_ms"]
        body["ratio_b_over_a"] = {k: round(b[k] / a[k], 3) for k in ("wall", "attention") if a[k]}
    run_info.write(body, engine=eng)
    eng.close()


KEYS = ["wall", "model", "matmul", "attention", "rope+kv write", "add+norm", "silu*mul"]


def report(rows: list[dict]) -> None:
    keys = KEYS
    for k in keys:
        v = [row.get(k, 0.0) * 1000 for row in rows]
        print(f"{k:>14}: median {statistics.median(v):8.1f} ms  (min {min(v):.1f}, max {max(v):.1f})")
    model = statistics.median(row["model"] for row in rows)
    rest = model - sum(statistics.median(row.get(k, 0.0) for row in rows) for k in keys[2:])
    print(f"{'model rest':>14}: {rest * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
