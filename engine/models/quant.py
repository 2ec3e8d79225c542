"""Weight-only quantized linear layers for the CPU: 4-bit in groups along K, 8-bit per output row.

At small batches a decode step reads every weight once and does little with it, so its time is the
time to stream the weights from memory: SmolLM2-135M is 540 MB in float32, 270 MB in bfloat16 and
about 75 MB in 4 bits. A GGUF file's Q4_0 / Q4_1 blocks are already what torch's CPU int4 kernel
multiplies: 32 weights along K sharing one scale and one offset. ``Int4Groups.from_blocks`` takes them
as they are (no requantization), ``quantize_int4`` makes the same groups from float weights
(round-to-nearest between each group's min and max, as Q4_1 does).

Kernels (torch's own, ATen CPU):

* ``aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``: ``w = (q - 8) * scale + zero``
  per group, q in 0..15, weights packed by ``aten._convert_weight_to_int4pack_for_cpu``;
* ``aten._weight_int8pack_mm(x, q, scales)``: ``w = q * scale`` per output row, q int8.

Both are vectorised for bfloat16 activations only (their float32 paths are scalar loops, 10-30x
slower), so a quantized layer multiplies in bfloat16 and returns the caller's dtype; the engine uses
them with bfloat16 activations (``EngineConfig.quantization``). They win only where a step reads
weights for a few rows (decode at small batches): a layer given its ``dense`` bf16 weight as well runs
steps of more than ``MAX_QUANT_ROWS`` rows (prefill chunks, large decode batches) as a plain bf16
matmul on it, so prefill keeps the bf16 speed; that copy costs 2 bytes per weight beside the 0.5 of
the 4-bit one (the model's own bf16 weights, kept; a tied LM head's is the embedding table).
Scales are held in bfloat16, as the kernels take them: the weights a layer multiplies by are
``Int4Groups.kernel_weight()`` / ``Int8Linear.kernel_weight()`` (the q with the bfloat16 scales),
which tests/engine/test_quant.py uses, through ``reference_linear``, as the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32   # a GGUF block: the group size of Q4_0 / Q4_1 and of quantize_int4
# Rows (tokens) up to which the packed kernels beat a bf16 matmul on this weight's dense copy: they win
# 2-3x at 1-4 rows and lose 2-3x from 16 rows on (prefill chunks), where the matmul is compute-bound and
# the kernel dequantizes as it goes (measured at SmolLM2-135M's shapes on a 2-core AVX512-BF16 CPU:
# fused qkv + gate_up + down at 8 rows 269 us int4 vs 304 us bf16, at 16 rows 516 vs 346, at 512 rows
# 17.4 vs 5.4 ms; the 49k-row LM head at 8 rows 2.3 vs 3.4 ms int8, at 16 rows 4.5 vs 3.4 ms).
MAX_QUANT_ROWS = 8


def kernels_available() -> bool:
    """Whether this torch build has the CPU packed kernels (2.6 and later)."""
    ops = torch.ops.aten
    return all(hasattr(ops, name) for name in
               ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_weight_int8pack_mm"))


@dataclass(frozen=True)
class Int4Groups:
    """4-bit weights: ``w[n, k] = scale[n, k // G] * q[n, k] + minimum[n, k // G]``, q in 0..15."""

    q: torch.Tensor         # (N, K) uint8
    scale: torch.Tensor     # (N, K // G) float32
    minimum: torch.Tensor   # (N, K // G) float32

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, computed as GGUF's Q4_1 dequantization does (``scale * q + minimum``)."""
        G = self.group_size
        N, K = self.q.shape
        w = self.scale[:, :, None] * self.q.view(N, K // G, G).float() + self.minimum[:, :, None]
        return w.reshape(N, K)

    def kernel_weight(self) -> torch.Tensor:
        """(N, K) float32: the weights torch's int4 kernel multiplies by for these groups, whose scales
        and zeros it holds in bfloat16 (the oracle of ``Int4Linear``)."""
        G = self.group_size
        N, K = self.q.shape
        s = self.scale.to(torch.bfloat16).float()
        z = (self.minimum + 8 * self.scale).to(torch.bfloat16).float()
        w = (self.q.view(N, K // G, G).float() - 8) * s[:, :, None] + z[:, :, None]
        return w.reshape(N, K)

    def rows(self, index: torch.Tensor) -> "Int4Groups":
        """The groups of these output rows, in this order (llama.cpp's q/k row permutation undone)."""
        return Int4Groups(self.q[index], self.scale[index], self.minimum[index])

    @staticmethod
    def cat(parts: list["Int4Groups"]) -> "Int4Groups":
        """Output rows of several layers stacked (one fused q/k/v or gate/up matmul)."""
        return Int4Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.minimum for p in parts]))

    @staticmethod
    def from_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, n_rows: int) -> "Int4Groups":
        """Blocks of 32 along K in row-major order (``engine.loader.gguf_file.q4_blocks``: q (blocks, 32),
        d and m (blocks, 1), ``w = d * q + m``) as the groups of an (n_rows, K) weight."""
        return Int4Groups(q.reshape(n_rows, -1).contiguous(), d.reshape(n_rows, -1), m.reshape(n_rows, -1))


def quantize_int4(w: torch.Tensor, group_size: int = GROUP) -> Int4Groups:
    """Round-to-nearest 4-bit groups between each group's min and max (Q4_1's scheme). w: (N, K)."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 quantization needs in_features ({K}) to be a multiple of {group_size}")
    g = w.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(N, K), scale, lo)


def _rows_bf16(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, K) bfloat16, without a call where it already is (a decode step makes 121 of these)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


def _like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y (rows, N) in x's dtype and leading shape."""
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


class Int4Linear(nn.Module):
    """``y = x @ w.T + b`` with 4-bit group-wise weights (torch's CPU int4 kernel)."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        N, K = groups.q.shape
        self.in_features, self.out_features, self.group_size = K, N, groups.group_size
        if K % 2 or N % 8:
            raise ValueError(f"int4 weights need an even in_features and out_features divisible by 8, got {N}x{K}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        # the kernel's (q - 8) * scale + zero is scale * q + minimum with zero = minimum + 8 * scale
        sz = torch.stack([groups.scale.t(), (groups.minimum + 8 * groups.scale).t()], dim=-1)  # (K/G, N, 2)
        self.register_buffer("scales_and_zeros", sz.contiguous().to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.register_buffer("dense", _dense(dense, N, K), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows_bf16(x)                                                     # (T, K)
        if self.dense is not None and x2.shape[0] > MAX_QUANT_ROWS:
            return _like(F.linear(x2, self.dense, self.bias), x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return _like(y, x)                                                     # (..., N)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Int8Linear(nn.Module):
    """``y = x @ w.T + b`` with 8-bit weights, one symmetric scale per output row (torch's CPU kernel)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()                                         # (N, K)
        self.out_features, self.in_features = w.shape
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16)
        q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("q", q)
        self.register_buffer("scales", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.register_buffer("dense", _dense(dense, self.out_features, self.in_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows_bf16(x)                                                     # (T, K)
        if self.dense is not None and x2.shape[0] > MAX_QUANT_ROWS:
            return _like(F.linear(x2, self.dense, self.bias), x)
        y = torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return _like(y, x)

    def kernel_weight(self) -> torch.Tensor:
        """(N, K) float32: the weights this layer multiplies by (the oracle's)."""
        return self.q.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _dense(weight: torch.Tensor | None, N: int, K: int) -> torch.Tensor | None:
    """A layer's bf16 weight for steps of many rows (shared with the model when it is bf16 already)."""
    if weight is None:
        return None
    if tuple(weight.shape) != (N, K):
        raise ValueError(f"dense weight shape {tuple(weight.shape)} != ({N}, {K})")
    return weight.detach().to(torch.bfloat16)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain oracle of a quantized layer: bfloat16-rounded inputs times the weights its kernel
    multiplies by (``Int4Groups.kernel_weight``, ``Int8Linear.kernel_weight``), in float32.
    x: (..., K) -> (..., N) float32."""
    return F.linear(x.to(torch.bfloat16).float(), weight, None if bias is None else bias.to(torch.bfloat16).float())


def projections(model: nn.Module):
    """``(parent module, attribute, checkpoint names of its weight: its own name, then the parts it is
    stacked from)`` of every decoder layer's dense projection: ``qkv_proj``, ``o_proj`` and (dense MLPs only; MoE experts stay as they are)
    ``gate_up_proj`` and ``down_proj``."""
    from engine.models.llama import MLP, hf_sources

    for i, layer in enumerate(model.layers):
        targets = [(layer.self_attn, "self_attn", "qkv_proj"), (layer.self_attn, "self_attn", "o_proj")]
        if isinstance(layer.mlp, MLP):
            targets += [(layer.mlp, "mlp", "gate_up_proj"), (layer.mlp, "mlp", "down_proj")]
        for parent, parent_name, attr in targets:
            name = f"layers.{i}.{parent_name}.{attr}.weight"
            yield parent, attr, ["model." + name] + hf_sources(name)


def stored_parts(blocks: dict, sources: list[str]) -> list:
    """A projection's stored blocks from ``projections``' ``sources``: the weight's own where the file stores
    it fused (Phi-3's attn_qkv / ffn_up), else its parts' (None where a part has none)."""
    fused, parts = sources[0], sources[1:]
    if fused in blocks and fused not in parts:
        return [blocks[fused]]
    return [blocks.get(src) for src in parts]


def quantize_model(model: nn.Module, mode: str, int4_groups: dict | None = None, keep_dense: bool = True) -> None:
    """Swap a loaded ``LlamaModel``'s dense projections for quantized layers, in place: every decoder
    layer's ``qkv_proj``, ``o_proj`` and (dense MLPs only; MoE experts stay as they are) ``gate_up_proj``
    and ``down_proj``, and the LM head (8-bit per row; a tied head gets its own 8-bit copy, the
    embedding table stays for the lookup). ``mode``: ``int4`` or ``int8``. ``int4_groups``: a GGUF file's
    4-bit blocks by HF name (``engine.loader.ModelFiles.int4_groups``), used as stored where every part
    of a (fused) weight has them; other weights are quantized from their float values. ``keep_dense``:
    each layer keeps the model's weight in bf16 for steps of more than ``MAX_QUANT_ROWS`` rows."""
    if mode not in ("int4", "int8"):
        raise ValueError(f"quantize_model: mode must be 'int4' or 'int8', got {mode!r}")
    groups = int4_groups or {}
    for parent, attr, sources in projections(model):
        linear = getattr(parent, attr)
        dense = linear.weight if keep_dense else None
        if mode == "int8":
            setattr(parent, attr, Int8Linear(linear.weight, linear.bias, dense))
            continue
        parts = stored_parts(groups, sources)
        stored = all(isinstance(p, Int4Groups) for p in parts)     # not a part kept in 8-bit blocks
        weights = Int4Groups.cat(parts) if stored else quantize_int4(linear.weight)
        setattr(parent, attr, Int4Linear(weights, linear.bias, dense))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear(head, dense=head if keep_dense else None)
