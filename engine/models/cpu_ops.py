"""Per-layer operations of a CPU step, each one C call (csrc/layer_ops.c).

``LlamaModel`` on the CPU, in bfloat16 or float32 (the dtype where the CPU has no native bf16), runs its
residual stream through ``AddRMSNorm`` and its SwiGLU activation through ``SiluMul`` (built on first use
by engine/cpu_build.py; without a compiler the model keeps its plain layers, which stay the reference):

* ``add_rms_norm``: ``x += delta; return rms_norm(x) * w``, with the roundings torch's own add and norm make;
* ``silu_mul``: ``silu(gate) * up`` on the fused gate/up projection's output, without the split.

Each has one C function per activation dtype (``DTYPES``); a decode step makes ~90 of these calls, so
the binding checks little and picks the function by a dict lookup.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from engine.cpu_build import build

log = logging.getLogger("engine.models")

SOURCE = Path(__file__).parent / "csrc" / "layer_ops.c"
MAX_HIDDEN = 16384   # MAX_H in the source
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}   # activations -> the C functions' suffix


class AddRMSNorm:
    """ctypes binding of ``add_rms_norm_bf16`` and ``add_rms_norm_f32``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p = ctypes.c_void_p
        self.fns = {}
        for dtype, suffix in DTYPES.items():
            fn = getattr(lib, f"add_rms_norm_{suffix}")
            fn.restype = ctypes.c_int
            fn.argtypes = [p, p, p, ctypes.c_float, ctypes.c_int64, ctypes.c_int64, p]
            self.fns[dtype] = fn

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (T, H) bfloat16 or float32, contiguous, updated in place to ``x + delta`` (when given; contiguous,
        of x's dtype); weight: (H,) float32 -> the RMSNorm of the updated x times weight, (T, H) in x's dtype."""
        T, H = x.shape
        out = torch.empty_like(x)
        rc = self.fns[x.dtype](x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), eps, T, H,
                     out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"add_rms_norm returned {rc} (hidden size {H} > {MAX_HIDDEN})")
        return out


class SiluMul:
    """ctypes binding of ``silu_mul_bf16`` and ``silu_mul_f32``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns = {}
        for dtype, suffix in DTYPES.items():
            fn = getattr(lib, f"silu_mul_{suffix}")
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            self.fns[dtype] = fn

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: (T, 2 I) bfloat16 or float32, gate then up -> silu(gate) * up, (T, I) in its dtype."""
        T, I2 = gate_up.shape
        if gate_up.dtype not in self.fns or not gate_up.is_contiguous() or I2 % 2:
            raise ValueError("silu_mul: a contiguous bfloat16 or float32 (T, 2 I) gate/up tensor")
        out = torch.empty(T, I2 // 2, dtype=gate_up.dtype)
        self.fns[gate_up.dtype](gate_up.data_ptr(), T, I2 // 2, out.data_ptr())
        return out


class LayerOps:
    """The library's operations, loaded once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))
        self.add_rms_norm = AddRMSNorm(lib)
        self.silu_mul = SiluMul(lib)


@functools.cache
def load() -> LayerOps | None:
    """The operations for this process, built on first use; ``None`` when they cannot be built (logged once)."""
    try:
        ops = LayerOps(build(SOURCE))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("fused add + RMSNorm and SiLU-multiply unavailable, using the plain layers: %s", exc)
        return None
    return ops
