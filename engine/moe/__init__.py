"""Mixture-of-Experts layers, expert placement and expert parallelism.

Single process: ``MoEConfig.from_hf_config`` + ``MoEBlock.from_hf_state_dict``.
Expert parallel (R processes): fit a ``PlacementPlan`` with ``get_placement(name)``,
build one ``ExpertParallelMoE`` per MoE layer per rank, keep ``SlidingWindowStats``
and let a ``Rebalancer`` refit and ``migrate``. Serving (``LLMEngine`` with ``ep_size > 1``):
``ep_group.ExpertParallelGroup`` starts the worker ranks, ``serving.run_split`` runs each
MoE layer of a step across them. See docs/moe.md.
"""

from engine.moe.config import FAMILIES, MoEConfig, Topology, moe_layer_indices
from engine.moe.layers import MoEBlock, MoERouting, SwiGLUExperts, load_expert_weights
from engine.moe.placement import LayerPlacement, Placement, PlacementPlan, get_placement, placement_names
from engine.moe.stats import ExpertStats, SlidingWindowStats

__all__ = [
    "FAMILIES", "MoEConfig", "Topology", "moe_layer_indices", "MoEBlock", "MoERouting", "SwiGLUExperts",
    "load_expert_weights", "LayerPlacement", "Placement", "PlacementPlan", "get_placement", "placement_names",
    "ExpertStats", "SlidingWindowStats",
]
