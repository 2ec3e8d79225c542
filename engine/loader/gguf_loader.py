"""Load a GGUF file (llama, qwen2, qwen3, qwen3moe, phi3, gemma3, gpt-oss): weights (dequantized), config,
tokenizer, template."""

from __future__ import annotations

import os

import torch

from engine.loader.gguf_arch import config_from_gguf
from engine.loader.gguf_families import FAMILY_ARCHS, family_state
from engine.loader.gguf_file import Q4_TYPES, WIDER_TYPES, dequantize, q4_blocks, q8_blocks, read_gguf
from engine.loader.progress import load_bar
from engine.models.qmatmul import Q8Blocks
from engine.models.quant import Int4Groups
# the tokenizer side, re-exported here where the loader always offered it
from engine.loader.tokenizer_files import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,  # noqa: F401
                                           default_model_path, gguf_context_length, gguf_tokenizer)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",      # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",       # Phi-3: q, k, v fused
    "ffn_gate_inp": "mlp.gate",             # MoE router
}
_PHI3_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}   # Phi-3's ffn_up holds [gate; up]
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")  # in rope_scaling


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows so rotate-half RoPE applies.

    The converter stores ``w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)``.
    """
    out_dim, in_dim = w.shape
    hd = out_dim // n_head
    # (n_head, hd/2, 2, in) -> (n_head, 2, hd/2, in)
    return w.reshape(n_head, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _unpermute_rows(out_dim: int, n_head: int) -> torch.Tensor:
    """The row order ``_unpermute_qk`` puts a q/k weight's rows in (for weights kept as 4-bit groups)."""
    hd = out_dim // n_head
    return torch.arange(out_dim).reshape(n_head, hd // 2, 2).transpose(1, 2).reshape(out_dim)


def load_gguf(path: str, dtype: torch.dtype = torch.float32, int4_groups: dict | None = None,
              dense_blocks: bool = True):
    """Returns ``(ModelConfig, state_dict in HF names, Tokenizer)`` (architectures: engine/loader/gguf_arch.py).

    ``int4_groups``: a dict that receives, by HF name, every Q4_0 / Q4_1 / Q4_K layer weight's blocks as
    ``engine.models.quant.Int4Groups`` (as stored: no requantization), for 4-bit serving; every layer weight
    in wider blocks (Q5_K, Q6_K, Q8_0, ...) as 8-bit ``engine.models.qmatmul.Q8Blocks`` (Q8_0's scheme from
    its values: a Q8_0 weight's own blocks, a Q6_K weight's within half an 8-bit step); and the Q8_0
    ``token_embd`` / ``output`` weights as ``Q8Blocks`` (the LM head of ``quantization="gguf"``).

    ``dense_blocks=False`` (with ``int4_groups``): a layer weight whose blocks go into ``int4_groups`` is not
    decoded into the state, which holds a ``meta`` tensor of its shape instead (``copy_hf_weights`` leaves such
    a weight unloaded): for a model whose every step runs those layers on their blocks (engine/builder.py)."""
    reader = read_gguf(path)
    cfg = config_from_gguf(reader, path)
    tokenizer = gguf_tokenizer(reader)   # before the weights: a refused tokenizer costs no dequantization
    arch = reader.fields["general.architecture"]
    if arch in FAMILY_ARCHS:
        return cfg, _family_state(reader, path, arch, dtype), tokenizer
    names = _PHI3_NAMES if arch == "phi3" else _LAYER_NAMES
    # llama.cpp's converter interleaves q/k rows for llama only (the others use NEOX-style RoPE)
    permuted = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if arch == "llama" else {}
    state: dict[str, torch.Tensor] = {}
    progress = load_bar([path], f"loading {os.path.basename(path)}")
    for t in reader.tensors:
        progress.update(int(t.n_bytes))
        if t.name in _ROPE_TENSORS:
            continue
        key, heads = _hf_name(path, t.name, names, permuted)
        layer = int4_groups is not None and key.startswith("model.layers.") and not key.endswith("_exps")
        if layer and t.type_name in Q4_TYPES:   # the blocks as stored: their shape is all they need
            rows = int(t.shape[-1])
            groups = Int4Groups.from_blocks(*q4_blocks(t), rows)
            int4_groups[key] = groups if heads is None else groups.rows(_unpermute_rows(rows, heads))
            if not dense_blocks:
                state[key] = torch.empty(rows, int(t.shape[0]), dtype=dtype, device="meta")
                continue
        arr = dequantize(t)
        if heads is not None:
            arr = _unpermute_qk(arr, heads)
        if key.endswith("_exps"):             # (E, out, in) stacked experts -> one HF weight per expert
            for i, w in enumerate(arr):
                state[key[:-len("_exps")].replace("{i}", str(i))] = w.to(dtype)
            continue
        if layer and t.type_name in WIDER_TYPES and arr.dim() == 2:
            int4_groups[key] = Q8Blocks.quantize(arr)     # Q8_0: its own blocks again (max |q| is 127)
            if not dense_blocks:
                state[key] = torch.empty(arr.shape, dtype=dtype, device="meta")
                continue
        if int4_groups is not None and t.type_name == "Q8_0" and key in ("model.embed_tokens.weight",
                                                                          "lm_head.weight"):
            int4_groups[key] = Q8Blocks.from_blocks(*q8_blocks(t), arr.shape[0])
        state[key] = arr.to(dtype)
    progress.close()
    return cfg, state, tokenizer


def _family_state(reader, path: str, arch: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gemma 3's and gpt-oss's state: their own layouts, read as float (no 4-bit groups kept)."""
    with load_bar([path], f"loading {os.path.basename(path)}") as progress:
        tensors = {}
        for t in reader.tensors:   # in the model dtype as read (norms float32: Gemma's 1 + w comes off first)
            progress.update(int(t.n_bytes))
            if t.name not in _ROPE_TENSORS:
                arr = dequantize(t)
                tensors[t.name] = arr if t.name.endswith("norm.weight") else arr.to(dtype)
    return family_state(arch, tensors, dtype)


def _hf_name(path: str, name: str, names: dict, permuted: dict) -> tuple[str, int | None]:
    """A GGUF tensor's Hugging Face name (experts: a ``{i}`` pattern ending in ``_exps``) and the head count
    to undo llama.cpp's q/k interleaving with (None: stored as is)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name], None
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        base, kind = rest.rsplit(".", 1)
        if base in _EXPERTS:
            return f"model.layers.{idx}.mlp.experts.{{i}}.{_EXPERTS[base]}.{kind}_exps", None
        if base in names:
            return f"model.layers.{idx}.{names[base]}.{kind}", permuted.get(base)
    raise ValueError(f"{path}: unexpected tensor {name}")
