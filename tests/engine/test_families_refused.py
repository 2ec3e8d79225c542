"""Honour or refuse: a config.json field we do not implement fails the load, naming the field and its value
(engine/loader/arch_fields.py). The configs are transformers' own, as save_pretrained writes them, with one
field changed; the load fails on config.json, before any weight is read."""

import json

import pytest

from engine.loader import load_model_files

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
REFUSED = {  # case: (config class, overrides, text the error must contain)
    "qwen2_use_sliding_window": ("Qwen2", {"use_sliding_window": True, "sliding_window": 64},
                                 "'use_sliding_window' = True"),
    "qwen3_sliding_layers": ("Qwen3", {"layer_types": ["sliding_attention", "full_attention"]},
                             "'layer_types' = ['sliding_attention', 'full_attention']"),
    "attn_logit_softcapping": ("Llama", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0"),
    "final_logit_softcapping": ("Qwen3", {"final_logit_softcapping": 30.0}, "'final_logit_softcapping' = 30.0"),
    "query_pre_attn_scalar": ("Llama", {"query_pre_attn_scalar": 256}, "'query_pre_attn_scalar' = 256"),
    "sinks": ("Qwen2", {"use_sinks": True}, "'use_sinks' = True"),
    "hidden_act": ("Llama", {"hidden_act": "gelu_pytorch_tanh"}, "'hidden_act' = 'gelu_pytorch_tanh'"),
    "mlp_bias": ("Llama", {"mlp_bias": True}, "'mlp_bias' = True"),
    "quantization_config": ("Qwen2", {"quantization_config": {"quant_method": "awq"}}, "'quantization_config'"),
    "embedding_multiplier": ("Llama", {"embedding_multiplier": 12.0}, "'embedding_multiplier' = 12.0"),
    "rope_type": ("Llama", {"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_type 'mrope'"),
    "rope_parameter": ("Qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mrope_section": [2, 2],
                                                  "original_max_position_embeddings": 64}},
                       "'mrope_section' = [2, 2]"),
    "rope_missing_parameter": ("Llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                               "needs ['high_freq_factor', 'low_freq_factor']"),
    "partial_rotary_llama": ("Llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.5}},
                             "'rope_parameters'"),
    "phi3_sliding_window": ("Phi3", {"sliding_window": 128}, "'sliding_window' = 128"),
}
ARCHITECTURES = {  # architecture: text the error must contain
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA)",
    "Glm4MoeForCausalLM": "GLM",
    "Gemma3ForConditionalGeneration": "vision model",
}


def _write(tmp_path, prefix, overrides):
    cfg = getattr(transformers, f"{prefix}Config")(**SMALL).to_dict()
    cfg.update(overrides, architectures=[f"{prefix}ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_families_refused_field_fails_the_load(case, tmp_path):
    prefix, overrides, text = REFUSED[case]
    with pytest.raises(ValueError) as err:
        load_model_files(_write(tmp_path, prefix, overrides))
    assert text in str(err.value)


@pytest.mark.parametrize("case", ["phi3_sliding_window"])
def test_families_window_as_long_as_the_context_loads_its_config(case, tmp_path):
    """A window no shorter than the context never slides: accepted (the load goes on to the weights)."""
    prefix, overrides, _ = REFUSED[case]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model_files(_write(tmp_path, prefix, {k: 256 for k in overrides}))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_families_unsupported_architecture_is_refused_by_name(arch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "architectures": [arch]}))
    with pytest.raises(ValueError) as err:
        load_model_files(str(tmp_path))
    assert arch in str(err.value) and ARCHITECTURES[arch] in str(err.value)


GGUF_BASE = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
             "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 128}
GGUF_REFUSED = {  # case: (architecture, extra metadata (key without the arch prefix, or "=full.key"), text)
    "sliding_window": ("phi3", {"attention.sliding_window": 64}, "'phi3.attention.sliding_window' = 64"),
    "mistral_window": ("llama", {"attention.sliding_window": 128}, "'llama.attention.sliding_window' = 128"),
    "rope_scaling_type": ("llama", {"rope.scaling.type": "su"}, "'llama.rope.scaling.type' = 'su'"),
    "longrope_outside_phi3": ("qwen2", {"rope.scaling.type": "longrope"}, "'qwen2.rope.scaling.type' = 'longrope'"),
    "attn_factor": ("qwen2", {"rope.scaling.attn_factor": 1.2}, "'qwen2.rope.scaling.attn_factor' = 1.2"),
    "softcapping": ("llama", {"attn_logit_softcapping": 50.0}, "'llama.attn_logit_softcapping' = 50.0"),
    "final_softcapping": ("qwen3", {"final_logit_softcapping": 30.0}, "'qwen3.final_logit_softcapping' = 30.0"),
    "expert_shared": ("qwen3moe", {"expert_shared_count": 1}, "'qwen3moe.expert_shared_count' = 1"),
    "split": ("llama", {"=split.count": 2}, "'split.count' = 2"),
    # llama.cpp fixes gemma3's layer pattern in code; a file saying otherwise is refused
    "gemma3_window_pattern": ("gemma3", {"attention.sliding_window_pattern": 4},
                              "'gemma3.attention.sliding_window_pattern' = 4"),
    "gemma3_attn_softcapping": ("gemma3", {"attn_logit_softcapping": 50.0}, "'gemma3.attn_logit_softcapping' = 50.0"),
    "gemma3_no_window": ("gemma3", {}, "'gemma3.attention.sliding_window' = None"),
    "gemma3_partial_rotary": ("gemma3", {"attention.sliding_window": 8, "attention.key_length": 16,
                                         "rope.dimension_count": 8}, "'gemma3.rope.dimension_count' = 8"),
    "gpt_oss_gating": ("gpt-oss", {"expert_gating_func": 2}, "'gpt-oss.expert_gating_func' = 2"),
    "gpt_oss_yarn_attn_factor": ("gpt-oss", {"rope.scaling.yarn_attn_factor": 1.5},
                                 "'gpt-oss.rope.scaling.yarn_attn_factor' = 1.5"),
}
GGUF_ARCHITECTURES = {"deepseek2": "(MLA)", "glm4moe": "GLM"}


def _write_gguf(path, arch, extra):
    gguf = pytest.importorskip("gguf")
    from tests.engine.gguf_families import write_out

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**GGUF_BASE, **extra}.items():
        name = key[1:] if key.startswith("=") else f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)
    write_out(w)
    return str(path)


@pytest.mark.parametrize("case", sorted(GGUF_REFUSED))
def test_families_refused_gguf_metadata_fails_the_load(case, tmp_path):
    arch, extra, text = GGUF_REFUSED[case]
    with pytest.raises(ValueError) as err:
        load_model_files(_write_gguf(tmp_path / "m.gguf", arch, extra))
    assert text in str(err.value)


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHITECTURES))
def test_families_unsupported_gguf_architecture_is_refused_by_name(arch, tmp_path):
    with pytest.raises(ValueError) as err:
        load_model_files(_write_gguf(tmp_path / "m.gguf", arch, {}))
    assert f"GGUF architecture '{arch}' is not supported" in str(err.value)
    assert GGUF_ARCHITECTURES[arch] in str(err.value)


GGUF_TOKENIZERS = {  # byte-level BPE with a pre-tokenizer we reproduce, or refused
    "spm": ({"=tokenizer.ggml.model": "llama"}, "'tokenizer.ggml.model' = 'llama'"),   # Gemma 3, Phi-3 files
    "o200k": ({"=tokenizer.ggml.model": "gpt2", "=tokenizer.ggml.pre": "gpt-4o"}, "'tokenizer.ggml.pre' = 'gpt-4o'"),
}


@pytest.mark.parametrize("case", sorted(GGUF_TOKENIZERS))
def test_families_refused_gguf_tokenizer_fails_the_load(case, tmp_path):
    """A GGUF tokenizer engine.tokenizer does not reproduce stops the load (engine and router alike), rather
    than split text differently from the model's own tokenizer."""
    from engine.loader import load_tokenizer

    extra, text = GGUF_TOKENIZERS[case]
    with pytest.raises(ValueError) as err:
        load_tokenizer(_write_gguf(tmp_path / "m.gguf", "llama", extra))
    assert text in str(err.value)
