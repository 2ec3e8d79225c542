"""The residual add and the next RMSNorm of a bfloat16 CPU step in one C call (csrc/add_rms_norm.c).

``LlamaModel`` in bfloat16 on the CPU runs its residual stream through ``AddRMSNorm`` (built on first
use by engine/cpu_build.py; without a compiler the model keeps its plain layers, which stay the
reference): ``x += delta; return rms_norm(x) * w``, with the roundings torch's own add and norm make.
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

SOURCE = Path(__file__).parent / "csrc" / "add_rms_norm.c"
MAX_HIDDEN = 16384   # MAX_H in the source


class AddRMSNorm:
    """ctypes binding of ``add_rms_norm_bf16``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fn = ctypes.CDLL(str(path)).add_rms_norm_bf16
        p = ctypes.c_void_p
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, p, ctypes.c_float, ctypes.c_int64, ctypes.c_int64, p]
        self.fn = fn

    def __call__(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: (T, H) bfloat16, contiguous, updated in place to ``x + delta`` (when given); weight: (H,) float32
        -> the RMSNorm of the updated x times weight, (T, H) bfloat16."""
        T, H = x.shape
        out = torch.empty_like(x)
        rc = self.fn(x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(), eps, T, H,
                     out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"add_rms_norm returned {rc} (hidden size {H} > {MAX_HIDDEN})")
        return out


@functools.cache
def load() -> AddRMSNorm | None:
    """The fused op for this process, built on first use; ``None`` when it cannot be built (logged once)."""
    try:
        op = AddRMSNorm(build(SOURCE))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("fused add + RMSNorm unavailable, using the plain layers: %s", exc)
        return None
    return op
