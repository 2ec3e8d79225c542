"""Load a Hugging Face model directory: config.json + *.safetensors + tokenizer.json.

Dense Llama-family architectures (Llama, Mistral, Qwen2, Qwen3, Phi-3/4) are read here; MoE
families add their expert settings to ``ModelConfig.moe``. Every config.json field is honoured or
refused (engine/loader/arch_fields.py); RoPE scaling goes to ``ModelConfig.rope_scaling``.
"""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file

from engine.loader.arch_fields import FIELDS, check_fields
from engine.loader.hf_families import FAMILY_ARCHITECTURES, family_config, mistral_windows
from engine.loader.model_config import ModelConfig
from engine.loader.mxfp4 import decode_mxfp4_state
from engine.loader.progress import load_bar
from engine.loader.tokenizer_files import load_hf_tokenizer

DENSE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",      # Phi-3 and Phi-4 (fused qkv_proj / gate_up_proj, longrope)
}
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# architectures agents run that this engine does not implement, and what is missing
UNSUPPORTED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) is not implemented",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) is not implemented (DeepSeek-V3, Kimi K2)",
    "KimiK2ForCausalLM": "multi-head latent attention (MLA) is not implemented",
    "GlmForCausalLM": "the GLM architecture is not implemented",
    "Glm4ForCausalLM": "the GLM architecture is not implemented",
    "Glm4MoeForCausalLM": "the GLM architecture is not implemented",
    "ChatGLMModel": "the GLM architecture is not implemented",
    "Gemma3ForConditionalGeneration": "Gemma 3's vision model is not implemented (its text model, "
                                      "Gemma3ForCausalLM, is)",
}


def _architecture(cfg: dict, source: str) -> tuple[str, str]:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in DENSE_ARCHITECTURES or a in MOE_ARCHITECTURES), None)
    if arch is None:
        why = next((UNSUPPORTED_ARCHITECTURES[a] for a in archs if a in UNSUPPORTED_ARCHITECTURES), None)
        supported = sorted(DENSE_ARCHITECTURES) + sorted(MOE_ARCHITECTURES) + sorted(FAMILY_ARCHITECTURES)
        raise ValueError(f"{source}: architectures {archs} not supported" + (f": {why}" if why else "")
                         + f" (supported: {supported})")
    return arch, DENSE_ARCHITECTURES.get(arch) or MOE_ARCHITECTURES[arch]


def rope_from_hf(cfg: dict, family: str) -> tuple[float, dict, float]:
    """``(rope_theta, rope_scaling in engine/models/rope.py's form, partial_rotary_factor)`` from either
    spelling: ``rope_scaling`` + ``rope_theta`` (checkpoints before transformers 5; ``type`` for
    ``rope_type``) or ``rope_parameters`` (transformers 5, rope_theta inside)."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if "type" in rope:
        kind = rope.pop("type")
        if rope.setdefault("rope_type", kind) != kind:
            raise ValueError(f"rope_scaling: type {kind!r} and rope_type {rope['rope_type']!r} disagree")
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if rope.get("rope_type", "default") == "default":
        rope.pop("rope_type", None)
    elif rope["rope_type"] in ("llama3", "yarn", "longrope"):   # where transformers looks, in its order
        if family == "phi3" and cfg.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    return theta, rope, partial


def config_from_hf(cfg: dict, source: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    family_arch = next((a for a in archs if a in FAMILY_ARCHITECTURES), None)
    if family_arch is not None and not any(a in DENSE_ARCHITECTURES or a in MOE_ARCHITECTURES for a in archs):
        return family_config(family_arch, cfg, source)   # Gemma 3, gpt-oss: engine/loader/hf_families.py
    arch, family = _architecture(cfg, source)
    check_fields(FIELDS[family], cfg, source, family)
    n_head = int(cfg["num_attention_heads"])
    moe = {}
    if arch in MOE_ARCHITECTURES:
        moe = {"family": family,
               "num_experts": int(cfg.get("num_local_experts", cfg.get("num_experts", 0))),
               "top_k": int(cfg.get("num_experts_per_tok", 2)),
               "moe_intermediate_size": int(cfg.get("moe_intermediate_size", cfg.get("intermediate_size"))),
               "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size", 0) or 0),
               "norm_topk_prob": bool(cfg.get("norm_topk_prob", family == "mixtral")),
               "hf_config": cfg}  # engine.moe reads routing rules and MoE layer indices from it
    theta, rope, partial = rope_from_hf(cfg, family)
    bias = cfg.get("attention_bias", cfg.get("qkv_bias", family in ("qwen2", "qwen2_moe")))
    try:
        return ModelConfig(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 1)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=n_head,
            num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_head),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling=rope,
            partial_rotary_factor=partial,
            moe=moe,
            sliding_windows=mistral_windows(cfg, int(cfg["num_hidden_layers"])) if family == "mistral" else (),
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_hf_dir(path: str, dtype: torch.dtype = torch.float32):
    """Returns ``(ModelConfig, state_dict, Tokenizer)`` for a Hugging Face model directory.

    For MoE models the state is a lazy mapping (``engine.moe.checkpoint.SafetensorsDict``:
    tensors are read on access, in the file's dtype; the model copies them into its own), so
    an expert-parallel rank reads only its own expert slots.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    with open(cfg_path) as f:
        raw = json.load(f)
    cfg = config_from_hf(raw, path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    if cfg.moe:
        from engine.moe.checkpoint import SafetensorsDict
        return cfg, SafetensorsDict(path), load_hf_tokenizer(path, raw)
    mxfp4 = (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"   # gpt-oss's released experts
    state: dict[str, torch.Tensor] = {}
    with load_bar(files, f"loading {os.path.basename(os.path.normpath(path))}") as progress:
        for f in files:
            tensors = load_file(f)
            state.update(tensors if mxfp4 else {k: v.to(dtype) for k, v in tensors.items()})
            progress.update(os.path.getsize(f))
    if mxfp4:
        state = decode_mxfp4_state(state, dtype)
    return cfg, state, load_hf_tokenizer(path, raw)
