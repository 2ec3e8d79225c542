"""A decode step's decoder layers in one C call (csrc/decode_step.c), on GGUF blocks, in bfloat16 or float32.

``LlamaModel._forward_fused`` runs a step's layers from Python, one kernel call at a time: per layer two
add + RMSNorms, the q/k/v projection, RoPE + the K/V write, decode attention, the output projection and
the SwiGLU MLP, some 215 ctypes calls a batch-1 step of the default model, each with its Python around
it. On a 2-core AVX2 EPYC that Python was 4-5 ms of a 10.4 ms step (float32), with the second core idle
meanwhile; a bfloat16 step (CPUs with native bf16) makes the same calls plus two for its MLP.
``DecodeStep`` makes the same calls, in the same order, on the same buffers' values, from one C loop:
its output is the Python path's bit for bit (tests/engine/test_decode_step.py), which stays the
reference and runs every step this one does not take.

It takes a step when the model is a plain Llama-family decoder on GGUF blocks (4-bit, or 8-bit for a K-quant
file's wider layers) with bfloat16 or float32
activations (``quantization="gguf"``, ``use_cpu_ops`` on: the paths ``--dtype auto`` picks on CPUs with and
without native bf16), its pool's pages of the activations' dtype or int8,
and the attention backend reports the step as decode rows only, RoPE + K/V write in C
(``TorchAttentionBackend.c_decode_rows``). Where each row reads its own pages, attention is the C decode
kernel's call; where the rows share a cached prefix (several sessions over one system prompt, or a
verification's rows), the C loop calls the backend's own attention back for each layer. Prefill chunks,
sliding or special layers and pages of another float dtype than the activations take the Python path.
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

SOURCE = Path(__file__).parent / "csrc" / "decode_step.c"
# the C ``kernels`` struct's members, in order: (library, function) each
FNS = (("ops", "add_rms_norm_f32"), ("ops", "add_rms_norm_bf16"), ("qmm", "qmm_q4"), ("qmm", "qmm_swiglu_q4_f32"),
       ("ops", "silu_mul_bf16"), ("attn", "rope_store_f32"), ("attn", "rope_store_bf16"), ("attn", "rope_store_i8"),
       ("attn", "decode_attention_f32"), ("attn", "decode_attention_bf16"), ("attn", "decode_attention_i8"),
       ("qmm", "qmm_q8"), ("ops", "silu_mul_f32"))
DTYPES = (torch.float32, torch.bfloat16)   # the activations it runs
LAYER_WORDS = 11   # the C side's per-layer words (W_IN_NORM .. KV_VS, then W_BITS)
OPS = {1: "the first norm", 2: "the q/k/v projection", 3: "attention", 4: "the output projection",
       5: "the post-attention norm", 6: "the MLP", 7: "the next norm"}


_ATTEND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class _Kernels(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for _, name in FNS]


class _Shape(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int64), ("H", ctypes.c_int64), ("I", ctypes.c_int64), ("S", ctypes.c_int64),
                ("L", ctypes.c_int32), ("Hq", ctypes.c_int32), ("Hkv", ctypes.c_int32), ("D", ctypes.c_int32),
                ("P", ctypes.c_int32), ("int8_pages", ctypes.c_int32), ("bf16", ctypes.c_int32),
                ("scale", ctypes.c_float)]


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class DecodeStep:
    """One model's decoder layers as one C call per decode step (see the module docstring)."""

    def __init__(self, path: Path, model, kernels: _Kernels) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self.fn = lib.decode_layers
        p = ctypes.c_void_p
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [p] * 15
        self.kernels = kernels
        layers, cfg = model.layers, model.cfg
        self.dtype = model.embed_tokens.weight.dtype            # the activations'
        self.L, self.H, self.I = len(layers), cfg.hidden_size, layers[0].mlp.intermediate
        self.Hq, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.blocks = [m for layer in layers for m in _projections(layer)]   # read for their max_rows each step
        self.final_w = model.norm.weight.data
        self.eps = torch.tensor([layer.input_layernorm.eps for layer in layers] + [model.norm.eps],
                                dtype=torch.float32)
        self.post_eps = torch.tensor([layer.post_attention_layernorm.eps for layer in layers], dtype=torch.float32)
        # weights' addresses, the pool's filled in by ``_table`` (the tensors are the model's: they stay put)
        self.weights = torch.tensor([[layer.input_layernorm.weight.data_ptr(),
                                      layer.post_attention_layernorm.weight.data_ptr(),
                                      *(m.packed.ptr for m in _projections(layer))] for layer in layers],
                                    dtype=torch.int64)
        # W_BITS: bit i where projection i (qkv, o, gate_up, down) is on 8-bit blocks (a GGUF's wider layers)
        self.bits = torch.tensor([[sum(1 << i for i, m in enumerate(_projections(layer)) if m.packed.bits == 8)]
                                  for layer in layers], dtype=torch.int64)
        self._kv_key = None
        self._layers = None

    def _table(self, kv) -> torch.Tensor:
        """Every layer's addresses, its pool's included (built once per pool)."""
        key = (id(kv), kv.k[0].data_ptr())
        if key != self._kv_key:
            pool = [[kv.k[i].data_ptr(), kv.v[i].data_ptr(),
                     kv.k_scale[i].data_ptr() if kv.quantized else 0,
                     kv.v_scale[i].data_ptr() if kv.quantized else 0] for i in range(self.L)]
            self._layers = torch.cat([self.weights, torch.tensor(pool, dtype=torch.int64), self.bits],
                                     dim=1).contiguous()
            self._kv_key = key
        return self._layers

    def supports(self, kv) -> bool:
        """Whether steps over this pool can run here: pages of the activations' dtype, or int8 ones read as it."""
        return kv.layout == "HSD" and not kv.window_layers and kv.dtype == self.dtype and \
            kv.kv_dtype in (self.dtype, torch.int8) and kv.k[0].shape[2] == self.D

    def __call__(self, x: torch.Tensor, rope, attn) -> torch.Tensor | None:
        """x: (T, H) of the activations' dtype, the embedded tokens (updated in place as the Python path does);
        rope: the step's ``RopeTable``; attn: the torch backend, planned for this step -> the final norm's (T, H),
        or None when this step is not one it runs (the caller takes the Python path)."""
        plan = attn.c_decode_rows()
        if plan is None:
            return None
        slots, rows = plan
        kv = attn.kv
        T = x.shape[0]
        if (x.dtype is not self.dtype or x.dim() != 2 or x.shape[1] != self.H or not x.is_contiguous()
                or any(m.max_rows is not None and T > m.max_rows for m in self.blocks) or rope.partial
                or rope.cos.dtype is not self.dtype or rope.signed_sin.dtype is not self.dtype
                or not rope.cos.is_contiguous()
                or not rope.signed_sin.is_contiguous() or rope.cos.numel() != T * self.D
                or rope.signed_sin.numel() != T * self.D or not self.supports(kv)):
            return None
        S = kv.k[0].shape[1]
        shape = _Shape(T, self.H, self.I, S, self.L, self.Hq, self.Hkv, self.D, kv.page_size,
                       int(kv.quantized), int(self.dtype is torch.bfloat16), 1.0 / self.D ** 0.5)
        out = torch.empty_like(x)
        failed: list[BaseException] = []
        callback = None if rows is not None else _ATTEND(self._attend_back(attn, (T, self.Hq, self.D), self.dtype,
                                                                           failed))
        pages = (0, 0, 0) if rows is None else (rows.pages.data_ptr(), rows.page_start.data_ptr(),
                                                rows.kv_len.data_ptr())
        rc = self.fn(ctypes.addressof(self.kernels), self._table(kv).data_ptr(), ctypes.addressof(shape),
                     self.eps.data_ptr(), self.post_eps.data_ptr(), self.final_w.data_ptr(), x.data_ptr(),
                     rope.cos.data_ptr(), rope.signed_sin.data_ptr(), slots.data_ptr(), *pages,
                     ctypes.cast(callback, ctypes.c_void_p) if callback else None, out.data_ptr())
        if failed:
            raise failed[0]
        if rc != 0:
            what = "out of memory" if rc == -2 else f"layer {rc // 100}: {OPS.get(rc % 100, rc % 100)} failed"
            raise RuntimeError(f"decode step in C: {what}")
        return out

    @staticmethod
    def _attend_back(attn, shape: tuple[int, int, int], dtype: torch.dtype, failed: list):
        """The callback for a step whose rows share a prefix: the backend's own ``forward(layer, q, None, None)``
        (what the Python loop calls after ``rotate_and_store``) on the C side's q, written into its buffer.
        An exception is kept in ``failed`` (re-raised after the call) and stops the step."""
        n = shape[0] * shape[1] * shape[2] * dtype.itemsize     # bytes

        def attend(layer: int, q_ptr: int, out_ptr: int) -> int:
            try:
                q = torch.frombuffer((ctypes.c_char * n).from_address(q_ptr), dtype=dtype).view(shape)
                o = torch.frombuffer((ctypes.c_char * n).from_address(out_ptr), dtype=dtype).view(shape)
                o.copy_(attn.forward(layer, q, None, None))
                return 0
            except BaseException as exc:   # noqa: BLE001 - handed back to the caller, never lost in ctypes
                failed.append(exc)
                return 1
        return attend


def _projections(layer) -> tuple:
    a, m = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj


def eligible(model) -> str | None:
    """Why ``model`` (a ``LlamaModel`` of plain MLPs: ``LlamaModel.use_decode_step`` checks the types) cannot
    take its decode steps in one C call, or None when it can."""
    if model.cpu_ops is None:
        return "the C layer ops are off"
    if model.embed_tokens.weight.dtype not in DTYPES:
        return f"activations are {model.embed_tokens.weight.dtype}, not bfloat16 or float32"
    if model.rope.partial:
        return "partial rotary embedding"
    for layer in model.layers:
        if layer.self_attn.q_norm is not None:
            return "q/k norms"
        for m in _projections(layer):
            packed = getattr(m, "packed", None)           # a BlockLinear (engine/models/qlinear.py)
            if packed is None or packed.bits not in (4, 8) or m.bias is not None:
                return "a projection not on GGUF blocks without bias"
    return None


@functools.cache
def _library() -> Path | None:
    try:
        return build(SOURCE)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("one-call decode step unavailable, the layers run from Python: %s", exc)
        return None


def load(model, attn) -> DecodeStep | None:
    """The one-call decode step for ``model`` (a ``LlamaModel``) over ``attn`` (the torch backend with the C
    decode kernel), or None where it does not apply or cannot be built (the reason logged)."""
    why = eligible(model)
    kernel = getattr(attn, "kernel", None)
    if why is None and kernel is None:
        why = "the C decode-attention kernel is not loaded"
    path = _library() if why is None else None
    if why is not None or path is None:
        if why is not None:
            log.info("decode steps run their layers from Python: %s", why)
        return None
    libs = {"ops": model.cpu_ops.lib, "qmm": model.layers[0].self_attn.qkv_proj.lib.lib, "attn": kernel.lib}
    kernels = _Kernels(*(_address(libs[lib], name) for lib, name in FNS))
    return DecodeStep(path, model, kernels)
