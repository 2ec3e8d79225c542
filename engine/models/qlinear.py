"""``quantization="gguf"``: a model's dense projections multiply decode steps on the GGUF file's own blocks.

Every decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` and the LM head become
a ``BlockLinear``: steps of at most ``max_rows`` rows (decode, small batches, short verifications) run
through engine/models/csrc/qmatmul.c (activations quantized to 8 bits per block of 32, integer dot
products against the 4-bit / 8-bit weight blocks, out in the activations' dtype, float32 or bfloat16);
longer steps (prefill chunks) multiply the model's dense weights, or the blocks too where that measured
faster on this machine (``prefill_on_blocks``, engine/models/cpu_pick.py ``pick_prefill_on_blocks``); then no
step multiplies the dense weights and the engine's build releases them (``release_dense``: the default model's
projections in float32, 405 MiB).
The blocks are the file's as stored (Q4_0 / Q4_1 / Q4_K layers, Q4_K's super-blocks as eight blocks of 32;
a Q8_0 ``token_embd`` for a tied head); a layer the file stores in wider blocks (Q5_K, Q6_K, Q8_0, ...) runs on
8-bit blocks of its values, with any 4-bit part fused beside it requantized to 8 bits; a weight the file holds
in another form is quantized here (4-bit as Q4_1, round to nearest; the LM head to Q8_0), as is every weight of
a Hugging Face checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.qmatmul import KERNEL_DTYPES, Q4Blocks, Q8Blocks, QMatmulLib, load, pack
from engine.models.quant import MAX_QUANT_ROWS, Int4Groups, projections, quantize_int4, stored_parts


class BlockLinear(nn.Module):
    """``y = x @ w.T + b`` on weight blocks for steps of at most ``max_rows`` rows (None: every step), on
    ``dense`` above."""

    def __init__(self, lib: QMatmulLib, blocks: Q4Blocks | Q8Blocks, dense: torch.Tensor,
                 bias: torch.Tensor | None = None, max_rows: int | None = MAX_QUANT_ROWS) -> None:
        super().__init__()
        self.lib, self.max_rows = lib, max_rows
        self.packed = pack(blocks)                       # the kernel's layout; the only copy kept
        self.out_features, self.in_features = blocks.shape
        if tuple(dense.shape) != blocks.shape:
            raise ValueError(f"dense weight shape {tuple(dense.shape)} != blocks' {blocks.shape}")
        self.register_buffer("dense", dense.detach(), persistent=False)    # the model's own weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise RuntimeError(f"BlockLinear: an input of {x.shape[-1]} features; this layer takes {self.in_features}")
        if self.max_rows is not None and x.numel() > self.max_rows * self.in_features:
            return F.linear(x, self.dense, self.bias)                          # (prefill: many rows)
        if x.dtype in KERNEL_DTYPES and x.is_contiguous():
            y = self.lib.run(x, self.packed)                                   # (..., N) in x's dtype
        else:
            y = self.lib.run(x.float().contiguous(), self.packed).to(x.dtype)
        return y if self.bias is None else (y + self.bias).to(x.dtype)

    def swiglu(self, down: "BlockLinear", x: torch.Tensor) -> torch.Tensor | None:
        """This layer as a SwiGLU MLP's fused gate/up projection followed by ``down``, in one kernel call
        (``down(silu(gate) * up)``): the same values as the three calls, for the float32 decode steps the
        kernel runs (x contiguous, few rows, 4-bit blocks, no biases); None for any other step."""
        step = x.dtype is torch.float32 and x.dim() == 2 and x.is_contiguous() and x.shape[1] == self.in_features
        if not (step and isinstance(down, BlockLinear) and down.in_features * 2 == self.out_features
                and _fits(x.shape[0], self.max_rows) and _fits(x.shape[0], down.max_rows)
                and self.bias is None and down.bias is None and self.packed.bits == 4 and down.packed.bits == 4):
            return None
        return self.lib.swiglu(x, self.packed, down.packed)

    @property
    def blocks(self) -> Q4Blocks | Q8Blocks:
        """The weight blocks this layer multiplies by (unpacked anew: for inspection and tests)."""
        return self.packed.unpack()

    def extra_repr(self) -> str:
        kind = f"{self.packed.bits}-bit"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind} blocks, "
                f"max_rows={self.max_rows}, kernel={self.lib.variant}")


def _fits(rows: int, max_rows: int | None) -> bool:
    return max_rows is None or rows <= max_rows


def prefill_on_blocks(model: nn.Module, enabled: bool) -> None:
    """Every ``BlockLinear`` of ``model`` runs steps of any size on its blocks (``enabled``), or only steps
    of at most ``MAX_QUANT_ROWS`` rows, the longer ones on its dense weight (``ValueError`` where
    ``release_dense`` has dropped it)."""
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    if not enabled and any(m.dense is None for m in layers):
        raise ValueError("prefill on the dense weights: this model's build released them (its prefill ran on the "
                         "blocks); build it with engine.models.qlinear.RELEASE_DENSE = False to switch back")
    for m in layers:
        m.max_rows = None if enabled else MAX_QUANT_ROWS


# Whether a build whose prefill runs on the blocks drops the dense weights (``release_dense``). A benchmark or test
# that switches a built engine's prefill back to the dense weights (benchmarks/prefill_profile.py --ab) sets it False
# before building.
RELEASE_DENSE = True


def release_dense(model: nn.Module) -> int:
    """Drop the dense weight of every ``BlockLinear`` of ``model`` that runs every step on its blocks (its
    ``max_rows`` None): nothing multiplies by it. Returns the bytes released (a weight another module still holds,
    a tied LM head's embedding table, stays alive there and is not counted)."""
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    released = 0
    for m in model.modules():
        if isinstance(m, BlockLinear) and m.max_rows is None and m.dense is not None:
            if m.dense.untyped_storage().data_ptr() not in held:
                released += m.dense.numel() * m.dense.element_size()
            m.dense = None
    return released


def _layer_blocks(parts: list, weight: torch.Tensor) -> Q4Blocks | Q8Blocks:
    """A (fused) layer's blocks: the file's 4-bit ones where every part has them; 8-bit ones where every part
    has blocks and one is stored in more bits (Q6_K, Q8_0, ...: the loader's ``Q8Blocks``; the 4-bit parts'
    values requantized to 8 bits beside it, within half an 8-bit step); else Q4_1 from its weight."""
    if parts and all(isinstance(p, Int4Groups) and p.group_size == 32 for p in parts):
        return Q4Blocks.from_groups(Int4Groups.cat(parts))
    if parts and all(p is not None for p in parts) and any(isinstance(p, Q8Blocks) for p in parts):
        q8 = [p if isinstance(p, Q8Blocks) else Q8Blocks.quantize(p.dequantize()) for p in parts]
        return Q8Blocks(torch.cat([p.qs for p in q8]), torch.cat([p.d for p in q8]))
    return Q4Blocks.from_groups(quantize_int4(weight))


def quantize_model_blocks(model: nn.Module, blocks: dict | None = None, lib: QMatmulLib | None = None) -> None:
    """Swap a loaded ``LlamaModel``'s dense projections (dense MLPs; MoE experts stay as they are) and
    its LM head for ``BlockLinear`` layers, in place. ``blocks``: a GGUF file's blocks by HF name
    (``engine.loader.ModelFiles.int4_groups``: ``Int4Groups`` of Q4_0 / Q4_1 / Q4_K weights, ``Q8Blocks`` of
    wider ones, Q5_K / Q6_K / Q8_0 ...). Raises ``RuntimeError`` when the kernel cannot be built."""
    lib = lib or load()
    if lib is None:
        raise RuntimeError("quantization='gguf' needs the C kernel engine/models/csrc/qmatmul.c, which could "
                           "not be built (see the log; a C compiler is needed)")
    blocks = blocks or {}
    for parent, attr, sources in projections(model):
        linear = getattr(parent, attr)
        parts = stored_parts(blocks, sources)
        setattr(parent, attr, BlockLinear(lib, _layer_blocks(parts, linear.weight), linear.weight, linear.bias))
    tied = model.lm_head is None
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    stored = blocks.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    q8 = stored if isinstance(stored, Q8Blocks) else Q8Blocks.quantize(head)
    model.lm_head = BlockLinear(lib, q8, head)
