"""MXFP4 expert weights of gpt-oss's released Hugging Face checkpoints, decoded to float at load.

The checkpoint stores each expert projection ``P`` (``gate_up_proj``, ``down_proj``) as ``P_blocks``
(E, rows, groups, 16) uint8 and ``P_scales`` (E, rows, groups) uint8: every group holds 32 e2m1 values
along the projection's input dimension, two per byte (the low nibble first), sharing one e8m0 scale
``2 ** (scale - 127)`` (the OCP microscaling format). Decoded, a projection is (E, groups * 32, rows):
the layout of the float checkpoint's parameter, as transformers' ``convert_moe_packed_tensors`` gives it.
Every value is a small power-of-two multiple, exact in float32 and bfloat16.
"""

from __future__ import annotations

import torch

# e2m1 codes 0..15: sign bit 3, then the 8 magnitudes
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (E, R, G, 16) uint8, scales (E, R, G) uint8 -> (E, G * 32, R) in ``dtype``, one expert at a time
    (a released layer's ``gate_up_proj`` is 0.5 G values: decoding it whole would hold several copies)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16 or blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype}: expected uint8 (E, rows, groups, 16) and (E, rows, groups)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    E, R, G, _ = blocks.shape
    out = torch.empty(E, G * 32, R, dtype=dtype)
    for e in range(E):
        b = blocks[e]                                                                       # (R, G, 16)
        values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1)       # (R, G, 16, 2)
        values = torch.ldexp(values.flatten(-2), scales[e].to(torch.int32)[..., None] - 127)   # (R, G, 32)
        out[e] = values.flatten(-2).T                                                       # (G*32, R)
    return out


def decode_mxfp4_state(raw: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every ``P_blocks`` / ``P_scales`` pair replaced by the decoded ``P`` and the
    rest cast to ``dtype``; a block tensor without its scales (or the other way) is a ``ValueError``."""
    state, pairs = {}, {}
    for name, t in raw.items():
        base, sep, part = name.rpartition("_")
        if sep and part in ("blocks", "scales"):
            pairs.setdefault(base, {})[part] = t
        else:
            state[name] = t.to(dtype)
    for base, pair in pairs.items():
        if set(pair) != {"blocks", "scales"}:
            raise ValueError(f"MXFP4 tensor {base}_{next(iter(pair))} has no {base}_"
                             f"{({'blocks', 'scales'} - set(pair)).pop()}")
        state[base] = decode_mxfp4(pair["blocks"], pair["scales"], dtype)
    return state
