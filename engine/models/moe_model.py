"""Mixture-of-Experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama decoder whose MLP
is an MoE block in the layers ``engine.moe.moe_layer_indices`` names (Qwen keeps dense MLPs
in ``mlp_only_layers`` / off the ``decoder_sparse_step``).

Single process, each MoE layer is an ``engine.moe.MoEBlock``. With expert parallelism
(``ep``: an ``engine.moe.ep_group.ExpertParallelGroup``) it is that group's rank-0 layer,
which holds only rank 0's expert slots and dispatches with the worker ranks; every forward
is then announced to the workers first (``ep.step``). Attention biases (Qwen2) and q/k norms
(Qwen3) come from ``ModelConfig`` as for dense models.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.loader.model_config import ModelConfig
from engine.models.llama import LlamaModel, copy_hf_weights
from engine.moe.config import MoEConfig, moe_layer_indices
from engine.moe.layers import MoEBlock


class MoEModel(LlamaModel):
    """``LlamaModel`` with ``make_moe()`` modules (each with ``load_hf(state, layer_prefix)``)
    as the MLP of ``moe_layers``."""

    def __init__(self, cfg: ModelConfig, moe_layers: list[int], make_moe, ep=None) -> None:
        moe = set(moe_layers)
        super().__init__(cfg, mlp_factory=lambda i: make_moe() if i in moe else None)
        self.moe_layers = sorted(moe)
        self.ep = ep

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        if self.ep is None:
            return super().forward(input_ids, positions, attn)
        with self.ep.step(int(input_ids.shape[0])):
            return super().forward(input_ids, positions, attn)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Dense weights by HF name as ``LlamaModel`` does; MoE blocks by their HF names
        (``block_sparse_moe.*`` for Mixtral, ``mlp.*`` for Qwen), read only as needed."""
        copy_hf_weights(self, state, skip=tuple(f"layers.{i}.mlp." for i in self.moe_layers))
        for i in self.moe_layers:
            self.layers[i].mlp.load_hf(state, f"model.layers.{i}.")


def build_moe_model(cfg: ModelConfig, state: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str,
                    ep=None) -> MoEModel:
    """Build and load an MoE decoder. ``cfg.moe["hf_config"]`` is the checkpoint's config.json.
    With ``ep`` (an ``ExpertParallelGroup`` already launched) rank 0 allocates only its own
    expert slots, then joins the workers (``ep.connect``)."""
    hf = cfg.moe["hf_config"]
    moe_cfg = MoEConfig.from_hf_config(hf)
    make_moe = ep.moe_layer if ep is not None else (lambda: MoEBlock(moe_cfg))
    with torch.device("meta"):
        model = MoEModel(cfg, moe_layer_indices(hf), make_moe, ep)
    model = model.to_empty(device=device).to(dtype)
    model.rope = model.rope.__class__(cfg).to(device)
    with torch.no_grad():
        model.load_hf_state_dict(state)
    if ep is not None:
        ep.connect()
    return model.eval()


__all__ = ["MoEModel", "build_moe_model"]
