"""Rotary position embeddings: every RoPE type the loaders accept, as inverse-frequency tables.

``inv_freq(cfg, seq_len)`` computes a type's inverse frequencies and attention scaling exactly as
transformers' ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` does (float32, the same operations; tested
against it in tests/engine/test_rope.py). ``RotaryEmbedding`` turns them into cos / sin tables over the
context, scaled by the attention factor (yarn, longrope), and hands a step its rows (``RopeTable``).

Types (``ModelConfig.rope_scaling["rope_type"]``; absent = ``default``): ``linear`` (positions divided
by ``factor``), ``dynamic`` (NTK: the base grows with a sequence past ``max_position_embeddings``; the
engine's context never passes it, so it is the default table there, as in transformers), ``llama3``,
``yarn`` (ramped interpolation + attention factor / mscale), ``longrope`` (Phi-3: per-dimension short
factors, long factors for sequences past ``original_max_position_embeddings``: see RotaryEmbedding) and ``factors``
(llama.cpp's ``rope_freqs`` tensor, how its converter stores ``llama3``: inverse frequencies divided
per dimension).
``partial_rotary_factor`` < 1 rotates only the first ``rotary_dim`` dimensions of each head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# rope_type -> (required parameters, optional parameters); rope_type and rope_theta always allowed
ROPE_PARAMS: dict[str, tuple[frozenset, frozenset]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor"}), frozenset()),
    "llama3": (frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"})),
    "longrope": (frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
                 frozenset({"factor", "attention_factor"})),
    "factors": (frozenset({"freq_factors"}), frozenset()),
}


def check_rope_scaling(rope: dict, where: str) -> None:
    """Refuse a RoPE dict we do not implement exactly: an unknown type, a missing or unknown parameter."""
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_PARAMS:
        raise ValueError(f"{where}: rope_scaling.rope_type {kind!r} is not supported "
                         f"(supported: {sorted(ROPE_PARAMS)})")
    required, optional = ROPE_PARAMS[kind]
    missing = sorted(k for k in required if rope.get(k) is None)
    if missing:
        raise ValueError(f"{where}: rope_scaling of type {kind!r} needs {missing}")
    unknown = sorted(set(rope) - required - optional - {"rope_type", "rope_theta"})
    if unknown:
        raise ValueError(f"{where}: rope_scaling field {unknown[0]!r} = {rope[unknown[0]]!r} is not supported "
                         f"for rope_type {kind!r} (known: {sorted(required | optional)})")


def rotary_dim(cfg) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def inv_freq(cfg, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inverse frequencies (rotary_dim / 2,) float32, attention scaling)`` of ``cfg`` (a ModelConfig) for a
    sequence of ``seq_len`` tokens (only ``dynamic`` and ``longrope`` depend on it)."""
    rope, dim, base = cfg.rope_scaling, rotary_dim(cfg), cfg.rope_theta
    kind = rope.get("rope_type", "default")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim       # (dim/2,)
    default = 1.0 / (base ** shape)
    if kind == "default":
        return default, 1.0
    if kind == "linear":
        return default / rope["factor"], 1.0
    if kind == "dynamic":
        mpe, factor = cfg.max_position_embeddings, rope["factor"]
        seq_len = max(seq_len or mpe, mpe)
        base = base * ((factor * seq_len / mpe) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** shape), 1.0
    if kind == "llama3":
        return _llama3(default, rope), 1.0
    if kind == "yarn":
        return _yarn(cfg, rope, dim, base)
    if kind == "longrope":
        return _longrope(cfg, rope, shape, base, seq_len)
    return default / torch.tensor(rope["freq_factors"], dtype=torch.float32), 1.0


def _llama3(inv: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)       # long waves: divided by factor
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled           # between: interpolated
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(cfg, rope: dict, dim: int, base: float) -> tuple[torch.Tensor, float]:
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp                                                  # (dim/2,) 1 = keep the frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def _longrope(cfg, rope: dict, shape: torch.Tensor, base: float, seq_len: int | None):
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / orig
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = rope["long_factor"] if seq_len and seq_len > orig else rope["short_factor"]
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base ** shape), attention


def long_switch(cfg) -> int | None:
    """The sequence length past which a second (long) table applies, or None for one table."""
    rope = cfg.rope_scaling
    return int(rope["original_max_position_embeddings"]) if rope.get("rope_type") == "longrope" else None


def _cos_sin(inv: torch.Tensor, max_pos: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv.double())   # (max_pos, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                          # (max_pos, R)
    return (emb.cos() * scale).float(), (emb.sin() * scale).float()


def _tables(cfg, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos / sin tables of ``cfg`` (for ``seq_len``: see ``inv_freq``). Under ``torch.device("meta")``
    (a model's skeleton, built before its weights are placed) only their shapes: a model is given its real
    tables on its device afterwards (``build_model``), and arithmetic on meta tensors would import
    torch._dynamo for its decompositions, ~1.5 s of every process's start."""
    if torch.empty(0).is_meta:
        shape = (cfg.max_position_embeddings, rotary_dim(cfg))
        return torch.empty(shape), torch.empty(shape)
    inv, scale = inv_freq(cfg, seq_len)
    return _cos_sin(inv, cfg.max_position_embeddings, scale)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face layout) with precomputed cos / sin tables.

    ``longrope`` has two tables, short and long factors. transformers picks by the sequence's length and,
    when a sequence crosses ``original_max_position_embeddings`` while decoding, drops its KV cache and
    recomputes every token with the long factors (Phi3's ``prepare_inputs_for_generation``): a sequence
    past that length is all long factors, one within it all short. A paged prefix cache shares keys
    between sequences of every length, so here, as in llama.cpp, the choice is the engine's context:
    long factors when it can pass the original length (``fit_context``), short when it cannot. That is
    transformers' answer for every sequence past the original length, and for every sequence of an
    engine whose context is at most the original length; a shorter sequence of a long-context engine
    gets the long factors (transformers: short until it crosses)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.rotary_dim, self.head_dim = rotary_dim(cfg), cfg.head_dim
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"partial_rotary_factor {cfg.partial_rotary_factor}: rotary dimension "
                             f"{self.rotary_dim} of head_dim {cfg.head_dim} must be even and positive")
        self.switch = long_switch(cfg)
        cos, sin = _tables(cfg, None)
        self.register_buffer("cos_short", cos, persistent=False)
        self.register_buffer("sin_short", sin, persistent=False)
        if self.switch is not None:
            cos, sin = _tables(cfg, self.switch + 1)
            self.register_buffer("cos_long", cos, persistent=False)
            self.register_buffer("sin_long", sin, persistent=False)
        self.fit_context(cfg.max_position_embeddings)

    def fit_context(self, context_len: int) -> None:
        """Use the long table (longrope) when a sequence of ``context_len`` tokens passes the switch."""
        self.long = self.switch is not None and context_len > self.switch

    @property
    def partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeTable":
        """This step's cos/sin rows, gathered once for every layer. positions: (T,)."""
        cos, sin = (self.cos_long, self.sin_long) if self.long else (self.cos_short, self.sin_short)
        sin = sin[positions].unsqueeze(1).to(dtype)                             # (T, 1, R)
        half = sin.shape[-1] // 2
        return RopeTable(cos[positions].unsqueeze(1).to(dtype),
                         torch.cat([-sin[..., :half], sin[..., half:]], dim=-1), self.partial)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: (T, H, D); positions: (T,)
        return self.table(positions, x.dtype).apply(x)


class RopeTable:
    """cos and sign-folded sin of one step's positions, (T, 1, R) each, applied to any (T, H, D) heads
    (R = D, or the first R dimensions with ``partial``).

    Rotate-half RoPE is ``x * cos + cat(-x2, x1) * sin`` (x1, x2 the halves of x); ``cat(x2, x1)`` is
    ``x.roll(R/2)``, so with ``signed_sin = cat(-sin1, sin2)`` it is ``x * cos + x.roll(R/2) * signed_sin``:
    the same products, bit for bit, in four operations instead of seven."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor, partial: bool = False) -> None:
        self.cos, self.signed_sin, self.partial = cos, signed_sin, partial

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if not self.partial:
            return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin
        R = self.cos.shape[-1]
        rot = x[..., :R]                                                        # (T, H, R)
        return torch.cat([rot * self.cos + rot.roll(R // 2, dims=-1) * self.signed_sin, x[..., R:]], dim=-1)
