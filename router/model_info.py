"""What a router needs of the model: its tokenizer with chat template, context length and id.

The router never loads weights: for a GGUF file it reads only the metadata (the file is
memory-mapped, tensors are not touched); for a Hugging Face directory, ``tokenizer.json``
and ``config.json``. The model id is derived exactly as ``engine.loader.load_model_files``
derives it, because it seeds the block hashes (contract 1) and must equal the workers'.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RouterModel:
    tokenizer: Any  # engine.tokenizer.Tokenizer
    max_model_len: int
    model_id: str


def _gguf_tokenizer(path: str) -> tuple[Any, int]:
    from gguf import GGUFReader

    from engine.loader.gguf_loader import _field
    from engine.tokenizer import Tokenizer, tokenizer_from_gguf_fields

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    hf = tokenizer_from_gguf_fields(
        tokens=list(_field(reader, "tokenizer.ggml.tokens")),
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        pre=_field(reader, "tokenizer.ggml.pre", "default"))
    tok = Tokenizer(hf=hf, chat_template=_field(reader, "tokenizer.chat_template"),
                    bos_token_id=int(bos) if bos is not None else None, eos_token_ids=(eos,),
                    add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))
    return tok, int(_field(reader, f"{arch}.context_length", 4096))


def _hf_tokenizer(path: str) -> tuple[Any, int]:
    from engine.loader.hf_loader import load_hf_tokenizer

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    return load_hf_tokenizer(path, raw), int(raw.get("max_position_embeddings", 4096))


def load_router_model(path: str | None, served_model_name: str | None = None,
                      max_model_len: int | None = None) -> RouterModel:
    """The tokenizer side of ``path`` (None: the embedded default model)."""
    from engine.loader.gguf_loader import default_model_path

    if path is None:
        path, model_id = default_model_path(), "SmolLM2-135M-Instruct"
    else:
        model_id = os.path.basename(os.path.normpath(path))
        model_id = model_id[:-5] if model_id.endswith(".gguf") else model_id
    if os.path.isdir(path):
        tok, context = _hf_tokenizer(path)
    elif path.endswith(".gguf") and os.path.isfile(path):
        tok, context = _gguf_tokenizer(path)
    else:
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    return RouterModel(tok, min(max_model_len or context, context), served_model_name or model_id)
