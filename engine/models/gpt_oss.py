"""gpt-oss decoder (GptOssForCausalLM) over a flattened token batch.

The Llama skeleton (engine/models/llama.py) with, as transformers computes it:
- attention with q/k/v/o biases, a learned sink logit per query head (``self_attn.sinks``, in every
  row's softmax denominator) and sliding / full layers alternating (``ModelConfig.sliding_windows``);
- an MoE MLP in every layer: a router with a bias, top-k over the raw logits and a softmax over
  those k only; experts whose fused ``gate_up_proj`` (E, H, 2I) interleaves gate and up columns,
  with biases, and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``,
  ``g = clamp(gate, max=l)``.

RoPE is ``ModelConfig.rope_scaling``'s (engine/models/rope.py): the released checkpoints' ``yarn``
(factor 32, beta_fast 32, beta_slow 1, original length 4096, ``truncate`` false, so the ramp's ends are
not rounded) with its attention factor ``0.1 ln(32) + 1`` on cos and sin, as transformers computes it.
transformers' GptOss rotates the two halves of each head (``_apply_rotary_emb``): rotate-half RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import LayerAttention
from engine.loader.model_config import ModelConfig
from engine.models.llama import Attention, LlamaModel, RotaryEmbedding, keep_float32_norms


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (expert ids (T, k), weights (T, k)): softmax over the k largest logits only."""
        logits = nn.functional.linear(x, self.weight, self.bias)             # (T, E)
        top, ids = torch.topk(logits, self.top_k, dim=-1)                    # (T, k)
        return ids, torch.softmax(top, dim=-1)


class GptOssExperts(nn.Module):
    """E experts in the checkpoint's layout: gate_up_proj (E, H, 2I) with gate in the even columns and
    up in the odd ones, down_proj (E, I, H); each with a bias."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.alpha, self.limit = alpha, limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x (N, H) -> (N, H)."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]       # (N, 2I)
        gate = gate_up[:, ::2].clamp(max=self.limit)                          # (N, I)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)          # (N, I)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, H); ids, weights (T, k) -> sum over each token's k experts of weight * expert(x)."""
        out = torch.zeros_like(x)                                             # (T, H)
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)                     # (n,) each
            out.index_add_(0, tok, self.expert(e, x[tok]) * weights[tok, slot, None].to(x.dtype))
        return out


class GptOssMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        s = cfg.family_settings
        self.router = GptOssRouter(cfg.hidden_size, s["num_experts"], s["top_k"])
        self.experts = GptOssExperts(s["num_experts"], cfg.hidden_size, cfg.intermediate_size,
                                     s["swiglu_alpha"], s["swiglu_limit"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        return self.experts(x, ids, weights)


class GptOssModel(LlamaModel):
    """Built on the meta device (``build_gpt_oss``); each layer's attention gains an output bias and
    its sinks (``layers.N.self_attn.sinks``, the checkpoint's name)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, mlp_factory=lambda i: GptOssMLP(cfg))
        for i, layer in enumerate(self.layers):
            layer.self_attn = Attention(cfg, i, o_bias=True)
            layer.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def layer_attention(self) -> list[LayerAttention]:
        return [LayerAttention(window=w, sinks=layer.self_attn.sinks.detach())
                for w, layer in zip(self.cfg.sliding_windows, self.layers)]


def build_gpt_oss(cfg: ModelConfig, state: dict, dtype: torch.dtype, device: str) -> GptOssModel:
    with torch.device("meta"):
        model = GptOssModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rope = RotaryEmbedding(cfg).to(device)
    with torch.no_grad():
        model.load_hf_state_dict(state)
    keep_float32_norms(model)
    return model.eval()
