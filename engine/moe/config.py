"""Configuration of one Mixture-of-Experts block and of the expert-parallel topology.

Both dataclasses are frozen and validated at construction; derived values are
properties. ``MoEConfig.from_hf_config`` reads the ``config.json`` of the three
supported Hugging Face families with their real field names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")

# Hugging Face ``model_type`` -> our family name.
_HF_MODEL_TYPES = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe"}


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing rule of one MoE block (router gate + E SwiGLU experts).

    ``family`` fixes the routing rule and the weight names:
    - ``mixtral``: softmax over all E logits, top-k, always renormalised; no shared expert.
    - ``qwen2_moe``: softmax, top-k, renormalised only if ``norm_topk_prob``; an optional
      shared expert (``shared_expert_intermediate > 0``) scaled by sigmoid(shared_expert_gate).
    - ``qwen3_moe``: as qwen2_moe without a shared expert.
    """

    family: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    norm_topk_prob: bool = True
    shared_expert_intermediate: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for name in ("num_experts", "top_k", "hidden", "intermediate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if not isinstance(self.shared_expert_intermediate, int) or self.shared_expert_intermediate < 0:
            raise ValueError(
                f"shared_expert_intermediate must be an integer >= 0 (0 = none), "
                f"got {self.shared_expert_intermediate!r}"
            )
        if self.family != "qwen2_moe" and self.shared_expert_intermediate:
            raise ValueError(f"family {self.family!r} has no shared expert; set shared_expert_intermediate=0")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError("mixtral always renormalises the top-k weights; norm_topk_prob must be True")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate > 0

    @property
    def expert_numel(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.intermediate

    def expert_bytes(self, element_size: int = 4) -> int:
        """Bytes of one routed expert's weights at ``element_size`` bytes per parameter."""
        return self.expert_numel * element_size

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "MoEConfig":
        """Build from a Hugging Face ``config.json`` dict (MixtralForCausalLM, Qwen2MoeForCausalLM,
        Qwen3MoeForCausalLM)."""
        model_type = hf.get("model_type")
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"unsupported MoE model_type {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}")
        family = _HF_MODEL_TYPES[model_type]
        if family == "mixtral":
            return cls(
                family=family,
                num_experts=int(hf["num_local_experts"]),
                top_k=int(hf["num_experts_per_tok"]),
                hidden=int(hf["hidden_size"]),
                intermediate=int(hf["intermediate_size"]),
            )
        return cls(
            family=family,
            num_experts=int(hf.get("num_experts") or hf["num_local_experts"]),  # transformers 5 writes the latter
            top_k=int(hf["num_experts_per_tok"]),
            hidden=int(hf["hidden_size"]),
            intermediate=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # the transformers default for both
            shared_expert_intermediate=int(hf.get("shared_expert_intermediate_size", 0)) if family == "qwen2_moe" else 0,
        )


def moe_layer_indices(hf: dict[str, Any]) -> list[int]:
    """Indices of the decoder layers whose MLP is an MoE block, by the HF rules
    (Qwen: ``decoder_sparse_step`` and ``mlp_only_layers``; Mixtral: every layer)."""
    n = int(hf["num_hidden_layers"])
    if hf.get("model_type") == "mixtral":
        return list(range(n))
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers", []) or [])
    return [i for i in range(n) if i not in dense and step > 0 and (i + 1) % step == 0]


@dataclass(frozen=True)
class Topology:
    """Expert-parallel ranks laid out as ``nodes`` x ``ranks_per_node``; rank r is on node
    ``r // ranks_per_node`` (ranks of one node are consecutive, as torchrun numbers them)."""

    nodes: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        if not 0 <= node < self.nodes:
            raise ValueError(f"node {node} outside [0, {self.nodes})")
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)
