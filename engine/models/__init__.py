"""Model definitions (plain torch modules over flattened token batches)."""

from __future__ import annotations

import importlib

import torch

from engine.loader.model_config import ModelConfig
from engine.models.llama import LlamaModel, keep_float32_norms
from engine.models.quant import quantize_model

FAMILY_BUILDERS = {"gemma3": ("engine.models.gemma3", "build_gemma3"),
                   "gpt_oss": ("engine.models.gpt_oss", "build_gpt_oss")}


def _quantize(model, quantization: str, int4_groups: dict | None) -> None:
    if quantization == "gguf":
        from engine.models.qlinear import quantize_model_blocks
        quantize_model_blocks(model, int4_groups)
    elif quantization != "off":
        quantize_model(model, quantization, int4_groups)


def materialize(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """``model.to_empty(device=device)``: every parameter and buffer of a model built on the meta device
    allocated (uninitialized) on ``device``, shared ones shared still. Not torch's own: its first call imports
    torch's symbolic-shapes module and sympy (0.2-0.4 s of every server's start on two cores, for nothing
    else the engine uses)."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=t.dtype, device=device)
        return made[id(t)]

    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = empty(b)
    return model


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str, quantization: str = "off", int4_groups: dict | None = None) -> LlamaModel:
    """Instantiate the decoder for ``cfg`` and load ``state`` (HF names) into it; ``quantization``
    ``int4`` / ``int8`` then swaps its projections for quantized layers (engine/models/quant.py), ``gguf``
    for layers on the file's weight blocks (engine/models/qlinear.py)."""
    if cfg.architecture in FAMILY_BUILDERS:   # the families whose skeleton differs from Llama's
        module, name = FAMILY_BUILDERS[cfg.architecture]
        model = getattr(importlib.import_module(module), name)(cfg, state, dtype, device)
        _quantize(model, quantization, int4_groups)
        return model
    if cfg.moe:
        from engine.models.moe_model import build_moe_model
        model = build_moe_model(cfg, state, dtype, device)
        keep_float32_norms(model)
        _quantize(model, quantization, int4_groups)
        return model
    with torch.device("meta"):
        model = LlamaModel(cfg).to(dtype)   # in the target dtype before any memory is allocated
    model = materialize(model, device)
    model.rope = model.rope.__class__(cfg).to(device)
    model.load_hf_state_dict(state)
    keep_float32_norms(model)
    _quantize(model, quantization, int4_groups)
    return model.eval()
