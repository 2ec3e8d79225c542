"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

Every request's new tokens of this step are concatenated into one ``[T]`` batch
(vLLM style): linear layers see ``[T, d]``; attention is the backend's job, which
reads and writes the paged KV cache using per-step metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.loader.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_pos: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_pos, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)                       # (max_pos, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)                # (max_pos, D)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (T, H, D); positions: (T,)
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)     # (T, 1, D)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.hd)           # (T, Hq, D)
        k = self.k_proj(x).view(T, self.nkv, self.hd)          # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions), rope(k, positions)
        out = attn.forward(self.layer_idx, q, k, v)            # (T, Hq, D)
        return self.o_proj(out.reshape(T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, positions, rope, attn):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``mlp_factory(layer_idx)`` lets MoE models swap the MLP."""

    def __init__(self, cfg: ModelConfig, mlp_factory=None) -> None:
        super().__init__()
        self.cfg = cfg
        # no random init: weights are always loaded, and nn.Embedding's normal_ on the meta device imports
        # torch._dynamo (3 s of every engine start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, mlp_factory(i) if mlp_factory else None) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, d)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rope, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, d) -> (B, vocab) in float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return (hidden @ w.t()).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights named as in Hugging Face checkpoints (``model.layers.N...``)."""
        own = self.state_dict()
        missing = []
        for name in own:
            src = name if name.startswith("lm_head") else "model." + name
            if src not in state:
                missing.append(src)
                continue
            if state[src].shape != own[name].shape:
                raise ValueError(f"weight {src}: shape {tuple(state[src].shape)} != expected {tuple(own[name].shape)}")
            own[name].copy_(state[src])
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
