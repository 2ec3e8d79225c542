"""Model loading: GGUF files and Hugging Face directories into one in-memory form."""

from __future__ import annotations

import os

import torch

from engine.loader.model_config import ModelConfig


def resolve_model(path: str | None) -> tuple[str, str]:
    """``(file or directory, model id)``; the id seeds block hashes, so router and workers agree."""
    from engine.loader.gguf_loader import default_model_path

    if path is None:
        return default_model_path(), "SmolLM2-135M-Instruct"
    model_id = os.path.basename(os.path.normpath(path))
    return path, model_id[:-5] if model_id.endswith(".gguf") else model_id


def load_tokenizer(path: str | None):
    """``(Tokenizer, context length, model id)`` without loading any weights (routers)."""
    import json

    from engine.loader.gguf_file import GGUFFile
    from engine.loader.gguf_loader import gguf_context_length, gguf_tokenizer
    from engine.loader.hf_loader import load_hf_tokenizer

    path, model_id = resolve_model(path)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        return load_hf_tokenizer(path, raw), int(raw.get("max_position_embeddings", 4096)), model_id
    if path.endswith(".gguf") and os.path.isfile(path):
        reader = GGUFFile(path)
        return gguf_tokenizer(reader), gguf_context_length(reader), model_id
    raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")


def load_model_files(path: str | None, dtype: torch.dtype = torch.float32):
    """``(ModelConfig, state_dict in HF names, Tokenizer, model_id)`` for a path (None = default)."""
    from engine.loader.gguf_loader import load_gguf
    from engine.loader.hf_loader import load_hf_dir

    path, model_id = resolve_model(path)
    if os.path.isdir(path):
        cfg, state, tok = load_hf_dir(path, dtype)
    elif path.endswith(".gguf") and os.path.isfile(path):
        cfg, state, tok = load_gguf(path, dtype)
    else:
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    return cfg, state, tok, model_id


__all__ = ["ModelConfig", "load_model_files", "load_tokenizer", "resolve_model"]
