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
        model = LlamaModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.rope = model.rope.__class__(cfg).to(device)
    model.load_hf_state_dict(state)
    keep_float32_norms(model)
    _quantize(model, quantization, int4_groups)
    return model.eval()
