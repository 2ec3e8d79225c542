"""Expert placement: which logical expert each physical slot holds, and which replica
serves each token.

Contracts:
- There are ``R * S`` physical slots (R ranks, S slots per rank); slot p lives on rank
  ``p // S``. ``phy2log [R*S]`` names the logical expert in every slot; every logical
  expert has at least one replica. ``log2phy [E, M]`` lists each expert's slots
  (padded with -1) and ``replica_count [E]`` how many there are.
- ``choose_replica`` maps a token's logical experts to physical slots. The ``hash``
  policy (vLLM) spreads tokens over replicas by hashing the token index; the
  ``locality`` policy picks a replica on the token's own rank, else on its node, else
  hashes among all replicas (ties inside a tier are hashed the same way).
- A ``Placement`` fits one ``LayerPlacement`` per layer from ``ExpertStats``; the plan is
  deterministic for given stats and settings. Implementations are registered by name
  and imported lazily (``get_placement``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from engine.moe.config import Topology
from engine.moe.cost import load_from_fractions, replica_counts, routing_fractions
from engine.moe.stats import ExpertStats

REPLICA_POLICIES = ("hash", "locality")


class LayerPlacement:
    """The physical layout of one MoE layer (immutable; derived maps computed once)."""

    def __init__(self, phy2log: torch.Tensor, num_experts: int, topology: Topology, replica_policy: str = "hash"):
        phy2log = torch.as_tensor(phy2log, dtype=torch.long).clone()
        r = topology.world_size
        if replica_policy not in REPLICA_POLICIES:
            raise ValueError(f"replica_policy must be one of {REPLICA_POLICIES}, got {replica_policy!r}")
        if phy2log.dim() != 1 or phy2log.numel() % r:
            raise ValueError(f"phy2log must be 1-D with a multiple of {r} slots, got shape {tuple(phy2log.shape)}")
        if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_experts):
            raise ValueError(f"phy2log entries must be logical expert ids in [0, {num_experts})")
        count = torch.bincount(phy2log, minlength=num_experts)  # (E,)
        if int(count.min()) < 1:
            missing = (count == 0).nonzero().flatten().tolist()
            raise ValueError(f"every expert needs at least one slot; experts {missing} have none")
        self.phy2log, self.num_experts, self.topology, self.replica_policy = phy2log, num_experts, topology, replica_policy
        self.replica_count = count
        self.slots_per_rank = phy2log.numel() // r
        order = torch.argsort(phy2log, stable=True)  # slots grouped by expert, ascending slot
        m = int(count.max())
        self.log2phy = torch.full((num_experts, m), -1, dtype=torch.long)  # (E, M)
        starts = torch.cumsum(count, 0) - count
        col = torch.arange(phy2log.numel()) - starts[phy2log[order]]
        self.log2phy[phy2log[order], col] = order

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def local_experts(self, rank: int) -> list[int]:
        """Logical experts in rank ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return self.phy2log[rank * s:(rank + 1) * s].tolist()

    def choose_replica(self, topk_ids: torch.Tensor, src_rank: int | torch.Tensor, token_index: torch.Tensor | None = None) -> torch.Tensor:
        """topk_ids [T, k] logical -> physical slots [T, k]. ``src_rank`` is the rank the
        tokens come from (int or [T]); ``token_index`` [T] (default arange) seeds the hash."""
        t, k = topk_ids.shape
        if token_index is None:
            token_index = torch.arange(t)
        ids = topk_ids.long()
        cand = self.log2phy[ids]  # (T, k, M)
        cnt = self.replica_count[ids]  # (T, k)
        h = (token_index.long()[:, None] * 2654435761 + ids * 40503) >> 8  # (T, k) non-negative
        m = cand.shape[-1]
        rot = (torch.arange(m)[None, None, :] - (h % cnt)[..., None]) % cnt[..., None]  # (T, k, M) hash order
        key = rot
        if self.replica_policy == "locality":
            src = torch.as_tensor(src_rank, dtype=torch.long).expand(t)[:, None, None]  # (T, 1, 1)
            rank = cand.clamp(min=0) // self.slots_per_rank  # (T, k, M)
            rpn = self.topology.ranks_per_node
            tier = torch.where(rank == src, 0, torch.where(rank // rpn == src // rpn, 1, 2))
            key = tier * m + rot
        key = key.masked_fill(cand < 0, 1 << 40)
        choice = key.argmin(dim=-1, keepdim=True)  # (T, k, 1)
        return cand.gather(-1, choice).squeeze(-1)


class PlacementPlan:
    """One ``LayerPlacement`` per MoE layer, all with the same slots per rank."""

    def __init__(self, layers: Sequence[LayerPlacement]):
        if not layers:
            raise ValueError("a plan needs at least one layer")
        if len({(lp.slots_per_rank, lp.world_size) for lp in layers}) != 1:
            raise ValueError("all layers of a plan must have the same ranks and slots per rank")
        self.layers = list(layers)

    def __getitem__(self, layer: int) -> LayerPlacement:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def slots_per_rank(self) -> int:
        return self.layers[0].slots_per_rank


class Placement:
    """Base class: fit a layout per layer from routing statistics.

    Subclasses set ``name`` and ``replica_policy`` and implement ``fit_phy2log``.
    ``num_redundant`` extra slots (a multiple of the world size) hold replicas, so
    slots per rank = (E + num_redundant) / R.
    """

    name: ClassVar[str] = ""
    replica_policy: ClassVar[str] = "hash"

    def __init__(self, num_redundant: int = 0):
        if num_redundant < 0:
            raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
        self.num_redundant = num_redundant

    def slots_per_rank(self, num_experts: int, topology: Topology) -> int:
        total = num_experts + self.num_redundant
        if total % topology.world_size:
            raise ValueError(
                f"num_experts + num_redundant = {total} must be a multiple of the world size {topology.world_size}"
            )
        return total // topology.world_size

    def fit_phy2log(self, stats: ExpertStats, topology: Topology) -> torch.Tensor:
        """Return phy2log [R*S] for one layer. ``stats.world_size`` equals the world size."""
        raise NotImplementedError

    def fit_layer(self, stats: ExpertStats, topology: Topology) -> LayerPlacement:
        if stats.world_size != topology.world_size:
            raise ValueError(f"stats are for {stats.world_size} ranks, topology has {topology.world_size}")
        return LayerPlacement(self.fit_phy2log(stats, topology), stats.num_experts, topology, self.replica_policy)

    def fit(self, stats: Sequence[ExpertStats], topology: Topology) -> PlacementPlan:
        """Fit every layer; ``stats[l]`` are the counts of layer l."""
        return PlacementPlan([self.fit_layer(s, topology) for s in stats])

    def score(self, layer: LayerPlacement, stats: ExpertStats) -> float:
        """How good ``layer`` is for ``stats`` (lower is better); the rebalancer compares
        plans with it. Default: expected max/mean rank load."""

        load = expected_load(layer, stats)
        return float(load.max() / max(load.mean(), 1e-12))


class ContiguousPlacement(Placement):
    """Experts in id order, S per rank; redundant slots repeat experts 0, 1, ... in order."""

    name = "contiguous"

    def fit_phy2log(self, stats: ExpertStats, topology: Topology) -> torch.Tensor:
        return contiguous_phy2log(stats.num_experts, self.num_redundant)


def contiguous_phy2log(num_experts: int, num_redundant: int = 0) -> torch.Tensor:
    return torch.arange(num_experts + num_redundant) % num_experts


_REGISTRY = {
    "contiguous": "engine.moe.placement:ContiguousPlacement",
    "balanced": "engine.moe.eplb:BalancedPlacement",
    "locality": "engine.moe.locality:LocalityPlacement",
}


def placement_names() -> list[str]:
    return list(_REGISTRY)


def get_placement(name: str, **kwargs) -> Placement:
    """Instantiate a registered placement (``contiguous``, ``balanced``, ``locality``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown placement {name!r}; choose from {placement_names()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def expected_load(layer: LayerPlacement, stats: ExpertStats) -> np.ndarray:
    m = replica_counts(layer.phy2log.numpy(), layer.num_experts, layer.world_size)
    return load_from_fractions(routing_fractions(m, layer.topology, layer.replica_policy), stats.source.numpy())


def simulate_dispatch(layer: LayerPlacement, topk_ids, src_rank, token_index=None) -> dict[str, float]:
    """Exact dispatch counts for given tokens, without communication (what ``ep.py`` would
    send): rows (one per token and destination rank) and token->expert pairs that leave the
    rank / node, and pairs served per rank. topk_ids [T, k], src_rank [T]."""
    import torch

    src = torch.as_tensor(src_rank, dtype=torch.long)
    phys = layer.choose_replica(topk_ids, src, token_index)  # (T, k)
    dest = phys // layer.slots_per_rank  # (T, k)
    rpn = layer.topology.ranks_per_node
    t = topk_ids.shape[0]
    rows = torch.unique(torch.arange(t)[:, None] * layer.world_size + dest)  # one per (token, dest)
    row_src, row_dest = src[rows // layer.world_size], rows % layer.world_size
    return {
        "tokens": float(t),
        "pairs": float(dest.numel()),
        "rows_off_rank": float((row_dest != row_src).sum()),
        "rows_off_node": float((row_dest // rpn != row_src // rpn).sum()),
        "pairs_off_rank": float((dest != src[:, None]).sum()),
        "pairs_off_node": float((dest // rpn != src[:, None] // rpn).sum()),
        "load": torch.bincount(dest.reshape(-1), minlength=layer.world_size).double().numpy(),
    }
