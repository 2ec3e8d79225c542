"""Matmuls on a GGUF file's own weight blocks with 8-bit activations (csrc/qmatmul.c), and their references.

``y = x @ W.T`` for W in blocks of 32 weights along K: ``Q4Blocks`` (Q4_1's ``w = d * q + m``, q in 0..15;
Q4_0 is the same with ``m = -8 d``) and ``Q8Blocks`` (Q8_0's ``w = d * q``, q int8). The kernel quantizes
each 32-block of x to int8 (``quantize_activations``: ``xd = max|x| / 127``, ``xq = round(x / xd)``) and
takes integer dot products (AVX2 ``vpmaddubsw`` / ``vpmaddwd``, portable C elsewhere; the variant is fixed
when the library is built, engine/cpu_build.py keys it by the CPU's flags). Exactly, per block:

* 4-bit: ``d * xd * sum(q * xq) + m * xs`` with ``xs = xd * sum(xq)`` (the min term);
* 8-bit: ``d * xd * sum(q * xq)``.

``reference_matmul`` computes that sum in float64 from ``quantize_activations`` (the kernel's oracle, up
to float32 accumulation); ``dequantize()`` then a float matmul is the plain one (the kernel differs from
it by the activations' rounding). The weights are repacked once at load (``Q4Blocks.from_groups``): the
nibbles stay packed two a byte in GGUF's order, d and m widen losslessly from float16 to float32.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cpu_build import build

log = logging.getLogger("engine.models")

SOURCE = Path(__file__).parent / "csrc" / "qmatmul.c"
QK = 32   # weights (and activations) per block


@dataclass(frozen=True)
class Q4Blocks:
    """4-bit weights of an (N, K) matrix: ``qs`` (N, K/32, 16) uint8 (byte j: element j in the low nibble,
    j + 16 in the high one), ``d`` and ``m`` (N, K/32) float32; ``w = d * q + m``."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * QK

    @staticmethod
    def from_groups(groups) -> "Q4Blocks":
        """From ``engine.models.quant.Int4Groups`` of group size 32 (a GGUF's blocks, rows in our order)."""
        if groups.group_size != QK:
            raise ValueError(f"4-bit blocks need groups of {QK}, got {groups.group_size}")
        N, K = groups.q.shape
        q = groups.q.view(N, K // QK, 2, 16)                                   # halves of each block
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()                     # (N, K/32, 16)
        return Q4Blocks(qs, groups.scale.float().contiguous(), groups.minimum.float().contiguous())

    def values(self) -> torch.Tensor:
        """(N, K) uint8 q in 0..15."""
        N, K = self.shape
        return torch.stack([self.qs & 0x0F, self.qs >> 4], dim=2).reshape(N, K)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32, as GGUF's Q4_1 dequantization computes it (``d * q + m``)."""
        N, K = self.shape
        q = self.values().view(N, K // QK, QK).float()
        return (self.d[:, :, None] * q + self.m[:, :, None]).reshape(N, K)


@dataclass(frozen=True)
class Q8Blocks:
    """8-bit weights of an (N, K) matrix: ``qs`` (N, K) int8, ``d`` (N, K/32) float32; ``w = d * q``."""

    qs: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qs.shape)

    @staticmethod
    def from_blocks(q: torch.Tensor, d: torch.Tensor, n_rows: int) -> "Q8Blocks":
        """Blocks in row-major order (``engine.loader.gguf_file.q8_blocks``: q (blocks, 32), d (blocks, 1))."""
        return Q8Blocks(q.reshape(n_rows, -1).contiguous(), d.reshape(n_rows, -1).float().contiguous())

    @staticmethod
    def quantize(w: torch.Tensor) -> "Q8Blocks":
        """Q8_0's scheme from float weights (N, K): ``d = max|w| / 127`` per block, q rounded to nearest."""
        N, K = w.shape
        if K % QK:
            raise ValueError(f"8-bit blocks need in_features ({K}) to be a multiple of {QK}")
        g = w.float().reshape(N, K // QK, QK)
        d = g.abs().amax(-1) / 127
        q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp_(-127, 127)
        return Q8Blocks(q.to(torch.int8).reshape(N, K), d.contiguous())

    def dequantize(self) -> torch.Tensor:
        N, K = self.shape
        return (self.d[:, :, None] * self.qs.view(N, K // QK, QK).float()).reshape(N, K)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K) float32 -> (xq (M, K/32, 32) int8, xd (M, K/32), xs (M, K/32)) float32, as the kernel's
    ``qmm_quantize_rows``: float32 ``xd = amax / 127``, ``xq = round_half_even(x * (1 / xd))``,
    ``xs = xd * sum(xq)``."""
    M, K = x.shape
    g = x.float().reshape(M, K // QK, QK)
    xd = g.abs().amax(-1) / 127
    inv = torch.where(xd > 0, 1.0 / xd, torch.zeros_like(xd))
    xq = torch.round(g * inv[..., None]).to(torch.int8)
    return xq, xd, xd * xq.sum(-1, dtype=torch.int32).float()


def reference_matmul(x: torch.Tensor, w: Q4Blocks | Q8Blocks) -> torch.Tensor:
    """What the kernel computes, in float64: the per-block integer sums of ``quantize_activations(x)``
    against the weight blocks, scaled (and for 4 bits the min term added). x (M, K) -> (M, N)."""
    xq, xd, xs = quantize_activations(x)
    N, K = w.shape
    q = (w.values() if isinstance(w, Q4Blocks) else w.qs).view(N, K // QK, QK).double()
    isum = torch.einsum("mbj,nbj->mnb", xq.double(), q)                     # (M, N, K/32)
    y = (isum * w.d.double()[None] * xd.double()[:, None]).sum(-1)
    if isinstance(w, Q4Blocks):
        y = y + xs.double() @ w.m.double().t()
    return y


class QMatmulLib:
    """ctypes binding of csrc/qmatmul.c."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.qmm_variant.restype = ctypes.c_char_p
        lib.qmm_q4.restype = lib.qmm_q8.restype = ctypes.c_int
        lib.qmm_q4.argtypes = [p, i64, i64, p, p, p, i64, p]
        lib.qmm_q8.argtypes = [p, i64, i64, p, p, i64, p]
        self.path, self.lib = path, lib
        self.variant = lib.qmm_variant().decode()

    def matmul(self, x: torch.Tensor, w: Q4Blocks | Q8Blocks) -> torch.Tensor:
        """x (M, K) float32 contiguous -> (M, N) float32."""
        M, K = x.shape
        N, Kw = w.shape
        if K != Kw or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"qmatmul: x must be contiguous float32 (M, {Kw}), got {x.dtype} {tuple(x.shape)}")
        y = torch.empty(M, N)
        if isinstance(w, Q4Blocks):
            rc = self.lib.qmm_q4(x.data_ptr(), M, K, w.qs.data_ptr(), w.d.data_ptr(), w.m.data_ptr(), N,
                                 y.data_ptr())
        else:
            rc = self.lib.qmm_q8(x.data_ptr(), M, K, w.qs.data_ptr(), w.d.data_ptr(), N, y.data_ptr())
        if rc != 0:
            raise RuntimeError(f"qmatmul returned {rc} (K={K}; -1: K not a multiple of {QK}, -2: out of memory)")
        return y


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> QMatmulLib | None:
    """The kernel for this process, built on first use; ``None`` when it cannot be built (logged).
    ``extra_flags`` follow engine.cpu_build.FLAGS (``("-mno-avx2",)`` builds the portable path)."""
    try:
        return QMatmulLib(build(SOURCE, extra_flags))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("quantized matmul kernel unavailable: %s", exc)
        return None
