"""Gemma 3 text decoder (Gemma3ForCausalLM) over a flattened token batch.

Where it differs from the Llama skeleton (engine/models/llama.py), as transformers computes it:
- local (sliding) and global layers interleave (``ModelConfig.sliding_windows``), and each kind has
  its own RoPE (``local_rope``: base 10k; ``global_rope``: base 1M, linear factor 8 in the 4B+
  checkpoints; any type of engine/models/rope.py, as transformers' per-layer-type RoPE): one table per
  kind a step;
- sandwich norms: ``x + post_attn_norm(attn(in_norm(x)))``, then ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``;
- every RMSNorm (q/k norms too) scales by ``1 + w``: folded into the weight once at load, in float32,
  the same products as transformers' ``norm(x.float()) * (1.0 + w.float())``;
- GeGLU MLP (``gelu_pytorch_tanh(gate) * up``); embeddings scaled by ``sqrt(hidden)`` in the model
  dtype; attention scores scaled by ``query_pre_attn_scalar ** -0.5``; final logits optionally
  soft-capped (``final_logit_softcapping``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import LayerAttention
from engine.loader.model_config import ModelConfig
from engine.models.llama import MLP, Attention, LlamaModel, RMSNorm, RotaryEmbedding, RopeTable


class GeGLU(MLP):
    """``down(gelu_tanh(gate) * up)``, gate and up in one fused projection as ``MLP``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)   # (T, I) each
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.sliding = cfg.sliding_windows[layer_idx] is not None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RopeTable, attn) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


def _ropes(cfg: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """The global layers' RoPE and the local (sliding) layers' one, each with its own base and scaling."""
    (g_theta, g_scaling), (l_theta, l_scaling) = cfg.family_settings["global_rope"], cfg.family_settings["local_rope"]
    return (RotaryEmbedding(dataclasses.replace(cfg, rope_theta=g_theta, rope_scaling=g_scaling)),
            RotaryEmbedding(dataclasses.replace(cfg, rope_theta=l_theta, rope_scaling=l_scaling)))


class Gemma3Model(LlamaModel):
    """Built on the meta device (``build_gemma3``): the Llama layers ``LlamaModel`` makes cost nothing
    there and are replaced by Gemma's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.rope, self.local_rope = _ropes(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, d)."""
        x = self.embed_tokens(input_ids)                                     # (T, d)
        x = x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)  # rounded to x's dtype first, as HF
        tables = {False: self.rope.table(positions, x.dtype), True: self.local_rope.table(positions, x.dtype)}
        for layer in self.layers:
            x = layer(x, tables[layer.sliding], attn)
        return self.norm(x)

    def use_cpu_ops(self, enabled: bool) -> bool:
        """The fused add + RMSNorm path assumes the Llama layer; sandwich norms stay on plain torch."""
        self.cpu_ops = None
        return False

    def layer_attention(self) -> list[LayerAttention]:
        scale = self.cfg.family_settings["query_pre_attn_scalar"] ** -0.5
        return [LayerAttention(window=w, scale=scale) for w in self.cfg.sliding_windows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)                             # (B, vocab) float32
        cap = self.cfg.family_settings["final_logit_softcapping"]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fold_norm_offsets(self) -> None:
        """Gemma's ``(1 + w)`` norms as plain RMSNorms: each weight becomes ``1 + w`` in float32."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.float() + 1.0


def build_gemma3(cfg: ModelConfig, state: dict, dtype: torch.dtype, device: str) -> Gemma3Model:
    with torch.device("meta"):
        model = Gemma3Model(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rope, model.local_rope = (r.to(device) for r in _ropes(cfg))
    model.load_hf_state_dict(state)
    model.fold_norm_offsets()
    return model.eval()
