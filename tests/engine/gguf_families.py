"""Write a transformers model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does for its
architecture: the ``gguf`` package's writer, llama.cpp's tensor names (gguf.constants.TENSOR_NAMES) and
metadata keys, q/k rows interleaved for llama, llama3 RoPE as a ``rope_freqs`` tensor, Phi-3's longrope
as ``rope_factors_short`` / ``rope_factors_long`` + attention factor; Gemma 3 and gpt-oss as its Gemma3Model
and GptOssModel write them (``write_family_gguf``: norms stored as 1 + w, gpt-oss's experts split and
transposed). Float32 tensors (no quantization), so the GGUF model is the checkpoint's model. A test helper:
the oracle our GGUF loader is checked with."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

gguf = __import__("gguf")
ARCH = {"Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3", "Qwen3Moe": "qwen3moe", "Phi3": "phi3"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.qkv_proj": "attn_qkv", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: pairs of rotated dimensions made adjacent."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _shape_metadata(w, cfg) -> None:
    """The keys every converted architecture writes: context, widths, depth, heads, the norms' epsilon."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def _rope_scaling(w, rope: dict, betas: bool) -> None:
    """A linear or yarn RoPE's keys as the converter writes them (``betas``: yarn's beta_fast / beta_slow
    too, where the config sets them: the sliding-window families' converters write them)."""
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if betas and rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if betas and rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _metadata(w, arch: str, cfg, rot: int, head_dim: int) -> None:
    _shape_metadata(w, cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(rot)
    w.add_vocab_size(cfg.vocab_size)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    if rope["rope_type"] in ("linear", "yarn"):
        _rope_scaling(w, rope, betas=False)
    elif rope["rope_type"] == "longrope":             # Phi3MiniModel.set_gguf_parameters
        orig = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_rope_scaling_orig_ctx_len(orig)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _tokenizer(w, fields: dict) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(fields["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(fields["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(fields["tokenizer.chat_template"])


def _tensors(checkpoint, arch: str, cfg):
    """(GGUF name, float32 array) of every weight of the checkpoint's files, llama.cpp's names and layouts."""
    state = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(f).items()})
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                yield "output.weight", t
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            yield {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[name], t
            continue
        _, _, idx, rest = name.split(".", 3)
        base, kind = rest.rsplit(".", 1)
        if ".experts." in base:                         # mlp.experts.E.gate_proj -> stacked ffn_gate_exps
            e, proj = base.split(".")[2:]
            experts.setdefault((idx, proj), {})[int(e)] = t
            continue
        if arch == "llama" and base in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            t = _permute(t, heads)
        yield f"blk.{idx}.{LAYER[base]}.{kind}", t
    for (idx, proj), per in experts.items():
        stacked = torch.stack([per[e] for e in sorted(per)])                # (E, out, in)
        yield f"blk.{idx}.ffn_{proj.split('_')[0]}_exps.weight", stacked


def write_out(w) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to its file, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(checkpoint, cfg, prefix: str, path, tokenizer_fields: dict) -> None:
    """The checkpoint directory's weights (transformers config ``cfg``) as a GGUF file at ``path``."""
    arch = ARCH[prefix]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg, rot, head_dim)
    _tokenizer(w, tokenizer_fields)
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_factors(rope, rope["rope_theta"], rot))
    if rope["rope_type"] == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, t in _tensors(checkpoint, arch, cfg):
        w.add_tensor(name, t.numpy().astype(np.float32))
    write_out(w)


# --- the sliding-window families: convert_hf_to_gguf.py's Gemma3Model and GptOssModel ---------------------

def _family_metadata(w, arch: str, cfg) -> None:
    """TextModel.set_gguf_parameters and the family's own keys (llama.cpp fixes the rest in code)."""
    _shape_metadata(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)   # gemma3: the global layers' set
    w.add_rope_freq_base(rope["rope_theta"])
    if "sliding_attention" in cfg.rope_parameters:                          # transformers 5 configs
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    _rope_scaling(w, rope, betas=True)
    if arch == "gemma3" and cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "gpt-oss":
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)


def _representable(arch: str, cfg) -> None:
    """What llama.cpp fixes in code (or writes no key for: the local layers' RoPE scaling) must be what the
    checkpoint has, or the file would be another model."""
    if arch == "gemma3":
        local = cfg.rope_parameters["sliding_attention"]
        scalar = cfg.hidden_size // cfg.num_attention_heads if cfg.num_hidden_layers == 62 else cfg.head_dim
        ok = (local["rope_type"] == "default" and cfg.query_pre_attn_scalar == scalar
              and cfg.layer_types == [("full_attention" if (i + 1) % 6 == 0 else "sliding_attention")
                                      for i in range(cfg.num_hidden_layers)])
    else:
        ok = (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0) and cfg.layer_types == [
            ("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(cfg.num_hidden_layers)]
    if not ok:
        raise ValueError(f"{arch}: llama.cpp's fixed settings (layer pattern, local RoPE, attention scale, SwiGLU) "
                         "are not this checkpoint's")


def _family_tensors(checkpoint, arch: str, cfg):
    """Gemma3Model.modify_tensors (norms stored as 1 + w) / GptOssModel.modify_tensors (gate_up split, experts
    transposed, sinks named .weight), then gguf's tensor-name map, as the converter's map_tensor_name."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.GPT_OSS,
                                     cfg.num_hidden_layers)
    state = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(f).items()})
    for name, t in state.items():
        out: list[tuple[str, torch.Tensor]] = [(name, t)]
        if arch == "gemma3" and name.endswith("norm.weight"):
            out = [(name, t + 1)]
        elif name.endswith("sinks"):
            out = [(name + ".weight", t)]
        elif name.endswith("gate_up_proj_bias"):
            base = name.removesuffix("gate_up_proj_bias")
            out = [(base + "gate_proj.bias", t[..., ::2]), (base + "up_proj.bias", t[..., 1::2])]
        elif name.endswith("gate_up_proj"):
            t = t.transpose(-1, -2)                                              # (E, 2I, H)
            base = name.removesuffix("gate_up_proj")
            out = [(base + "gate_proj.weight", t[:, ::2, :]), (base + "up_proj.weight", t[:, 1::2, :])]
        elif name.endswith("down_proj_bias"):
            out = [(name.replace("down_proj_bias", "down_proj.bias"), t)]
        elif name.endswith("experts.down_proj"):
            out = [(name + ".weight", t.transpose(-1, -2))]                      # (E, H, I)
        for hf, tensor in out:
            if hf == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            yield names.get_name(hf, try_suffixes=(".weight", ".bias")), tensor.contiguous()


def write_family_gguf(checkpoint, cfg, path, tokenizer_fields: dict, mxfp4_experts: bool = False) -> None:
    """A Gemma 3 (text) or gpt-oss checkpoint directory (transformers config ``cfg``) as llama.cpp's converter
    writes it, float32 tensors, at ``path``; ``mxfp4_experts``: gpt-oss's expert weights as MXFP4 blocks, as
    the released GGUF files hold them (gguf.quants' quantizer)."""
    arch = {"gemma3_text": "gemma3", "gpt_oss": "gpt-oss"}[cfg.model_type]
    _representable(arch, cfg)
    w = gguf.GGUFWriter(str(path), arch)
    _family_metadata(w, arch, cfg)
    _tokenizer(w, tokenizer_fields)
    for name, t in _family_tensors(checkpoint, arch, cfg):
        arr = t.numpy().astype(np.float32)
        if mxfp4_experts and name.endswith("_exps.weight"):
            mxfp4 = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(name, gguf.quants.quantize(arr, mxfp4), raw_dtype=mxfp4)
        else:
            w.add_tensor(name, arr)
    write_out(w)
