"""Expert-parallel output vs the dense single-process oracle, run on every rank.

Used by the tests (``tests/engine/moe/test_moe_ep.py``) and by ``benchmarks/moe_placement.py``
(``reference_ok``), on processes started by ``benchmarks/moe_launch.py``. Each rank
loads the block from a real HF checkpoint directory (its own slots through the lazy
reader, the full block for the oracle), feeds its own tokens (a different count per
rank, rank 1 none at all) and compares with ``MoEBlock.reference_forward``. It checks
every placement straight after fitting and after migrating from the contiguous layout,
and that the traffic counted from the split sizes equals ``placement.simulate_dispatch``.
"""

from __future__ import annotations

import torch

from benchmarks.moe_checkpoint import read_hf_config
from engine.moe.checkpoint import SafetensorsDict
from engine.moe.config import MoEConfig
from engine.moe.placement import simulate_dispatch
from engine.moe.ep import EPContext, ExpertParallelMoE
from engine.moe.layers import MoEBlock
from engine.moe.placement import LayerPlacement, contiguous_phy2log, get_placement
from engine.moe.stats import ExpertStats


def _fit_stats(block: MoEBlock, world_size: int, seed: int, tokens: int = 512) -> ExpertStats:
    """Routing counts of seeded random tokens (identical on every rank), with a skew so
    that replicas and source affinity matter."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, block.cfg.hidden, generator=gen)  # (N, H)
    src = torch.randint(world_size, (tokens,), generator=gen)  # (N,)
    x = x + 0.5 * block.routing.gate.weight[src % block.cfg.num_experts]  # tokens of rank r lean to expert r
    ids, _ = block.route(x)
    return ExpertStats.from_topk(ids, src, block.cfg.num_experts, world_size)


def ep_matches_reference(ctx: EPContext, checkpoint_dirs: list[str], placements: list[str], num_redundant: int,
                         tokens: int = 24, layer: int = 0, seed: int = 0,
                         placement_kwargs: dict | None = None) -> dict[str, float]:
    """Max abs difference EP vs oracle on this rank's tokens, keyed "family/placement" and
    "family/placement/migrated"; "family/placement/traffic_mismatch" is the absolute
    difference between counted and simulated remote rows and pairs (0 when they agree).
    Collective: every rank must call it with the same arguments."""
    out: dict[str, float] = {}
    prefix = f"model.layers.{layer}."
    for directory in checkpoint_dirs:
        cfg = MoEConfig.from_hf_config(read_hf_config(directory))
        sd = SafetensorsDict(directory)
        block = MoEBlock.from_hf_state_dict(cfg, sd, prefix)
        gen = torch.Generator().manual_seed(seed * 1000 + ctx.rank)
        n = 0 if ctx.rank == 1 else tokens + 7 * ctx.rank
        x = torch.randn(n, cfg.hidden, generator=gen)  # (T_rank, H)
        ref = block.reference_forward(x)  # (T_rank, H)
        stats = _fit_stats(block, ctx.topology.world_size, seed)
        contiguous = LayerPlacement(contiguous_phy2log(cfg.num_experts, num_redundant), cfg.num_experts, ctx.topology)
        for name in placements:
            kwargs = {"num_redundant": num_redundant} | ((placement_kwargs or {}).get(name, {}))
            fitted = get_placement(name, **kwargs).fit_layer(stats, ctx.topology)
            with torch.no_grad():
                ep = ExpertParallelMoE.from_hf_state_dict(cfg, fitted, ctx, sd, prefix)
                out[f"{cfg.family}/{name}"] = _diff(ep(x), ref)
                sim = simulate_dispatch(fitted, block.route(x)[0], torch.full((n,), ctx.rank))
                c = ep.traffic
                out[f"{cfg.family}/{name}/traffic_mismatch"] = (
                    abs(c.rows_off_rank - sim["rows_off_rank"]) + abs(c.rows_off_node - sim["rows_off_node"])
                    + abs(c.pairs_off_rank - sim["pairs_off_rank"]) + abs(c.pairs_off_node - sim["pairs_off_node"]))
                moved = ExpertParallelMoE.from_hf_state_dict(cfg, contiguous, ctx, sd, prefix)
                moved.migrate(fitted)
                out[f"{cfg.family}/{name}/migrated"] = _diff(moved(x), ref)
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0
