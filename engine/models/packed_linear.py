"""Float32 dense projections on the CPU through oneDNN's packed GEMM, where it measures faster than torch's.

``F.linear`` in float32 on the CPU calls MKL's sgemm. On AMD CPUs MKL takes its generic code path: on the
dev host class (AMD EPYC, Zen 4, one thread) a batch-1 step's projections and head of the default model (30
layers) ran 51.3 ms through it and 44.2 ms through oneDNN's GEMM on weights reordered once into its blocked
layout; at 3-23 rows, a speculative verification's or a small batch's step, 1.7-2.8x faster; at 256 rows, 1.18x
(benchmarks/packed_linear.py, benchmarks/results/packed_linear-epyc-cpu.json). Both are
IEEE float32 matmuls; they sum in different orders, as MKL itself does at different row counts, so a packed
layer's output equals ``F.linear``'s within float32 rounding (tests/engine/test_packed_linear.py), not bit for
bit.

``pack_dense_projections`` swaps a float32 model's decoder projections (``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``, engine/models/quant.py ``projections``) and its LM head for
``PackedLinear``: the reordered weight replaces the plain one (no second copy), except a head tied to the
embedding table, which keeps the table for the lookup (its bytes once more: 113 MB for the default model).
engine/models/cpu_pick.py ``pick_packed_linear`` decides, once per machine: both ways timed on this model's
shapes at one row and at a decode batch's rows (a step's projections and the head) and at a prefill chunk's rows
(one layer), rounds alternating, the best round of each kept, cached as JSON in the kernel cache beside the
quantization pick; packed where the geometric mean of its three time ratios is below 1 (on a 2-core Zen 3 EPYC,
AVX2 only: 1.3-1.8x faster at 2-23 rows, within a few percent at 1 and 256, benchmarks/results/
packed_linear-zen3-avx2-cpu.json). ``cpu_kernels=False`` keeps torch's ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def available() -> bool:
    """Whether this torch has oneDNN's packed linear (CPU builds with MKL-DNN have)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and \
        hasattr(ops, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``nn.Linear`` in float32 on a weight in oneDNN's blocked layout. ``weight`` gives the plain weight
    back (a copy: for reading, e.g. by a test; the layer multiplies by the packed one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedLinear: a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_dense_projections(model: nn.Module) -> int:
    """Swap ``model``'s float32 ``nn.Linear`` projections and its LM head for ``PackedLinear``, in place;
    returns how many layers now run packed."""
    from engine.models.quant import projections

    n = 0
    for parent, attr, _ in projections(model):
        linear = getattr(parent, attr)
        if type(linear) is nn.Linear and linear.weight.dtype == torch.float32:
            setattr(parent, attr, PackedLinear(linear.weight, linear.bias))
            n += 1
    head = model.lm_head
    if head is None or (type(head) is nn.Linear and head.weight.dtype == torch.float32):
        weight = model.embed_tokens.weight if head is None else head.weight
        if weight.dtype == torch.float32:
            model.lm_head = PackedLinear(weight, None if head is None else head.bias)
            n += 1
    return n


def step_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(out, in) of the first decoder layer's projections and of the LM head, for ``pick_packed_linear``."""
    from engine.models.quant import projections

    shapes = {}
    for parent, attr, _ in projections(model):
        layer = getattr(parent, attr)
        shapes.setdefault(attr.removesuffix("_proj"), (layer.out_features, layer.in_features))
    head = model.lm_head
    shapes["head"] = tuple(model.embed_tokens.weight.shape) if head is None else (head.out_features,
                                                                                  head.in_features)
    return shapes
