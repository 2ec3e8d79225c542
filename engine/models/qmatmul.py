"""Matmuls on a GGUF file's own weight blocks with 8-bit activations (csrc/qmatmul.c), and their references.

``y = x @ W.T`` for W in blocks of 32 weights along K: ``Q4Blocks`` (Q4_1's ``w = d * q + m``, q in 0..15;
Q4_0 is the same with ``m = -8 d``) and ``Q8Blocks`` (Q8_0's ``w = d * q``, q int8). The kernel quantizes
each 32-block of x (float32 or bfloat16) to int8 (``quantize_activations``: ``xd = max|x| / 127``,
``xq = round(x / xd)``) and takes integer dot products (AVX512-VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw`` /
``vpmaddwd``, portable C elsewhere; the variant is fixed when the library is built, by the compiler's
target: engine/cpu_build.py keys it by the CPU's flags and ``$AGENTRT_KERNEL_MARCH``). Exactly, per block:

* 4-bit: ``d * xd * sum(q * xq) + m * xs`` with ``xs = xd * sum(xq)`` (the min term);
* 8-bit: ``d * xd * sum(q * xq)``.

``reference_matmul`` computes that sum in float64 from ``quantize_activations`` (the kernel's oracle, up
to float32 accumulation); ``dequantize()`` then a float matmul is the plain one (the kernel differs from
it by the activations' rounding). ``Q4Blocks`` / ``Q8Blocks`` hold a file's blocks as stored (nibbles two
a byte in GGUF's order, d and m float16 values widened to float32); ``pack`` rearranges them once at load
into the kernel's layout (``Packed``: 16 output rows side by side per block, so that one vector holds a
piece of every row and the block sums need no horizontal adds; d and m back to float16 in the same
record, one stream to read), and ``BlockLinear`` keeps only that.
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
KERNEL_DTYPES = (torch.float32, torch.bfloat16)   # activations the kernel reads (and writes y in)


@dataclass(frozen=True)
class Q4Blocks:
    """4-bit weights of an (N, K) matrix: ``qs`` (N, K/32, 16) uint8 (byte j: element j in the low nibble,
    j + 16 in the high one), ``d`` and ``m`` (N, K/32) float32 holding float16 values (Q4_1 stores them
    so); ``w = d * q + m``."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * QK

    @staticmethod
    def from_groups(groups) -> "Q4Blocks":
        """From ``engine.models.quant.Int4Groups`` of group size 32 (a GGUF's blocks, rows in our order;
        scales and minimums rounded to float16 as Q4_1 stores them, a no-op for the file's own)."""
        if groups.group_size != QK:
            raise ValueError(f"4-bit blocks need groups of {QK}, got {groups.group_size}")
        N, K = groups.q.shape
        q = groups.q.view(N, K // QK, 2, 16)                                   # halves of each block
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).contiguous()                     # (N, K/32, 16)
        return Q4Blocks(qs, groups.scale.half().float().contiguous(), groups.minimum.half().float().contiguous())

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
    """8-bit weights of an (N, K) matrix: ``qs`` (N, K) int8, ``d`` (N, K/32) float32 holding float16
    values (Q8_0 stores them so); ``w = d * q``."""

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
        """Q8_0's scheme from float weights (N, K): ``d = max|w| / 127`` per block, q rounded to nearest,
        d then stored as float16 (as llama.cpp's quantizer does)."""
        N, K = w.shape
        if K % QK:
            raise ValueError(f"8-bit blocks need in_features ({K}) to be a multiple of {QK}")
        g = w.float().reshape(N, K // QK, QK)
        d = g.abs().amax(-1) / 127
        q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp_(-127, 127)
        return Q8Blocks(q.to(torch.int8).reshape(N, K), d.half().float().contiguous())

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


G = 16    # output rows per group of the packed layout (csrc/qmatmul.c)


@dataclass(frozen=True)
class Packed:
    """Weight blocks in the kernel's layout (``pack``), one record per block of each group of ``G``
    output rows (N padded with zero rows), ``data`` (N/G, K/32, record bytes) uint8: 4-bit, 320 bytes:
    qs (4, G, 4) (each row's GGUF bytes four at a time: element i in the low nibble, i + 16 in the high
    one), then d (G,) and m (G,) float16; 8-bit, 544 bytes: qs (8, G, 4) holding q + 128, then d (G,)
    float16. ``ptr``: data's address, for the call."""

    bits: int
    shape: tuple[int, int]
    data: torch.Tensor
    ptr: int

    def unpack(self) -> Q4Blocks | Q8Blocks:
        """The blocks ``pack`` was given (the inverse of ``pack``)."""
        N, K = self.shape
        ng, nb, _ = self.data.shape
        chunks = 4 if self.bits == 4 else 8
        q = self.data[..., :chunks * 64].reshape(ng, nb, chunks, G, 4).permute(0, 3, 1, 2, 4)  # (N/G, G, nb, ..)
        q = q.reshape(ng * G, nb, chunks * 4)[:N]

        def scales(at: int) -> torch.Tensor:                                   # (N, nb) float32
            h = self.data[..., at:at + 2 * G].contiguous().view(torch.float16)  # (N/G, nb, G)
            return h.transpose(1, 2).reshape(ng * G, nb)[:N].float().contiguous()

        at = chunks * 64
        if self.bits == 4:
            return Q4Blocks(q.contiguous(), scales(at), scales(at + 2 * G))
        return Q8Blocks((q.reshape(N, K) ^ 0x80).view(torch.int8).contiguous(), scales(at))


def _grouped(t: torch.Tensor, n: int) -> torch.Tensor:
    """(N, ...) -> (ceil(N / G) * G, ...), the rows past N zero."""
    pad = -n % G
    return t if pad == 0 else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def _half_bytes(v: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """(N, K/32) float32 scales -> (N/G, K/32, 2 G) bytes of float16, group rows side by side; refused
    unless float16 holds them exactly (GGUF stores them so; ``Q4Blocks``/``Q8Blocks`` round to it)."""
    h = v.half()
    if not torch.equal(h.float(), v):
        raise ValueError(f"qmatmul: the blocks' {what} must be float16 values (as GGUF stores them)")
    nb = v.shape[1]
    return _grouped(h, n).view(-1, G, nb).transpose(1, 2).contiguous().view(torch.uint8)


def pack(w: Q4Blocks | Q8Blocks) -> Packed:
    """The kernel's layout of ``w`` (see ``Packed``); the values are w's, rearranged."""
    N, K = w.shape
    nb = K // QK
    if isinstance(w, Q4Blocks):
        q = _grouped(w.qs, N).view(-1, G, nb, 4, 4).permute(0, 2, 3, 1, 4)    # (N/G, nb, chunk, row, byte)
        parts, bits = [q.reshape(-1, nb, 256), _half_bytes(w.d, N, "d"), _half_bytes(w.m, N, "m")], 4
    else:
        u = (w.qs.view(torch.uint8) ^ 0x80).view(N, nb, 8, 4)                  # q + 128
        q = _grouped(u, N).view(-1, G, nb, 8, 4).permute(0, 2, 3, 1, 4)
        parts, bits = [q.reshape(-1, nb, 512), _half_bytes(w.d, N, "d")], 8
    data = torch.cat(parts, dim=2).contiguous()
    return Packed(bits, (N, K), data, data.data_ptr())


class QMatmulLib:
    """ctypes binding of csrc/qmatmul.c."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.qmm_variant.restype = ctypes.c_char_p
        lib.qmm_q4.restype = lib.qmm_q8.restype = ctypes.c_int
        lib.qmm_q4.argtypes = lib.qmm_q8.argtypes = [p, i32, i64, i64, p, i64, p, i32]
        lib.qmm_swiglu_q4_f32.restype = ctypes.c_int
        lib.qmm_swiglu_q4_f32.argtypes = [p, i64, i64, p, i64, p, i64, p]
        self.path, self.lib = path, lib
        self.variant = lib.qmm_variant().decode()

    def matmul(self, x: torch.Tensor, w: Packed | Q4Blocks | Q8Blocks) -> torch.Tensor:
        """x (M, K) float32 or bfloat16, contiguous -> (M, N) in x's dtype. Blocks not yet ``pack``ed
        are packed for this call."""
        if not isinstance(w, Packed):
            w = pack(w)
        N, K = w.shape
        if x.dim() != 2 or x.shape[1] != K or x.dtype not in KERNEL_DTYPES or not x.is_contiguous():
            raise ValueError(f"qmatmul: x must be contiguous float32 or bfloat16 (M, {K}), "
                             f"got {x.dtype} {tuple(x.shape)}")
        return self.run(x, w)

    def run(self, x: torch.Tensor, w: Packed) -> torch.Tensor:
        """``matmul`` without its checks, for a caller that has made them (a decode step makes 121 calls):
        x (..., K) contiguous, its dtype in ``KERNEL_DTYPES`` -> (..., N) in x's dtype."""
        N, K = w.shape
        bf16 = x.dtype is torch.bfloat16
        y = torch.empty((*x.shape[:-1], N), dtype=x.dtype)
        rc = (self.lib.qmm_q4 if w.bits == 4 else self.lib.qmm_q8)(x.data_ptr(), bf16, x.numel() // K, K, w.ptr, N,
                                                                   y.data_ptr(), bf16)
        if rc != 0:
            raise RuntimeError(f"qmatmul returned {rc} (K={K}; -1: K not a multiple of {QK}, -2: out of memory)")
        return y


    def swiglu(self, x: torch.Tensor, gate_up: Packed, down: Packed) -> torch.Tensor:
        """A SwiGLU MLP in one call: ``down(silu(gate) * up)``, ``[gate; up] = gate_up(x)``, each projection
        as ``run`` computes it and silu as the layer ops' ``silu_mul``. x (M, K) float32, contiguous;
        gate_up (2 I, K) and down (N, I) 4-bit -> (M, N) float32. The caller checks the shapes."""
        M, K = x.shape
        N = down.shape[0]
        y = torch.empty((M, N), dtype=torch.float32)
        rc = self.lib.qmm_swiglu_q4_f32(x.data_ptr(), M, K, gate_up.ptr, gate_up.shape[0] // 2, down.ptr, N,
                                        y.data_ptr())
        if rc != 0:
            raise RuntimeError(f"qmatmul swiglu returned {rc} (-1: K not a multiple of {QK}, -2: out of memory)")
        return y


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> QMatmulLib | None:
    """The kernel for this process, built on first use; ``None`` when it cannot be built (logged).
    ``extra_flags`` follow engine.cpu_build.FLAGS (``("-mno-avx512f",)`` builds the AVX2 path on a CPU with
    AVX-512, ``("-mno-avx2",)`` the portable one)."""
    try:
        return QMatmulLib(build(SOURCE, extra_flags))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("quantized matmul kernel unavailable: %s", exc)
        return None
