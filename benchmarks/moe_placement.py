"""MoE expert placement under real expert parallelism: bytes on the wire per placement.

    python -m benchmarks.moe_placement --json OUT [--quick] [--trace DUMP ...]

Four gloo processes laid out as 2 nodes x 2 ranks replay expert-activation traces
through ``ExpertParallelMoE`` (tokens start on the rank the trace says). Per trace:
1. the first half runs on the contiguous start-up layout while every rank records its
   own tokens in ``SlidingWindowStats``;
2. per placement, rank 0 fits on the summed window, the plan is broadcast and the
   weights migrate from the contiguous layout (``migrate``, counted);
3. the second half is measured with a ``Rebalancer`` refitting every 3 steps on a
   sliding window and adopting a candidate only when it wins on the next window
   (migrations counted). Traffic comes from the ``all_to_all_single``
   split sizes: a row (hidden state out + partial sum back) per token and remote rank,
   12 bytes of metadata per token->expert pair.
``reference_ok``: EP output equals the dense oracle (max abs diff <= 1e-5, fp32) on tiny
HF checkpoints of all three families and, in the replay, on each layer's first measured
step for every placement.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks import harness
from benchmarks.moe_checkpoint import write_tiny_checkpoint
from benchmarks.moe_launch import run_distributed
from benchmarks.moe_selfcheck import ep_matches_reference
from benchmarks.moe_traces import Trace, control_trace, load_topk_dump, structured_trace
from engine.moe.config import MoEConfig, Topology
from engine.moe.ep import EPContext, ExpertParallelMoE, sync_plan
from engine.moe.layers import MoEBlock
from engine.moe.placement import LayerPlacement, PlacementPlan, contiguous_phy2log, get_placement
from engine.moe.rebalance import Rebalancer
from engine.moe.stats import SlidingWindowStats

PLACEMENTS = ("contiguous", "balanced", "locality")
TOL = 1e-5


@dataclass(frozen=True)
class BenchConfig:
    hidden: int = 64
    intermediate: int = 64
    num_redundant: int = 4
    step_tokens: int = 1024  # tokens per step over all ranks
    rebalance_every: int = 3  # steps of the measured half between refits
    window: int = 3  # steps in the rebalancer's sliding window


def make_traces(quick: bool, seed: int, world: int) -> list[Trace]:
    layers, tokens = (2, 4096) if quick else (4, 16384)
    e, k = 32, 4
    return [
        structured_trace("structured", layers, tokens, e, k, world, seed),
        structured_trace("structured_weak", layers, tokens, e, k, world, seed + 1, group_size=8, in_group=0.7,
                         affinity=0.5),
        control_trace("control", layers, tokens, e, k, world, seed + 2),
    ]


def _random_block(cfg: MoEConfig, seed: int) -> MoEBlock:
    gen = torch.Generator().manual_seed(seed)
    block = MoEBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block


def _step_tokens(trace: Trace, step: int, bc: BenchConfig, rank: int, layer: int):
    """This rank's tokens of one step: (global token index [T], ids [T, k], weights [T, k], x [T, H])."""
    lo, hi = step * bc.step_tokens, min((step + 1) * bc.step_tokens, trace.num_tokens)
    idx = torch.arange(lo, hi)[trace.src_rank[lo:hi] == rank]
    gen = torch.Generator().manual_seed(step * 7919 + layer * 104729 + rank)
    weights = torch.softmax(torch.randn(len(idx), trace.top_k, generator=gen), -1)  # (T, k)
    x = torch.randn(len(idx), bc.hidden, generator=gen)  # (T, H)
    return idx, trace.topk_ids[layer, idx], weights, x


def _steps(trace: Trace, bc: BenchConfig) -> int:
    return -(-trace.num_tokens // bc.step_tokens)


def _replay_fit_half(ctx: EPContext, trace: Trace, eps: list[ExpertParallelMoE], bc: BenchConfig) -> SlidingWindowStats:
    steps = _steps(trace, bc)
    stats = SlidingWindowStats(trace.num_layers, trace.num_experts, trace.world_size, window=steps)
    for step in range(steps):
        for layer, ep in enumerate(eps):
            idx, ids, w, x = _step_tokens(trace, step, bc, ctx.rank, layer)
            ep.forward_routed(x, ids, w, idx)
            stats.record(layer, ids, ctx.rank)
        stats.advance()
    return stats.reduced(ctx.group)


def _measure(ctx: EPContext, name: str, trace: Trace, blocks: list[MoEBlock], fit_stats: SlidingWindowStats,
             bc: BenchConfig) -> dict:
    """Fit, migrate from contiguous, replay the measured half with periodic rebalancing."""
    topo, e = ctx.topology, trace.num_experts
    placement = get_placement(name, num_redundant=bc.num_redundant)
    start = PlacementPlan([LayerPlacement(contiguous_phy2log(e, bc.num_redundant), e, topo)] * trace.num_layers)
    eps = [ExpertParallelMoE.from_block(b, start[0], ctx) for b in blocks]
    plan = placement.fit(fit_stats.snapshots(), topo) if ctx.rank == 0 else None
    plan = sync_plan(plan, start, ctx)
    for ep, lp in zip(eps, plan.layers):
        ep.migrate(lp)
    rebalancer = Rebalancer(placement, plan, bc.rebalance_every, blocks[0].cfg.expert_bytes())
    window = SlidingWindowStats(trace.num_layers, e, trace.world_size, window=bc.window)
    worst, adopted = 0.0, 0
    for step in range(_steps(trace, bc)):
        if rebalancer.due(step):
            reduced = window.reduced(ctx.group)
            new = None
            if ctx.rank == 0:
                adopted += sum(int(d.adopted) for d in rebalancer.rebalance(reduced.snapshots()))
                new = rebalancer.plan
            new = sync_plan(new, PlacementPlan([ep.layer for ep in eps]), ctx)
            for ep, lp in zip(eps, new.layers):
                if not torch.equal(ep.layer.phy2log, lp.phy2log):
                    ep.migrate(lp)
        for layer, ep in enumerate(eps):
            idx, ids, w, x = _step_tokens(trace, step, bc, ctx.rank, layer)
            with torch.no_grad():
                y = ep.forward_routed(x, ids, w, idx)
                if step == 0 and len(idx):
                    worst = max(worst, float((y - blocks[layer].reference_forward(x, ids, w)).abs().max()))
            window.record(layer, ids, ctx.rank)
        window.advance()
    return _summarise(ctx, eps, worst, adopted)


def _summarise(ctx: EPContext, eps: list[ExpertParallelMoE], worst: float, adopted: int) -> dict:
    totals = torch.stack([ep.traffic.as_tensor() for ep in eps]).sum(0)  # summed over layers
    dist.all_reduce(totals, group=ctx.group)
    served = torch.zeros(len(eps), ctx.topology.world_size, dtype=torch.float64)  # (L, R)
    served[:, ctx.rank] = torch.tensor([float(ep.traffic.pairs_served) for ep in eps])
    dist.all_reduce(served, group=ctx.group)
    worst_t = torch.tensor([worst])
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX, group=ctx.group)
    (tokens, pairs, p_rank, p_node, r_rank, r_node, b_rank, b_node, _, migrated) = totals.tolist()
    ratio = served.max(1).values / served.mean(1)  # (L,)
    return {
        "bytes_per_token_layer": b_rank / tokens,
        "off_node_bytes_per_token_layer": b_node / tokens,
        "off_rank_pair_fraction": p_rank / pairs,
        "off_node_pair_fraction": p_node / pairs,
        "max_mean_load": float(ratio.mean()),
        "max_mean_load_worst_layer": float(ratio.max()),
        "migration_bytes": int(migrated),
        "remote_rows_per_token_layer": r_rank / tokens,
        "rebalances_adopted": adopted,
        "max_abs_diff": float(worst_t),
    }


def bench_rank(ctx: EPContext, traces: list[Trace], checkpoint_dirs: list[str], bc: BenchConfig) -> dict:
    torch.manual_seed(0)
    diffs = ep_matches_reference(ctx, checkpoint_dirs, list(PLACEMENTS), ctx.topology.world_size)
    out = {"checkpoint_max_abs_diff": max(diffs.values()), "traces": {}}
    for trace in traces:
        cfg = MoEConfig("mixtral", trace.num_experts, trace.top_k, bc.hidden, bc.intermediate)
        blocks = [_random_block(cfg, seed=100 + layer) for layer in range(trace.num_layers)]
        fit, measured = trace.halves()
        start = LayerPlacement(contiguous_phy2log(cfg.num_experts, bc.num_redundant), cfg.num_experts, ctx.topology)
        eps = [ExpertParallelMoE.from_block(b, start, ctx) for b in blocks]
        fit_stats = _replay_fit_half(ctx, fit, eps, bc)
        t0 = time.perf_counter()
        out["traces"][trace.name] = {
            "structured": trace.structured,
            "placements": {name: _measure(ctx, name, measured, blocks, fit_stats, bc) for name in PLACEMENTS},
            "seconds": time.perf_counter() - t0,
        }
    return out


def _table(result: dict) -> str:
    cols = ("bytes_per_token_layer", "off_node_bytes_per_token_layer", "off_rank_pair_fraction",
            "off_node_pair_fraction", "max_mean_load", "migration_bytes")
    heads = ("B/tok/layer", "offnode B", "pairs off-rank", "pairs off-node", "max/mean load", "migrated B")
    lines = [f"{'trace':<16}{'placement':<12}" + "".join(f"{h:>16}" for h in heads)]
    for tname, t in result["traces"].items():
        for pname, p in t["placements"].items():
            vals = [f"{p[c]:>16.1f}" if "bytes" in c and "migration" not in c else
                    f"{p[c]:>16d}" if c == "migration_bytes" else f"{p[c]:>16.3f}" for c in cols]
            lines.append(f"{tname:<16}{pname:<12}" + "".join(vals))
        b, loc = t["placements"]["balanced"], t["placements"]["locality"]
        saving = 1 - loc["bytes_per_token_layer"] / b["bytes_per_token_layer"]
        lines.append(f"{'':<16}locality vs balanced: {100 * saving:+.1f}% fewer bytes per token per layer")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, repeats=None, json_required=True)
    ap.add_argument("--quick", action="store_true", help="smaller traces (about a quarter of the tokens)")
    ap.add_argument("--trace", action="append", default=[], help="a top-k dump (.npz/.jsonl, see benchmarks/moe_traces.py)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces and the tiny checkpoints")
    args = ap.parse_args(argv)
    run = harness.Run(args, __file__, argv)
    topo, bc = Topology(nodes=2, ranks_per_node=2), BenchConfig()
    traces = make_traces(args.quick, args.seed, topo.world_size)
    traces += [load_topk_dump(p, topo.world_size) for p in args.trace]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [str(write_tiny_checkpoint(f"{tmp}/{f}", f, seed=args.seed)) for f in ("mixtral", "qwen2_moe", "qwen3_moe")]
        ranks = run_distributed(bench_rank, topo, traces, dirs, bc)
    res = ranks[0]
    replay_diff = max(p["max_abs_diff"] for t in res["traces"].values() for p in t["placements"].values())
    result = {"reference_ok": res["checkpoint_max_abs_diff"] <= TOL and replay_diff <= TOL,
              "reference_max_abs_diff": max(res["checkpoint_max_abs_diff"], replay_diff),
              "topology": {"nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node},
              "settings": bc.__dict__ | {"quick": args.quick, "seed": args.seed},
              "seconds": time.perf_counter() - t0,
              "traces": res["traces"]}
    print(_table(result))
    print(f"reference_ok={result['reference_ok']} (max abs diff {result['reference_max_abs_diff']:.2e}); "
          f"{result['seconds']:.0f} s")
    run.write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
