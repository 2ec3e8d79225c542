"""Config fields of the sliding-window families: Mistral's ``sliding_window``, Gemma 3 (text) and
gpt-oss, read from a Hugging Face ``config.json`` into ``ModelConfig``.

Each field that changes the math is read here and honoured by the model (engine/models/gemma3.py,
engine/models/gpt_oss.py) or refused with its name and value. Per-layer sliding windows follow
transformers: ``layer_types`` (``sliding_attention`` / ``full_attention``), else Gemma 3's
``sliding_window_pattern`` (every n-th layer global) or gpt-oss's alternation (even layers slide).
"""

from __future__ import annotations

from engine.loader.model_config import ModelConfig

FAMILY_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3", "GptOssForCausalLM": "gpt_oss"}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def refuse(source: str, field: str, value, allowed: str) -> ValueError:
    return ValueError(f"{source}: config field {field}={value!r} is not supported ({allowed})")


def mistral_windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """Mistral slides every layer over ``sliding_window`` keys when it is set (transformers'
    ``create_sliding_window_causal_mask``); () when it is null."""
    window = cfg.get("sliding_window")
    return () if window is None else (int(window),) * num_layers


def layer_windows(cfg: dict, source: str, default_types: list[str]) -> tuple[int | None, ...]:
    """Each layer's window from ``layer_types`` (or ``default_types``) and ``sliding_window``."""
    types = cfg.get("layer_types") or default_types
    if len(types) != int(cfg["num_hidden_layers"]) or any(t not in _LAYER_TYPES for t in types):
        raise refuse(source, "layer_types", types, f"one of {_LAYER_TYPES} per layer")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise refuse(source, "sliding_window", window, "a positive integer when some layer slides")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rope_theta(params, source: str, field: str) -> float:
    """The base of a plain RoPE parameter set; scaled RoPE (``rope_type`` other than default) is refused
    here until engine/models/rope.py (the families branch) serves these families."""
    params = params or {}
    if params.get("rope_type", "default") != "default":
        raise refuse(source, field, params, "only rope_type 'default' for this family so far")
    return float(params["rope_theta"])


def _base(cfg: dict, family: str, **kw) -> ModelConfig:
    n_head = int(cfg["num_attention_heads"])
    return ModelConfig(
        architecture=family, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_head, num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), **kw)


def gemma3_config(cfg: dict, source: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    windows = layer_windows(cfg, source, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)])
    for field, ok in (("use_bidirectional_attention", not cfg.get("use_bidirectional_attention")),
                      ("attention_bias", not cfg.get("attention_bias")),
                      # transformers' Gemma 3 stores but never applies it: honouring it would differ
                      ("attn_logit_softcapping", cfg.get("attn_logit_softcapping") is None),
                      ("hidden_activation", cfg.get("hidden_activation", "gelu_pytorch_tanh") == "gelu_pytorch_tanh")):
        if not ok:
            raise refuse(source, field, cfg.get(field), "Gemma 3 text: causal, no attention bias, no attention "
                         "soft-capping, gelu_pytorch_tanh")
    rope = cfg.get("rope_parameters")
    if rope is None:   # the older spelling: rope_theta / rope_local_base_freq / rope_scaling
        rope = {"full_attention": dict(cfg.get("rope_scaling") or {"rope_type": "default"},
                                       rope_theta=cfg.get("rope_theta", 1e6)),
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}}
    softcap = cfg.get("final_logit_softcapping")
    settings = {"global_rope_theta": _rope_theta(rope.get("full_attention"), source, "rope_parameters.full_attention"),
                "local_rope_theta": _rope_theta(rope.get("sliding_attention"), source,
                                                "rope_parameters.sliding_attention"),
                "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
                "final_logit_softcapping": None if softcap is None else float(softcap)}
    return _base(cfg, "gemma3", rope_theta=settings["global_rope_theta"], qk_norm=True,
                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), sliding_windows=windows,
                 family_settings=settings)


def gpt_oss_config(cfg: dict, source: str) -> ModelConfig:
    n = int(cfg["num_hidden_layers"])
    windows = layer_windows(cfg, source, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    rope = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {"rope_type": "default"},
                                              rope_theta=cfg.get("rope_theta", 150000.0))
    if not cfg.get("attention_bias", True):
        raise refuse(source, "attention_bias", False, "gpt-oss has q/k/v/o biases")
    settings = {"num_experts": int(cfg["num_local_experts"]), "top_k": int(cfg["num_experts_per_tok"]),
                "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}
    if not 1 <= settings["top_k"] <= settings["num_experts"]:
        raise refuse(source, "num_experts_per_tok", settings["top_k"],
                     f"1..num_local_experts ({settings['num_experts']})")
    return _base(cfg, "gpt_oss", rope_theta=_rope_theta(rope, source, "rope_parameters"), attention_bias=True,
                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_windows=windows,
                 family_settings=settings)


def family_config(arch: str, cfg: dict, source: str) -> ModelConfig:
    family = FAMILY_ARCHITECTURES[arch]
    return gemma3_config(cfg, source) if family == "gemma3" else gpt_oss_config(cfg, source)
