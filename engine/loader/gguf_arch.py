"""GGUF metadata of the architectures we read (llama.cpp's keys, ``gguf.constants.Keys``): honoured or
refused, as engine/loader/arch_fields.py does for config.json, and read into ``ModelConfig``.

``general.*`` (names, licences, file type) and ``tokenizer.*`` (read by the tokenizer) do not change the
model's math; every ``<arch>.*`` key is in the architecture's table or refused, and so is any other key
(e.g. ``split.count`` of a sharded file: one file is read). RoPE: ``rope.scaling.type`` none / linear /
yarn from the metadata; llama.cpp's converter stores ``llama3`` as a ``rope_freqs`` tensor (per-dimension
divisors) and Phi-3's longrope as ``rope_factors_short`` / ``rope_factors_long`` tensors.
"""

from __future__ import annotations

from engine.loader.arch_fields import HONOURED, IRRELEVANT, check_fields
from engine.loader.gguf_families import FAMILY_ARCHS, family_config
from engine.loader.gguf_file import dequantize
from engine.loader.model_config import ModelConfig

# GGUF architecture -> our family
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3",
            **FAMILY_ARCHS}
UNSUPPORTED = {"deepseek2": "multi-head latent attention (MLA) is not implemented (DeepSeek, Kimi K2)",
               "glm4": "the GLM architecture is not implemented", "glm4moe": "the GLM architecture is not implemented"}


def _scaling_type(value, cfg):
    allowed = ("none", "linear", "yarn") + (("longrope",) if cfg.get("_arch") == "phi3" else ())
    return None if value in allowed else f"implemented: {list(allowed)}"


def _attn_factor(value, cfg):
    if cfg.get("_arch") == "phi3" or value == 1.0:
        return None
    return "llama.cpp's attention factor is only implemented for phi3 (longrope)"


def _window(value, cfg):
    if value >= cfg.get("context_length", 0):
        return None
    return f"sliding-window attention is not implemented here (a window smaller than the context of {cfg['context_length']})"


_COMMON = {
    "context_length": HONOURED, "embedding_length": HONOURED, "block_count": HONOURED,
    "feed_forward_length": HONOURED, "attention.head_count": HONOURED, "attention.head_count_kv": HONOURED,
    "attention.layer_norm_rms_epsilon": HONOURED, "rope.freq_base": HONOURED, "rope.dimension_count": HONOURED,
    "vocab_size": HONOURED, "attention.key_length": HONOURED, "attention.value_length": HONOURED,
    "rope.scaling.type": _scaling_type, "rope.scaling.factor": HONOURED,
    "rope.scaling.original_context_length": HONOURED, "rope.scaling.attn_factor": _attn_factor,
    "rope.scaling.yarn_beta_fast": HONOURED, "rope.scaling.yarn_beta_slow": HONOURED,
    "rope.scaling.finetuned": IRRELEVANT, "attention.sliding_window": _window,
    "_arch": IRRELEVANT,
}
_EXPERTS = {"expert_count": HONOURED, "expert_used_count": HONOURED, "expert_feed_forward_length": HONOURED}
FIELDS = {
    "llama": _COMMON, "qwen2": _COMMON, "qwen3": _COMMON, "phi3": _COMMON,
    "qwen3moe": {**_COMMON, **_EXPERTS, "expert_weights_norm": HONOURED},
    # engine/loader/gguf_families.py: the window slides on llama.cpp's fixed pattern of layers
    "gemma3": {**_COMMON, "attention.sliding_window": HONOURED, "final_logit_softcapping": HONOURED,
               "rope.freq_base_swa": HONOURED},
    "gpt-oss": {**_COMMON, **_EXPERTS, "attention.sliding_window": HONOURED},
}


def check_gguf_fields(fields: dict, source: str) -> str:
    """The file's GGUF architecture, after refusing any metadata key we do not honour."""
    arch = fields.get("general.architecture")
    if arch not in FAMILIES:
        why = f": {UNSUPPORTED[arch]}" if arch in UNSUPPORTED else ""
        raise ValueError(f"{source}: GGUF architecture {arch!r} is not supported{why} (supported: {sorted(FAMILIES)})")
    own = {"_arch": arch}
    for key, value in fields.items():
        if key.startswith(f"{arch}."):
            own[key[len(arch) + 1:]] = value
        elif not key.startswith(("general.", "tokenizer.")):
            raise ValueError(f"{source}: GGUF metadata {key!r} = {value!r} is not supported (not a key of {arch})")
    check_fields(FIELDS[arch], own, source, arch, kind="GGUF metadata", prefix=f"{arch}.")
    return arch


def _tensor(reader, name):
    return next((t for t in reader.tensors if t.name == name), None)


def gguf_rope(reader, arch: str, f) -> dict:
    """``ModelConfig.rope_scaling`` from the metadata and the rope tensors (``f(key)``: ``<arch>.key``)."""
    kind = f("rope.scaling.type", "none")
    orig = f("rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f("rope.scaling.factor"))}
    if kind == "yarn":
        rope = {"rope_type": "yarn", "factor": float(f("rope.scaling.factor")),
                "original_max_position_embeddings": int(orig)}
        for key, ours in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if f(key) is not None:
                rope[ours] = float(f(key))
        return rope
    short, long = _tensor(reader, "rope_factors_short.weight"), _tensor(reader, "rope_factors_long.weight")
    if short is not None and long is not None:
        rope = {"rope_type": "longrope", "short_factor": dequantize(short).tolist(),
                "long_factor": dequantize(long).tolist(), "original_max_position_embeddings": int(orig)}
        if f("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(f("rope.scaling.attn_factor"))
        return rope
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        return {"rope_type": "factors", "freq_factors": dequantize(freqs).tolist()}
    return {}


def config_from_gguf(reader, source: str) -> ModelConfig:
    arch = check_gguf_fields(reader.fields, source)
    family = FAMILIES[arch]

    def f(key, default=None):
        return reader.fields.get(f"{arch}.{key}", default)

    if arch in FAMILY_ARCHS:   # Gemma 3, gpt-oss: engine/loader/gguf_families.py
        shapes = {t.name: t.shape for t in reader.tensors}
        return family_config(arch, f, shapes, gguf_rope(reader, arch, f), source)
    n_head = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    head_dim = int(f("attention.key_length", hidden // n_head))
    names = {t.name for t in reader.tensors}
    moe = {}
    if arch == "qwen3moe":
        moe = _moe_config(f, names)
    try:
        return ModelConfig(
            architecture=family,
            vocab_size=int(f("vocab_size", len(reader.fields["tokenizer.ggml.tokens"]))),
            hidden_size=hidden,
            intermediate_size=int(f("feed_forward_length", 1)),
            num_layers=int(f("block_count")),
            num_heads=n_head,
            num_kv_heads=int(f("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            rope_theta=float(f("rope.freq_base", 10000.0)),
            rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(f("context_length", 4096)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            rope_scaling=gguf_rope(reader, arch, f),
            partial_rotary_factor=int(f("rope.dimension_count", head_dim)) / head_dim,
            moe=moe,
        )
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _moe_config(f, names: set) -> dict:
    """Qwen3-MoE's expert settings, with the config.json engine.moe reads routing rules from (llama.cpp
    always renormalises the top-k weights of qwen3moe unless ``expert_weights_norm`` says otherwise)."""
    n_layers = int(f("block_count"))
    hf = {"model_type": "qwen3_moe", "num_hidden_layers": n_layers, "num_experts": int(f("expert_count")),
          "num_experts_per_tok": int(f("expert_used_count")), "hidden_size": int(f("embedding_length")),
          "moe_intermediate_size": int(f("expert_feed_forward_length")),
          "norm_topk_prob": bool(f("expert_weights_norm", True)), "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" not in names]}
    return {"family": "qwen3_moe", "num_experts": hf["num_experts"], "top_k": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"], "shared_expert_intermediate_size": 0,
            "norm_topk_prob": hf["norm_topk_prob"], "hf_config": hf}
