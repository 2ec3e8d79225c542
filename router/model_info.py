"""What a router needs of the model: its tokenizer with chat template, context length and id.

The router never loads weights: for a GGUF file it reads only the metadata (the file is
memory-mapped, tensors are not touched); for a Hugging Face directory, ``tokenizer.json``
and ``config.json``. The model id is derived exactly as ``engine.loader.load_model_files``
derives it, because it seeds the block hashes (contract 1) and must equal the workers'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RouterModel:
    tokenizer: Any  # engine.tokenizer.Tokenizer
    max_model_len: int
    model_id: str


def load_router_model(path: str | None, served_model_name: str | None = None,
                      max_model_len: int | None = None) -> RouterModel:
    """The tokenizer side of ``path`` (None: the embedded default model)."""
    from engine.loader import load_tokenizer

    tok, context, model_id = load_tokenizer(path)
    return RouterModel(tok, min(max_model_len or context, context), served_model_name or model_id)
