"""Tiny random MoE checkpoints in the real Hugging Face layout, for the tests and
``benchmarks/moe_placement.py``.

``write_tiny_checkpoint`` writes ``config.json`` with the field names of
MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM and ``model.safetensors``
with the real tensor names of a whole (tiny) decoder, so loaders are exercised on real
files; ``save_tokenizer`` adds an engine tokenizer, so the directory serves chat.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.moe.config import FAMILIES, MoEConfig, moe_layer_indices
from engine.moe.layers import expert_weight_names, moe_prefix

_ARCH = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def tiny_hf_config(family: str, vocab_size: int = 256, hidden: int = 32, num_layers: int = 2, num_heads: int = 4,
                   num_kv_heads: int = 2, num_experts: int = 8, top_k: int = 2, moe_intermediate: int = 16,
                   shared_expert_intermediate: int = 24, mlp_only_layers: tuple[int, ...] = ()) -> dict:
    """A config.json dict for a tiny model of ``family`` with the real HF field names.
    ``mlp_only_layers`` (Qwen families) keeps a dense MLP in those layers."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if family == "mixtral" and mlp_only_layers:
        raise ValueError("mixtral has an MoE block in every layer; mlp_only_layers must be empty")
    if hidden % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden must divide by num_heads and num_heads by num_kv_heads")
    common = {
        "architectures": [_ARCH[family]], "model_type": family, "vocab_size": vocab_size,
        "hidden_size": hidden, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "hidden_act": "silu", "max_position_embeddings": 512,
        "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "attention_dropout": 0.0, "num_experts_per_tok": top_k,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if family == "mixtral":
        return common | {"intermediate_size": moe_intermediate, "num_local_experts": num_experts,
                         "sliding_window": None, "router_jitter_noise": 0.0}
    qwen = common | {"num_experts": num_experts, "moe_intermediate_size": moe_intermediate,
                     "intermediate_size": 2 * moe_intermediate, "decoder_sparse_step": 1,
                     "mlp_only_layers": sorted(mlp_only_layers),
                     "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers}
    if family == "qwen2_moe":
        return qwen | {"shared_expert_intermediate_size": shared_expert_intermediate, "norm_topk_prob": False}
    return qwen | {"head_dim": hidden // num_heads, "attention_bias": False, "norm_topk_prob": True}


def tiny_state_dict(hf: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights for every tensor of the model described by ``hf``."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.1  # noqa: E731
    cfg = MoEConfig.from_hf_config(hf)
    family, h, v = cfg.family, hf["hidden_size"], hf["vocab_size"]
    hd = hf.get("head_dim", h // hf["num_attention_heads"])
    q_out, kv_out = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    moe_layers = set(moe_layer_indices(hf))
    sd = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": 1 + rand(h), "lm_head.weight": rand(v, h)}
    for n in range(hf["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd |= {p + "self_attn.q_proj.weight": rand(q_out, h), p + "self_attn.k_proj.weight": rand(kv_out, h),
               p + "self_attn.v_proj.weight": rand(kv_out, h), p + "self_attn.o_proj.weight": rand(h, q_out),
               p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h)}
        if family == "qwen2_moe":
            sd |= {p + "self_attn.q_proj.bias": rand(q_out), p + "self_attn.k_proj.bias": rand(kv_out),
                   p + "self_attn.v_proj.bias": rand(kv_out)}
        if family == "qwen3_moe":
            sd |= {p + "self_attn.q_norm.weight": 1 + rand(hd), p + "self_attn.k_norm.weight": 1 + rand(hd)}
        if n not in moe_layers:
            i = hf["intermediate_size"]
            sd |= {p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                   p + "mlp.down_proj.weight": rand(h, i)}
            continue
        m = moe_prefix(cfg, p)
        sd[m + "gate.weight"] = rand(cfg.num_experts, h) * 10  # sharper routing than the experts' scale
        for e in range(cfg.num_experts):
            g, u, d = expert_weight_names(cfg, p, e)
            sd |= {g: rand(cfg.intermediate, h), u: rand(cfg.intermediate, h), d: rand(h, cfg.intermediate)}
        if cfg.has_shared_expert:
            i = cfg.shared_expert_intermediate
            sd |= {m + "shared_expert.gate_proj.weight": rand(i, h), m + "shared_expert.up_proj.weight": rand(i, h),
                   m + "shared_expert.down_proj.weight": rand(h, i), m + "shared_expert_gate.weight": rand(1, h)}
    return sd


def write_tiny_checkpoint(directory: str | Path, family: str, seed: int = 0, **config_kwargs) -> Path:
    """Write config.json + model.safetensors into ``directory``. ``config_kwargs`` go to
    ``tiny_hf_config`` (vocab_size must cover the ids of a tokenizer added by ``save_tokenizer``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = tiny_hf_config(family, **config_kwargs)
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tiny_state_dict(hf, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def save_tokenizer(tokenizer, directory: str | Path) -> None:
    """Write an engine ``Tokenizer`` as ``tokenizer.json`` + ``tokenizer_config.json`` (chat
    template, bos/eos tokens), so a tiny checkpoint serves chat like the model it came from."""
    directory = Path(directory)
    tokenizer.hf.save(str(directory / "tokenizer.json"))
    name = lambda i: None if i is None else tokenizer.hf.id_to_token(i)  # noqa: E731
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    config = {"chat_template": tokenizer.chat_template, "bos_token": name(tokenizer.bos_token_id),
              "eos_token": name(eos), "add_bos_token": tokenizer.add_bos}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def read_hf_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())
