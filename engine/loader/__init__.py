"""Model loading: GGUF files and Hugging Face directories into one in-memory form."""

from __future__ import annotations

import os

import torch

from engine.loader.model_config import ModelConfig


def load_model_files(path: str | None, dtype: torch.dtype = torch.float32):
    """``(ModelConfig, state_dict in HF names, Tokenizer, model_id)`` for a path (None = default)."""
    from engine.loader.gguf_loader import default_model_path, load_gguf
    from engine.loader.hf_loader import load_hf_dir

    if path is None:
        path = default_model_path()
        model_id = "SmolLM2-135M-Instruct"
    else:
        model_id = os.path.basename(os.path.normpath(path))
        if model_id.endswith(".gguf"):
            model_id = model_id[:-5]
    if os.path.isdir(path):
        cfg, state, tok = load_hf_dir(path, dtype)
    elif path.endswith(".gguf") and os.path.isfile(path):
        cfg, state, tok = load_gguf(path, dtype)
    else:
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    return cfg, state, tok, model_id


__all__ = ["ModelConfig", "load_model_files"]
