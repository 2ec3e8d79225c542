"""``balanced``: load balancing with redundant experts, as DeepSeek's EPLB describes.

Hierarchical policy (used when the expert groups divide evenly over the nodes):
1. pack expert groups onto nodes so every node gets the same number of groups and
   the node loads are as even as a greedy packing makes them;
2. inside each node, replicate the hottest experts (repeatedly give one more replica to
   the expert with the highest load per replica) until the node's slots are used;
3. pack the node's physical replicas onto its ranks, S per rank, heaviest first onto
   the lightest rank.
Otherwise the global policy: replicate over all slots, then pack over all ranks.
Tokens choose among replicas by hashing the token index (``hash`` policy, as vLLM).

``num_groups`` defaults to one group per expert (Mixtral and Qwen-MoE have no
group-limited routing), so step 1 packs single experts.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.moe.config import Topology
from engine.moe.placement import Placement
from engine.moe.stats import ExpertStats


def balanced_packing(weights: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack n items into ``num_packs`` packs of n / num_packs items each; heaviest item first
    onto the lightest pack with room. Returns pack index per item [n]."""
    n = len(weights)
    per_pack = n // num_packs
    pack = np.empty(n, dtype=np.int64)
    pack_load, pack_items = np.zeros(num_packs), np.zeros(num_packs, dtype=np.int64)
    for i in np.argsort(-weights, kind="stable"):
        room = np.flatnonzero(pack_items < per_pack)
        p = room[np.argmin(pack_load[room])]
        pack[i] = p
        pack_load[p] += weights[i]
        pack_items[p] += 1
    return pack


def replicate_experts(weights: np.ndarray, num_physical: int) -> np.ndarray:
    """Give ``num_physical - n`` extra replicas, each to the expert with the highest load
    per replica. Returns the logical expert of each physical replica [num_physical]."""
    n = len(weights)
    count = np.ones(n, dtype=np.int64)
    phy = list(range(n))
    for _ in range(num_physical - n):
        e = int(np.argmax(weights / count))
        count[e] += 1
        phy.append(e)
    return np.array(phy, dtype=np.int64)


def _pack_replicas(phy: np.ndarray, weights: np.ndarray, num_ranks: int) -> list[list[int]]:
    """Pack physical replicas (by load per replica) onto ranks, equal counts. Returns the
    logical experts on each rank."""
    count = np.bincount(phy, minlength=len(weights))
    rank = balanced_packing(weights[phy] / count[phy], num_ranks)
    return [sorted(phy[rank == r].tolist()) for r in range(num_ranks)]


def eplb_phy2log(load: np.ndarray, num_physical: int, topology: Topology, num_groups: int | None = None) -> np.ndarray:
    """phy2log [num_physical] for expert loads ``load`` [E] (hierarchical when possible)."""
    e = len(load)
    groups = e if num_groups is None else num_groups
    nodes, ranks = topology.nodes, topology.world_size
    hierarchical = e % groups == 0 and groups % nodes == 0 and num_physical % nodes == 0 and num_physical // nodes >= e // nodes
    if not hierarchical:
        return np.array(sum(_pack_replicas(replicate_experts(load, num_physical), load, ranks), []), dtype=np.int64)
    group_size = e // groups
    group_load = load.reshape(groups, group_size).sum(1)
    group_node = balanced_packing(group_load, nodes)  # (G,)
    out = []
    for node in range(nodes):
        experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size) for g in np.flatnonzero(group_node == node)])
        phy_local = replicate_experts(load[experts], num_physical // nodes)  # indices into experts
        per_rank = _pack_replicas(phy_local, load[experts], topology.ranks_per_node)
        out.extend(experts[r].tolist() for r in per_rank)
    return np.array(sum(out, []), dtype=np.int64)


class BalancedPlacement(Placement):
    """DeepSeek EPLB (hierarchical) with hash replica choice."""

    name = "balanced"
    replica_policy = "hash"

    def __init__(self, num_redundant: int = 0, num_groups: int | None = None):
        super().__init__(num_redundant)
        if num_groups is not None and num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_groups = num_groups

    def fit_phy2log(self, stats: ExpertStats, topology: Topology) -> torch.Tensor:
        s = self.slots_per_rank(stats.num_experts, topology)
        load = stats.load.numpy() + 1e-9  # no zero loads: keeps argmax/argsort deterministic
        return torch.from_numpy(eplb_phy2log(load, s * topology.world_size, topology, self.num_groups))
