"""Honour or refuse: every field of a config.json / GGUF header, per architecture, is either read into
``ModelConfig`` (honoured), known not to change the math (irrelevant: token ids, dtypes, training-only
settings), or refused at load time with an error naming the field and its value. An unknown field is
refused: a checkpoint whose math we cannot vouch for does not load, rather than generate tokens that
look right and are not the model's.

A rule is ``HONOURED``, ``IRRELEVANT`` or a check ``(value, cfg) -> None | str`` that accepts the values
we implement and says why it refuses any other (``cfg`` is the whole config, for values that depend on
others, e.g. a sliding window no shorter than the context never slides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HONOURED, IRRELEVANT = "honoured", "irrelevant"
Rule = str | Callable[[Any, dict], str | None]

# PretrainedConfig's own keys and those of training or generation: none changes a forward pass
_GENERIC_IRRELEVANT = (
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout", "id2label", "label2id",
    "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "tokenizer_class", "use_bfloat16", "torchscript", "tie_encoder_decoder",
    "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params", "finetuning_task",
    "_attn_implementation_autoset", "pretraining_tp",   # pretraining_tp only split the matmuls: same sums
)


def _equals(expected, what: str) -> Callable[[Any, dict], str | None]:
    def check(value, cfg):
        return None if value == expected else f"only {expected!r} is implemented ({what})"
    return check


def _silu(value, cfg):
    return None if value == "silu" else "only SwiGLU with silu is implemented"


def _context(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings", 4096))


def _window(value, cfg):
    """A sliding window is honoured when it never slides: absent, or at least the context."""
    if cfg.get("use_sliding_window") is False or value is None:
        return None
    if isinstance(value, int) and value >= _context(cfg):
        return None
    return (f"sliding-window attention is not implemented here (a window smaller than the context of "
            f"{_context(cfg)} tokens)")


def _use_window(value, cfg):
    return None if not value else _window(cfg.get("sliding_window"), {**cfg, "use_sliding_window": None})


def _full_layers(value, cfg):
    if value is None or all(t == "full_attention" for t in value):
        return None
    return "only full-attention layers are implemented"


def _dense_ok(value, cfg):
    return None if not value else "quantized checkpoints are not supported (load a full-precision one or a GGUF)"


def _rope_params(value, cfg):
    """transformers 5 writes ``rope_parameters`` (rope_theta inside); the rope module refuses what it cannot
    compute. Only Phi-3 reads partial_rotary_factor."""
    if isinstance(value, dict) and value.get("partial_rotary_factor", 1.0) != 1.0 and cfg.get("model_type") != "phi3":
        return "partial rotary embeddings are only implemented for phi3"
    return None


_DENSE = {
    "architectures": HONOURED, "model_type": HONOURED, "vocab_size": HONOURED, "hidden_size": HONOURED,
    "intermediate_size": HONOURED, "num_hidden_layers": HONOURED, "num_attention_heads": HONOURED,
    "num_key_value_heads": HONOURED, "head_dim": HONOURED, "max_position_embeddings": HONOURED,
    "rms_norm_eps": HONOURED, "tie_word_embeddings": HONOURED, "rope_theta": HONOURED,
    "rope_scaling": HONOURED, "rope_parameters": _rope_params, "hidden_act": _silu,
    "quantization_config": _dense_ok, "sliding_window": _window,
    **{k: IRRELEVANT for k in _GENERIC_IRRELEVANT},
}
_QWEN = {"use_sliding_window": _use_window, "layer_types": _full_layers,
         "max_window_layers": IRRELEVANT}  # which layers slide, when use_sliding_window is on (refused)
_MOE = {"num_experts_per_tok": HONOURED, "moe_intermediate_size": HONOURED, "norm_topk_prob": HONOURED,
        "decoder_sparse_step": HONOURED, "mlp_only_layers": HONOURED, "output_router_logits": IRRELEVANT,
        "router_aux_loss_coef": IRRELEVANT, "router_jitter_noise": IRRELEVANT}

FIELDS: dict[str, dict[str, Rule]] = {
    "llama": {**_DENSE, "attention_bias": HONOURED, "mlp_bias": _equals(False, "no MLP biases")},
    # Mistral slides every layer over sliding_window keys (engine/loader/hf_families.mistral_windows)
    "mistral": {**_DENSE, "sliding_window": HONOURED},
    "qwen2": {**_DENSE, **_QWEN},
    "qwen3": {**_DENSE, **_QWEN, "attention_bias": HONOURED},
    "phi3": {**_DENSE, "original_max_position_embeddings": HONOURED, "partial_rotary_factor": HONOURED,
             "embd_pdrop": IRRELEVANT, "resid_pdrop": IRRELEVANT},
    "mixtral": {**_DENSE, **_MOE, "num_local_experts": HONOURED},
    "qwen2_moe": {**_DENSE, **_QWEN, **_MOE, "num_experts": HONOURED, "qkv_bias": HONOURED,
                  "shared_expert_intermediate_size": HONOURED},
    "qwen3_moe": {**_DENSE, **_QWEN, **_MOE, "num_experts": HONOURED, "num_local_experts": HONOURED,
                  "attention_bias": HONOURED},
}


# the sliding-window families (engine/loader/hf_families.py reads them; it also checks what depends on
# several fields: layer_types against sliding_window, each RoPE parameter set, top-k against the experts)
_FAMILY = {k: v for k, v in _DENSE.items() if k not in ("hidden_act", "sliding_window")}
_FAMILY.update({"rope_parameters": HONOURED, "sliding_window": HONOURED, "layer_types": HONOURED})
FIELDS["gemma3"] = {
    **_FAMILY, "rope_local_base_freq": HONOURED, "sliding_window_pattern": HONOURED,
    "query_pre_attn_scalar": HONOURED, "final_logit_softcapping": HONOURED,
    "attention_bias": _equals(False, "Gemma 3 has no attention biases"),
    "use_bidirectional_attention": lambda v, cfg: None if not v else "only causal attention is implemented",
    # transformers' Gemma 3 stores it but never applies it: honouring it would not be the model
    "attn_logit_softcapping": _equals(None, "transformers' Gemma 3 never applies it"),
    "hidden_activation": _equals("gelu_pytorch_tanh", "GeGLU with the tanh GELU"),
    "cache_implementation": IRRELEVANT,   # generation's cache class ("hybrid")
    # transformers 5 writes its private copy of sliding_window_pattern next to layer_types and never reads it
    "_sliding_window_pattern": IRRELEVANT,
}
FIELDS["gpt_oss"] = {
    **_FAMILY, "num_local_experts": HONOURED, "num_experts_per_tok": HONOURED, "swiglu_alpha": HONOURED,
    "swiglu_limit": HONOURED, "attention_bias": _equals(True, "gpt-oss has q/k/v/o biases"),
    # transformers' GptOss never reads hidden_act (its experts' clamped SwiGLU is fixed) nor the original
    # release's initial_context_length (rope_scaling carries the original length)
    "hidden_act": IRRELEVANT, "initial_context_length": IRRELEVANT,
    "experts_per_token": lambda v, cfg: (None if v == cfg.get("num_experts_per_tok") else
                                         f"differs from num_experts_per_tok ({cfg.get('num_experts_per_tok')!r}), "
                                         "which transformers routes with"),
    "output_router_logits": IRRELEVANT, "router_aux_loss_coef": IRRELEVANT,
    "quantization_config": lambda v, cfg: _mxfp4(v),
}


def _mxfp4(value) -> str | None:
    """The released checkpoints' MXFP4 experts, decoded at load (engine/loader/mxfp4.py); which tensors are
    packed is told by their names (``*_blocks`` / ``*_scales``), so ``modules_to_not_convert`` changes nothing."""
    if isinstance(value, dict) and value.get("quant_method") == "mxfp4" and set(value) <= {"quant_method",
                                                                                           "modules_to_not_convert"}:
        return None
    return "only gpt-oss's MXFP4 experts (quant_method 'mxfp4') are read"


def check_fields(rules: dict[str, Rule], cfg: dict, source: str, family: str,
                 kind: str = "config.json field", prefix: str = "") -> None:
    """Raise ValueError naming the first field of ``cfg`` (``prefix`` + key in the message) that ``rules``
    refuses or does not know."""
    for key, value in cfg.items():
        rule, name = rules.get(key), f"'{prefix}{key}'"
        if rule is None:
            raise ValueError(f"{source}: {kind} {name} = {value!r} is not supported for {family} "
                             f"(a field this loader does not know may change the model's math, so it is refused)")
        if callable(rule):
            why = rule(value, cfg)
            if why is not None:
                raise ValueError(f"{source}: {kind} {name} = {value!r} is not supported: {why}")
