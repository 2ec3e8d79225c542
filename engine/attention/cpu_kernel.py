"""The CPU decode-attention kernel (``csrc/decode_attention.c``): built on first use, called through ctypes.

Decode attention on the CPU in plain torch costs a handful of small operations per row and layer
(two matmuls, a softmax, dtype conversions), and over distinct contexts either scores every row
against every other row's keys (one masked matmul) or pays those operations once per row. The
kernel reads each row's pages in place and does one call per layer for the whole batch, split
into (row, KV head, 256-key chunk) tasks over torch's own OpenMP threads.

Built on first use by engine/cpu_build.py (the system C compiler, cached per source, flags,
compiler and CPU). Without a compiler, or when the build fails, ``load()`` returns ``None`` (the
reason is logged once) and the torch backend keeps its pure-torch decode plans, which stay the
tested reference path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from engine.cpu_build import build

log = logging.getLogger("engine.attention")

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
DTYPES = {torch.bfloat16: "decode_attention_bf16", torch.float32: "decode_attention_f32"}
ROPE_DTYPES = {torch.bfloat16: "rope_store_bf16", torch.float32: "rope_store_f32"}
MAX_GROUP, MAX_HEAD_DIM = 16, 256   # MAX_G and MAX_D in the source
# the (query heads per KV head, head dim) pairs the source can give an int8 loop nest of their own (run_i8)
I8_CASE_GROUPS, I8_CASE_DIMS = range(1, 9), (64, 128)


class DecodeKernel:
    """ctypes binding of the kernel's entry points (one per KV dtype)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))   # engine/models/decode_step.py calls its functions by address
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self.fns = {}
        for dtype, name in DTYPES.items():
            fn = getattr(lib, name)
            fn.restype = i32
            fn.argtypes = [p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, f32, p, p]
            self.fns[dtype] = fn
        self.dpbf16 = bool(lib.decode_attention_dpbf16())   # bfloat16 scores on vdpbf16ps (AVX512-BF16)
        # the int8 pairs with a loop nest of their own: 1000 * G + D for one, 0 for none, -1 for all (i8_case_flags)
        self.i8_cases = int(lib.decode_attention_i8_cases())
        self.fn_i8 = lib.decode_attention_i8
        self.fn_i8.restype = i32
        self.fn_i8.argtypes = [p, p, p, p, p, i64, p, p, p, i32, i32, i32, i32, i32, f32, i32, p, p]
        self.rope_i8 = lib.rope_store_i8
        self.rope_i8.restype = None
        self.rope_i8.argtypes = [p, i32, p, p, p, p, p, p, p, i64, i64, i32, i32, i32, p]
        self.rope_fns = {}
        for dtype, name in ROPE_DTYPES.items():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [p, p, p, p, p, p, i64, i64, i32, i32, i32, p]
            self.rope_fns[dtype] = fn

    def supports(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """``dtype``: the pool's (float32, bfloat16, or int8 with scales)."""
        return ((dtype in self.fns or dtype == torch.int8) and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
                and head_dim <= MAX_HEAD_DIM)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: "KernelRows",
                 lse: torch.Tensor | None = None) -> torch.Tensor:
        """q: (B, Hq, D); k, v: one layer's pool, (Hkv, S, D); ``rows``: each row's pages and key count
        -> (B, Hq, D) in q's dtype; ``lse`` (B, Hq) float32, if given, gets each row's log-sum-exp of scores."""
        B, Hq, D = q.shape
        Hkv, S, _ = k.shape
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()) or q.dtype != k.dtype:
            raise ValueError("decode kernel: q, k and v must be contiguous and of one dtype")
        if (rows.max_page + 1) * rows.page_size > S:   # the C side reads pages unchecked
            raise ValueError(f"decode kernel: page {rows.max_page} is outside a pool of {S // rows.page_size} pages")
        out = torch.empty_like(q)
        rc = self.fns[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), S, rows.pages.data_ptr(),
                               rows.page_start.data_ptr(), rows.kv_len.data_ptr(), B, Hq, Hkv, D, rows.page_size,
                               1.0 / D ** 0.5, out.data_ptr(), 0 if lse is None else lse.data_ptr())
        if rc != 0:
            raise RuntimeError(f"decode kernel returned {rc} (B={B}, Hq={Hq}, Hkv={Hkv}, D={D})")
        return out


    def paged(self, q: torch.Tensor, kv, layer: int, rows: "KernelRows", lse: torch.Tensor | None = None):
        """Decode attention over one layer of a ``KVCache`` (engine/kv_pool.py), whatever it stores: q (B, Hq, D)
        float32 or bfloat16 -> (B, Hq, D) in q's dtype. An int8 pool is read in place with its scales; a
        float pool of another dtype than q gets q converted to the pool's dtype and back."""
        k, v = kv.k[layer], kv.v[layer]
        if not kv.quantized:
            return self(q.to(k.dtype), k, v, rows, lse).to(q.dtype)
        B, Hq, D = q.shape
        Hkv, S, _ = k.shape
        if q.dtype not in self.fns or not q.is_contiguous():
            raise ValueError("decode kernel: q must be contiguous float32 or bfloat16")
        if (rows.max_page + 1) * rows.page_size > S:   # the C side reads pages unchecked
            raise ValueError(f"decode kernel: page {rows.max_page} is outside a pool of {S // rows.page_size} pages")
        out = torch.empty_like(q)
        rc = self.fn_i8(q.data_ptr(), k.data_ptr(), v.data_ptr(), kv.k_scale[layer].data_ptr(),
                        kv.v_scale[layer].data_ptr(), S, rows.pages.data_ptr(), rows.page_start.data_ptr(),
                        rows.kv_len.data_ptr(), B, Hq, Hkv, D, rows.page_size, 1.0 / D ** 0.5,
                        int(q.dtype == torch.bfloat16), out.data_ptr(), 0 if lse is None else lse.data_ptr())
        if rc != 0:
            raise RuntimeError(f"decode kernel returned {rc} (B={B}, Hq={Hq}, Hkv={Hkv}, D={D})")
        return out

    def rope_store_int8(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                        kv, layer: int, num_heads: int) -> torch.Tensor:
        """:meth:`rope_store` into an int8 ``KVCache`` layer: k and v quantized per token and KV head
        (``engine.kv_pool.quantize_int8``, the same bytes) -> q rotated, (T, Hq, D)."""
        T, H, D = qkv.shape
        k, v = kv.k[layer], kv.v[layer]
        Hkv, S, _ = k.shape
        if (qkv.dtype not in self.fns or not all(t.is_contiguous() and t.dtype == qkv.dtype for t in (qkv, cos, signed_sin))
                or H != num_heads + 2 * Hkv or cos.numel() != T * D or signed_sin.numel() != T * D
                or slots.dtype != torch.int64 or slots.numel() != T or not slots.is_contiguous() or k.shape[2] != D):
            raise ValueError("rope_store_int8: contiguous qkv (T, Hq + 2 Hkv, D), cos and sin (T, D) of one float "
                             "dtype, int64 slots (T,), an int8 pool (Hkv, S, D)")
        q = torch.empty(T, num_heads, D, dtype=qkv.dtype)
        self.rope_i8(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), cos.data_ptr(), signed_sin.data_ptr(),
                     slots.data_ptr(), k.data_ptr(), v.data_ptr(), kv.k_scale[layer].data_ptr(),
                     kv.v_scale[layer].data_ptr(), S, T, num_heads, Hkv, D, q.data_ptr())
        return q

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
        """RoPE on q and k of a fused projection and k, v stored into one layer's pool at ``slots``.
        qkv: (T, Hq + 2 Hkv, D); cos, signed_sin: (T, D) or (T, 1, D) (``RopeTable``), of qkv's dtype;
        slots: (T,) int64, each checked by the caller to lie in the pool; k, v: (Hkv, S, D)
        -> q rotated, (T, Hq, D)."""
        T, H, D = qkv.shape
        Hkv, S, _ = k.shape
        tensors = (qkv, cos, signed_sin, k, v)
        if (not all(t.is_contiguous() and t.dtype == qkv.dtype for t in tensors) or H != num_heads + 2 * Hkv
                or cos.numel() != T * D or signed_sin.numel() != T * D or slots.dtype != torch.int64
                or slots.numel() != T or not slots.is_contiguous() or k.shape != v.shape or k.shape[2] != D):
            raise ValueError("rope_store: contiguous qkv (T, Hq + 2 Hkv, D), cos and sin (T, D) of one dtype, "
                             "int64 slots (T,), k and v (Hkv, S, D)")
        q = torch.empty(T, num_heads, D, dtype=qkv.dtype)
        self.rope_fns[qkv.dtype](qkv.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), slots.data_ptr(),
                                 k.data_ptr(), v.data_ptr(), S, T, num_heads, Hkv, D, q.data_ptr())
        return q


class KernelRows:
    """Each decode row's pages (CSR: ``pages[page_start[b]:page_start[b+1]]``) and key count, as the
    kernel reads them; built once per step, used by every layer."""

    def __init__(self, page_tables: list[list[int]], kv_lens: list[int], page_size: int) -> None:
        for pages, n in zip(page_tables, kv_lens):
            if len(pages) * page_size < n:
                raise ValueError(f"a row of {n} keys needs {-(-n // page_size)} pages, got {len(pages)}")
        starts = [0]
        for pages in page_tables:
            starts.append(starts[-1] + len(pages))
        flat = [p for pages in page_tables for p in pages]
        self.pages = torch.tensor(flat or [0], dtype=torch.int32)
        self.max_page = max(flat, default=-1)
        self.page_start = torch.tensor(starts, dtype=torch.int64)
        self.kv_len = torch.tensor(kv_lens, dtype=torch.int64)
        self.page_size = page_size


def i8_case_flags(i8_shape: tuple[int, int] | None) -> tuple[str, ...]:
    """The build flags for decode attention over an int8 pool whose layers have ``i8_shape`` = (query heads per
    KV head, head dim), or over no int8 pool (``None``): only that pair's int8 loop nest, or none (a pair outside
    ``I8_CASE_GROUPS`` x ``I8_CASE_DIMS`` has none in any build). The 16 nests of the full build are most of the
    source's compile time (csrc/decode_attention.c, run_i8), which a first start pays."""
    if i8_shape is not None and i8_shape[0] in I8_CASE_GROUPS and i8_shape[1] in I8_CASE_DIMS:
        return (f"-DI8_ONE_G={i8_shape[0]}", f"-DI8_ONE_D={i8_shape[1]}")
    return ("-DI8_NO_CASES",)


def load(i8_shape: tuple[int, int] | None = None) -> DecodeKernel | None:
    """The kernel for a pool of this process, built on first use: ``i8_shape`` (query heads per KV head, head
    dim) for an int8 pool, ``None`` for a float one (:func:`i8_case_flags`); ``None`` when it cannot be built
    (logged once a build: the answer is cached). Every build computes every dtype and shape; they differ only
    in which int8 pair runs a loop nest of its own."""
    return _load_decode(i8_case_flags(i8_shape))


@functools.cache
def _load_decode(flags: tuple[str, ...]) -> DecodeKernel | None:
    return _load(DecodeKernel, SOURCE, "decode-attention", "the torch decode plans", flags)


def _load(cls, source: Path, what: str, instead: str, flags: tuple[str, ...] = ()):
    """``cls`` over ``source`` built with ``flags`` (cached) and loaded, or ``None`` with the reason logged."""
    try:
        kernel = cls(build(source, flags))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU %s kernel unavailable, using %s: %s", what, instead, exc)
        return None
    log.info("CPU %s kernel: %s", what, kernel.path)
    return kernel


PREFILL_SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.c"


class PrefillKernel:
    """ctypes binding of ``csrc/prefill_attention.c``: a prefill chunk over its sequence's keys, read in place
    from the pool: bfloat16 queries over bfloat16 pages, or float32 queries over float32 pages; either over int8
    pages with their scales, dequantized to the queries' dtype as read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.fn = lib.prefill_attention_bf16
        self.fn.restype = i32
        self.fn.argtypes = [p, p, p, i64, p, i64, i64, i32, i32, i32, ctypes.c_float, p]
        self.fn_i8 = lib.prefill_attention_i8
        self.fn_i8.restype = i32
        self.fn_i8.argtypes = [p, p, p, p, p, i64, p, i64, i64, i32, i32, i32, ctypes.c_float, p]
        self.dpbf16 = bool(lib.prefill_attention_dpbf16())   # vdpbf16ps (AVX512-BF16), else portable C
        self.fn_f32 = lib.prefill_attention_f32
        self.fn_f32.restype = i32
        self.fn_f32.argtypes = [p, p, p, p, p, i64, p, i64, i64, i32, i32, i32, ctypes.c_float, p]
        lanes = lib.prefill_attention_f32_lanes
        lanes.restype = i32
        self.f32_lanes = int(lanes())   # the float32 path's vector width: 16 (AVX-512F), 8 (AVX / AVX2), else 4

    def vectorized(self, dtype: torch.dtype) -> bool:
        """Whether this build runs ``dtype`` (the activations') on vector instructions: bfloat16 on vdpbf16ps, float32
        on AVX or AVX-512. Only then may it replace torch's fused attention; the plain loops are the tests' reference."""
        return self.dpbf16 if dtype == torch.bfloat16 else dtype == torch.float32 and self.f32_lanes >= 8

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP and head_dim % 64 == 0 \
            and head_dim <= MAX_HEAD_DIM

    def paged(self, q: torch.Tensor, kv, layer: int, slots: torch.Tensor, out: torch.Tensor | None = None):
        """:meth:`__call__` over one layer of a ``KVCache`` (engine/kv_pool.py): pages of q's dtype, or int8 pages
        with their scales (dequantized to q's dtype as read)."""
        if kv.quantized:
            return self(q, kv.k[layer], kv.v[layer], slots, out, kv.k_scale[layer], kv.v_scale[layer])
        return self(q, kv.k[layer], kv.v[layer], slots, out)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                 out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: (Q, Hq, D) bfloat16 or float32, the chunk's queries; k, v: one layer's pool (Hkv, S, D) of q's dtype,
        or int8 with ``k_scale``, ``v_scale`` (Hkv, S) float32; slots: (L,) int64, the sequence's keys in order, the
        chunk's own last (L >= Q) -> (Q, Hq, D) in q's dtype, written into ``out`` when given (contiguous, of q's
        shape and dtype)."""
        Q, Hq, D = q.shape
        Hkv, S, _ = k.shape
        L = slots.numel()
        i8 = k.dtype == torch.int8
        f32 = q.dtype == torch.float32
        scales_ok = (not i8 and k_scale is None and v_scale is None) or (
            i8 and k_scale is not None and v_scale is not None and all(
                s.dtype == torch.float32 and s.is_contiguous() and s.shape == (Hkv, S) for s in (k_scale, v_scale)))
        pages_ok = q.dtype in (torch.bfloat16, torch.float32) and k.dtype in (q.dtype, torch.int8)
        if not (pages_ok and q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype
                and scales_ok) \
                or k.shape != v.shape or k.shape[2] != D or slots.dtype != torch.int64 or not slots.is_contiguous() \
                or L < Q:
            raise ValueError("prefill kernel: contiguous bfloat16 or float32 q (Q, Hq, D), k and v (Hkv, S, D) of q's "
                             "dtype (or int8 with float32 scales (Hkv, S)), int64 slots (L,) with L >= Q")
        if L and (int(slots.min()) < 0 or int(slots.max()) >= S):   # the C side reads slots unchecked
            raise ValueError(f"prefill kernel: a slot lies outside the pool of {S} slots")
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("prefill kernel: out must be contiguous and of q's shape and dtype")
        if f32:
            rc = self.fn_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_scale.data_ptr() if i8 else None,
                             v_scale.data_ptr() if i8 else None, S, slots.data_ptr(), L, Q, Hq, Hkv, D, 1.0 / D ** 0.5,
                             out.data_ptr())
        elif i8:
            rc = self.fn_i8(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), S,
                            slots.data_ptr(), L, Q, Hq, Hkv, D, 1.0 / D ** 0.5, out.data_ptr())
        else:
            rc = self.fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), S, slots.data_ptr(), L, Q, Hq, Hkv, D,
                         1.0 / D ** 0.5, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"prefill kernel returned {rc} (Q={Q}, L={L}, Hq={Hq}, Hkv={Hkv}, D={D})")
        return out


@functools.cache
def load_prefill() -> PrefillKernel | None:
    """The prefill kernel for this process, built on first use; ``None`` when it cannot be built (logged once)."""
    return _load(PrefillKernel, PREFILL_SOURCE, "prefill-attention", "torch's attention")
