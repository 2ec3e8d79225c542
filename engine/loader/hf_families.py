"""Config fields of the sliding-window families: Mistral's ``sliding_window``, Gemma 3 (text) and
gpt-oss, read from a Hugging Face ``config.json`` into ``ModelConfig``.

Each field that changes the math is read here and honoured by the model (engine/models/gemma3.py,
engine/models/gpt_oss.py) or refused with its name and value. Per-layer sliding windows follow
transformers: ``layer_types`` (``sliding_attention`` / ``full_attention``), else Gemma 3's
``sliding_window_pattern`` (every n-th layer global) or gpt-oss's alternation (even layers slide).
"""

from __future__ import annotations

from engine.loader.arch_fields import FIELDS, check_fields
from engine.loader.model_config import ModelConfig
from engine.models.rope import check_rope_scaling

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


# RoPE types transformers' ROPE_INIT_FUNCTIONS computes that these families' RotaryEmbedding accepts
# (engine/models/rope.py); longrope's short / long switch follows the engine's context through
# ``model.rope`` only, so Gemma 3, which keeps one table per layer kind, refuses it
_ROPE_TYPES = {"gemma3": ("default", "linear", "dynamic", "llama3", "yarn"),
               "gpt_oss": ("default", "linear", "dynamic", "llama3", "yarn", "longrope")}


def family_rope(params, cfg: dict, family: str, source: str, field: str) -> tuple[float, dict]:
    """``(rope_theta, rope_scaling in engine/models/rope.py's form)`` of one RoPE parameter set, completed as
    transformers' ``standardize_rope_params`` does (``type`` for ``rope_type``; llama3 / yarn / longrope
    without ``original_max_position_embeddings`` take ``max_position_embeddings``)."""
    rope = dict(params or {})
    kind = rope.pop("type", None)
    rope.setdefault("rope_type", kind or "default")
    if kind is not None and kind != rope["rope_type"]:
        raise refuse(source, field, params, "'type' and 'rope_type' disagree")
    if rope["rope_type"] not in _ROPE_TYPES[family]:
        raise refuse(source, field, params, f"rope_type one of {list(_ROPE_TYPES[family])} for this family")
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(source, field, params, "this family rotates whole heads (partial_rotary_factor 1)")
    if "rope_theta" not in rope:
        raise refuse(source, field, params, "a rope_theta")
    theta = float(rope.pop("rope_theta"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", int(cfg.get("max_position_embeddings", 4096)))
    if rope["rope_type"] == "default":
        rope.pop("rope_type")
    try:
        check_rope_scaling(rope, source)
    except ValueError as exc:
        raise refuse(source, field, params, str(exc).removeprefix(f"{source}: ")) from None
    return theta, rope


def _base(cfg: dict, family: str, **kw) -> ModelConfig:
    n_head = int(cfg["num_attention_heads"])
    return ModelConfig(
        architecture=family, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=n_head, num_kv_heads=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), **kw)


def _gemma3_ropes(cfg: dict, source: str) -> dict[str, dict]:
    """The ``full_attention`` and ``sliding_attention`` RoPE parameter sets, as transformers' Gemma 3 config
    completes them: ``rope_parameters`` (transformers 5), else ``rope_scaling`` over the global layers' default
    with ``rope_theta`` (1M) and the local layers' default with ``rope_local_base_freq`` (10k)."""
    params = dict(cfg.get("rope_parameters") or {})
    extra = sorted(set(params) - set(_LAYER_TYPES))
    if extra:
        raise refuse(source, "rope_parameters", params, f"one parameter set per layer kind {list(_LAYER_TYPES)}")
    full = dict(params.get("full_attention") or {"rope_type": "default"}, **(cfg.get("rope_scaling") or {}))
    full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
    return {"full_attention": full, "sliding_attention": local}


def gemma3_config(cfg: dict, source: str) -> ModelConfig:
    """Global layers rotate with ``full_attention``'s RoPE (the 4B+ checkpoints: linear, factor 8), local
    ones with ``sliding_attention``'s; each kind's table is engine/models/rope.py's for its own set."""
    check_fields(FIELDS["gemma3"], cfg, source, "gemma3")
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    windows = layer_windows(cfg, source, ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(n)])
    ropes = {kind: family_rope(params, cfg, "gemma3", source, f"rope_parameters.{kind}")
             for kind, params in _gemma3_ropes(cfg, source).items()}
    softcap = cfg.get("final_logit_softcapping")
    settings = {"global_rope": ropes["full_attention"], "local_rope": ropes["sliding_attention"],
                "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
                "final_logit_softcapping": None if softcap is None else float(softcap)}
    theta, scaling = ropes["full_attention"]
    return _base(cfg, "gemma3", rope_theta=theta, rope_scaling=scaling, qk_norm=True,
                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), sliding_windows=windows,
                 family_settings=settings)


def gpt_oss_config(cfg: dict, source: str) -> ModelConfig:
    """RoPE from ``rope_parameters`` or ``rope_scaling`` + ``rope_theta`` (the released checkpoints: yarn,
    factor 32, beta_fast 32, beta_slow 1, original length 4096, truncate false)."""
    check_fields(FIELDS["gpt_oss"], cfg, source, "gpt_oss")
    n = int(cfg["num_hidden_layers"])
    windows = layer_windows(cfg, source, ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)])
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {"rope_type": "default"},
                                                rope_theta=cfg.get("rope_theta", 150000.0))
    theta, scaling = family_rope(params, cfg, "gpt_oss", source, field)
    settings = {"num_experts": int(cfg["num_local_experts"]), "top_k": int(cfg["num_experts_per_tok"]),
                "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}
    if not 1 <= settings["top_k"] <= settings["num_experts"]:
        raise refuse(source, "num_experts_per_tok", settings["top_k"],
                     f"1..num_local_experts ({settings['num_experts']})")
    return _base(cfg, "gpt_oss", rope_theta=theta, rope_scaling=scaling, attention_bias=True,
                 tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), sliding_windows=windows,
                 family_settings=settings)


def family_config(arch: str, cfg: dict, source: str) -> ModelConfig:
    family = FAMILY_ARCHITECTURES[arch]
    return gemma3_config(cfg, source) if family == "gemma3" else gpt_oss_config(cfg, source)
