"""What a verification step costs against a decode step, on this machine: the draft-length rule's input.

One decoding request (``--ctx`` tokens of context, each on its own pages) is stepped by the engine's
model runner with 0, 1, ..., ``--max-drafts`` draft tokens to verify, in blocks of ``--steps`` steps
whose order alternates (0..K, then K..0, ...) so that a noisy machine's slow moments fall on every
k alike. The median step time per k gives ``ms_by_k``; ``step_cost`` is the least-squares line
``ms_by_k[k] / ms_by_k[0] - 1 = FIXED + ROW * k`` (engine/step_cost.py), which ``LLMEngine`` reads
from ``benchmarks/results/step_cost.json`` when the ``setup`` recorded there is its own.

    python benchmarks/step_cost.py --json benchmarks/results/step_cost.json [--ctx 512] [--steps 5] [--blocks 4]

Take it on a quiet machine: the fit takes the medians it is given (on a machine loaded by other
jobs, steps of one row measured 2-8 s and the costs came out non-monotonic in k).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.scheduler import ScheduledBatch  # noqa: E402
from engine.step_cost import fit_step_cost  # noqa: E402
from benchmarks import harness  # noqa: E402


def one_row(engine: LLMEngine, ctx: int, max_drafts: int) -> Request:
    """A request of ``ctx`` random tokens at its last one, with pages for ``max_drafts`` more."""
    P, gen = engine.config.page_size, torch.Generator().manual_seed(ctx)
    ids = torch.randint(0, engine.model_config.vocab_size, (ctx,), generator=gen).tolist()
    req = Request("step-cost", ids, SamplingParams(max_tokens=1))
    req.pages = engine.pool.alloc(-(-(ctx + max_drafts) // P))
    req.num_computed = ctx - 1
    return req


def time_steps(engine: LLMEngine, req: Request, draft: list[int], steps: int) -> list[float]:
    """Wall ms of ``steps`` runner steps of ``req`` verifying ``draft`` (empty: a plain decode step)."""
    batch = ScheduledBatch([req], [1], {0: draft} if draft else {})
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.runner.run(batch)
        out.append((time.perf_counter() - t) * 1000)
    return out


def measure(engine: LLMEngine, ctx: int, max_drafts: int, steps: int, blocks: int) -> dict[int, float]:
    """Median step ms per draft length, the lengths' order alternating block by block."""
    req = one_row(engine, ctx, max_drafts)
    draft = torch.randint(0, engine.model_config.vocab_size, (max_drafts,),
                          generator=torch.Generator().manual_seed(1)).tolist()
    ks = list(range(max_drafts + 1))
    for k in ks:
        time_steps(engine, req, draft[:k], 1)  # warm-up of every shape
    times: dict[int, list[float]] = {k: [] for k in ks}
    for block in range(blocks):
        for k in ks if block % 2 == 0 else reversed(ks):
            times[k] += time_steps(engine, req, draft[:k], steps)
    engine.pool.free(req.pages)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_common_args(ap, repeats=None)   # the engine reads benchmarks/results/step_cost.json
    ap.add_argument("--ctx", type=int, default=512, help="context tokens of the decoding row (default 512)")
    ap.add_argument("--max-drafts", type=int, default=EngineConfig.num_speculative_tokens,
                    help="draft lengths 0..this are timed (default: the engine's num_speculative_tokens)")
    ap.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per draft length, order alternating (default 4)")
    ap.add_argument("--dtype", default=EngineConfig.dtype, help="engine dtype (the setup the cost applies to)")
    ap.add_argument("--quantization", default=EngineConfig.quantization,
                    help="weight quantization (engine.config.QUANTIZATIONS; the setup the cost applies to)")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    for name in ("ctx", "steps", "blocks"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_drafts < 2:
        ap.error(f"--max-drafts must be at least 2 (a line needs two points), got {args.max_drafts}")
    P = EngineConfig.page_size
    engine = LLMEngine(EngineConfig(dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_tokens=(-(-(args.ctx + args.max_drafts) // P) + 1) * P))
    ms_by_k = measure(engine, args.ctx, args.max_drafts, args.steps, args.blocks)
    fixed, row = fit_step_cost(ms_by_k)
    out = {"setup": engine.step_cost_setup(), "ctx": args.ctx, "steps": args.steps, "blocks": args.blocks,
           "ms_by_k": {str(k): v for k, v in ms_by_k.items()},
           "cost_by_k": {str(k): round(v / ms_by_k[0], 3) for k, v in ms_by_k.items()},
           "step_cost": [round(fixed, 4), round(row, 4)]}
    print(json.dumps({k: out[k] for k in ("setup", "ms_by_k", "cost_by_k", "step_cost")}, indent=2))
    run.write(out, engine=engine)


if __name__ == "__main__":
    main()
