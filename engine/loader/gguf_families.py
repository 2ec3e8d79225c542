"""GGUF files of the sliding-window families, llama.cpp's ``gemma3`` and ``gpt-oss`` architectures, read
into the same ``ModelConfig`` and Hugging Face-named weights as their config.json directories
(engine/loader/hf_families.py), so engine/models/gemma3.py and engine/models/gpt_oss.py run them unchanged.

What llama.cpp's convert_hf_to_gguf.py writes for them, and what llama.cpp fixes in code instead (no key
in the file, so the same constants here):

- ``gemma3``: ``rope.freq_base`` and ``rope.scaling.*`` are the global layers' RoPE (the 4B+ checkpoints'
  linear factor 8); the local layers rotate unscaled with ``rope.freq_base_swa`` (written from a
  transformers 5 config's ``sliding_attention`` set; llama.cpp's default, 10k, without it), and every 6th
  layer is global (llama.cpp's ``set_swa_pattern(6)``); ``attention.sliding_window`` is their window. The
  attention scale is not written: llama.cpp takes ``1/sqrt(head_dim)``, or ``1/sqrt(hidden / heads)`` for
  the 62-layer 27B, which is each released checkpoint's ``query_pre_attn_scalar``. Every ``*norm.weight`` is stored as
  ``1 + w`` (Gemma's RMSNorm scale): the 1 is taken off here and the model adds it back
  (``Gemma3Model.fold_norm_offsets``). ``final_logit_softcapping`` when the checkpoint had one.
- ``gpt-oss``: yarn from ``rope.scaling.*``; ``truncate`` is not written, and every gpt-oss config has it
  false, so it is read as false (transformers' and the reference implementation's ramp). Even layers
  slide over ``attention.sliding_window`` keys (``set_swa_pattern(2)``); the clamped SwiGLU's alpha 1.702
  and limit 7 are fixed. The converter splits the experts' interleaved ``gate_up_proj`` into
  ``ffn_gate_exps`` / ``ffn_up_exps`` (E, I, H) and transposes ``down_proj`` (``ffn_down_exps``, E, H, I),
  biases alongside; the sinks are ``attn_sinks``, the router ``ffn_gate_inp`` (weight and bias). The
  released files keep the expert weights as MXFP4 blocks: decoded to float at load (gguf_file.dequantize).

Weights are read as float: a file's 4-bit blocks are not kept for 4-bit serving (``int4_groups`` stays empty),
so ``quantization="int4"`` quantizes these models from the decoded floats, as it does a Hugging Face directory.
"""

from __future__ import annotations

import torch

from engine.loader.model_config import ModelConfig

FAMILY_ARCHS = {"gemma3": "gemma3", "gpt-oss": "gpt_oss"}   # GGUF architecture -> our family
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0              # llama.cpp's defaults for gemma3
GPT_OSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}   # llama.cpp's constants for gpt-oss

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_ATTENTION = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "post_attention_norm": "post_attention_layernorm"}
_LAYER_NAMES = {
    "gemma3": {**_ATTENTION, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    "gpt-oss": {**_ATTENTION, "ffn_gate_inp": "mlp.router"},
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _refuse(source: str, key: str, value, why: str) -> ValueError:
    return ValueError(f"{source}: GGUF metadata {key!r} = {value!r} is not supported: {why}")


def family_config(arch: str, f, tensors: dict, rope: dict, source: str) -> ModelConfig:
    """``f(key, default)``: ``<arch>.key``; ``tensors``: name -> shape (GGUF order); ``rope``: the file's
    RoPE scaling (engine/loader/gguf_arch.py's ``gguf_rope``)."""
    n_layers, hidden, heads = int(f("block_count")), int(f("embedding_length")), int(f("attention.head_count"))
    head_dim = int(f("attention.key_length", hidden // heads))
    if int(f("rope.dimension_count", head_dim)) != head_dim:
        raise _refuse(source, f"{arch}.rope.dimension_count", f("rope.dimension_count"),
                      f"{arch} rotates whole heads ({head_dim} dimensions)")
    window = f("attention.sliding_window")
    if not isinstance(window, int) or window < 1:
        raise _refuse(source, f"{arch}.attention.sliding_window", window, f"{arch} needs its layers' window")
    common = dict(architecture=FAMILY_ARCHS[arch], vocab_size=int(tensors["token_embd.weight"][1]),
                  hidden_size=hidden, num_layers=n_layers, num_heads=heads,
                  num_kv_heads=int(f("attention.head_count_kv", heads)), head_dim=head_dim,
                  rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-6)),
                  max_position_embeddings=int(f("context_length", 4096)),
                  tie_word_embeddings="output.weight" not in tensors)
    try:
        if arch == "gemma3":
            return _gemma3(f, common, window, rope)
        return _gpt_oss(f, common, window, rope, tensors, source)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _gemma3(f, common: dict, window: int, rope: dict) -> ModelConfig:
    n, theta = common["num_layers"], float(f("rope.freq_base", 1e6))
    scalar = common["hidden_size"] / common["num_heads"] if n == 62 else common["head_dim"]   # llama.cpp's rule
    cap = f("final_logit_softcapping")
    local_theta = float(f("rope.freq_base_swa", GEMMA3_LOCAL_THETA))
    settings = {"global_rope": (theta, rope), "local_rope": (local_theta, {}),
                "query_pre_attn_scalar": float(scalar), "final_logit_softcapping": None if cap is None else float(cap)}
    return ModelConfig(**common, intermediate_size=int(f("feed_forward_length")), rope_theta=theta,
                       rope_scaling=rope, qk_norm=True, family_settings=settings,
                       sliding_windows=tuple(window if (i + 1) % GEMMA3_PATTERN else None for i in range(n)))


def _gpt_oss(f, common: dict, window: int, rope: dict, tensors: dict, source: str) -> ModelConfig:
    if "blk.0.attn_q.bias" not in tensors:
        raise ValueError("gpt-oss without attention biases (blk.0.attn_q.bias) is not gpt-oss")
    if rope.get("rope_type") == "yarn":
        rope = {**rope, "truncate": False}
    settings = {"num_experts": int(f("expert_count")), "top_k": int(f("expert_used_count")), **GPT_OSS_SWIGLU}
    if not 1 <= settings["top_k"] <= settings["num_experts"]:
        raise _refuse(source, "gpt-oss.expert_used_count", settings["top_k"],
                      f"1..expert_count ({settings['num_experts']})")
    n = common["num_layers"]
    return ModelConfig(**common, intermediate_size=int(f("expert_feed_forward_length")),
                       rope_theta=float(f("rope.freq_base", 150000.0)), rope_scaling=rope, attention_bias=True,
                       family_settings=settings,
                       sliding_windows=tuple(window if i % 2 == 0 else None for i in range(n)))


def family_state(arch: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file's float32 tensors (GGUF names, row-major shapes) as the Hugging Face checkpoint's weights."""
    names, state, experts = _LAYER_NAMES[arch], {}, {}
    for name, t in tensors.items():
        if name in _TOP:
            key = _TOP[name]
        else:
            _, idx, rest = name.split(".", 2) if name.startswith("blk.") else ("", "", name)
            base, kind = rest.rsplit(".", 1)
            if arch == "gpt-oss" and base in _EXPERTS:
                experts[(int(idx), base, kind)] = t
                continue
            if arch == "gpt-oss" and base == "attn_sinks":
                key = f"model.layers.{idx}.self_attn.sinks"
            elif base in names:
                key = f"model.layers.{idx}.{names[base]}.{kind}"
            else:
                raise ValueError(f"unexpected tensor {name} in a {arch} GGUF file")
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t - 1.0                                       # the converter stored 1 + w
        state[key] = t.to(dtype)
    for idx in sorted({i for i, _, _ in experts}):
        state.update({k: v.to(dtype) for k, v in _gpt_oss_experts(idx, experts).items()})
    return state


def _gpt_oss_experts(idx: int, experts: dict) -> dict[str, torch.Tensor]:
    """One layer's stacked experts back in the checkpoint's layout: gate and up interleaved in the columns of
    ``gate_up_proj`` (E, H, 2I), ``down_proj`` (E, I, H)."""
    def get(base, kind):
        t = experts.get((idx, base, kind))
        if t is None:
            raise ValueError(f"gpt-oss GGUF: blk.{idx}.{base}.{kind} is missing")
        return t

    prefix = f"model.layers.{idx}.mlp.experts."
    gate, up = get("ffn_gate_exps", "weight"), get("ffn_up_exps", "weight")                  # (E, I, H) each
    gate_b, up_b = get("ffn_gate_exps", "bias"), get("ffn_up_exps", "bias")                  # (E, I) each
    gate_up = torch.stack([gate, up], dim=2).flatten(1, 2)                                  # (E, 2I, H)
    return {prefix + "gate_up_proj": gate_up.transpose(1, 2).contiguous(),
            prefix + "gate_up_proj_bias": torch.stack([gate_b, up_b], dim=-1).flatten(-2),
            prefix + "down_proj": get("ffn_down_exps", "weight").transpose(1, 2).contiguous(),    # (E, I, H)
            prefix + "down_proj_bias": get("ffn_down_exps", "bias")}
