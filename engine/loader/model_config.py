"""The architecture description every loader produces and the model consumes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama, Qwen2/3, Mistral, Phi-3; MoE variants add ``moe``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # Qwen2 puts biases on q/k/v
    qk_norm: bool = False          # Qwen3 RMS-normalises q and k per head
    # RoPE scaling in Hugging Face names ({"rope_type": ..., parameters}; empty = default), engine/models/rope.py
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0   # rotate the first head_dim * this dimensions of each head
    moe: dict[str, Any] = field(default_factory=dict)  # empty for dense models
    # per layer: its attention's sliding window (None: the whole context); empty: no layer slides
    sliding_windows: tuple[int | None, ...] = ()
    # what only one family has (Gemma 3, gpt-oss), read by engine/loader/hf_families.py
    family_settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"model config: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        from engine.models.rope import check_rope_scaling
        check_rope_scaling(self.rope_scaling, "model config")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"model config: sliding_windows has {len(self.sliding_windows)} entries "
                             f"for {self.num_layers} layers")
