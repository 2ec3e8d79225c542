"""Model loading: GGUF files and Hugging Face directories into one in-memory form."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

from engine.loader.model_config import ModelConfig

if TYPE_CHECKING:
    import torch


def resolve_model(path: str | None) -> tuple[str, str]:
    """``(file or directory, model id)``; the id seeds block hashes, so router and workers agree."""
    from engine.loader.tokenizer_files import default_model_path

    if path is None:
        return default_model_path(), "SmolLM2-135M-Instruct"
    model_id = os.path.basename(os.path.normpath(path))
    return path, model_id[:-5] if model_id.endswith(".gguf") else model_id


def load_tokenizer(path: str | None):
    """``(Tokenizer, context length, model id)`` without loading any weights (routers)."""
    import json

    from engine.loader.gguf_file import read_gguf
    from engine.loader.tokenizer_files import gguf_context_length, gguf_tokenizer, load_hf_tokenizer

    path, model_id = resolve_model(path)
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        return load_hf_tokenizer(path, raw), int(raw.get("max_position_embeddings", 4096)), model_id
    if path.endswith(".gguf") and os.path.isfile(path):
        reader = read_gguf(path)
        return gguf_tokenizer(reader), gguf_context_length(reader), model_id
    raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")


class ModelFiles(NamedTuple):
    config: ModelConfig
    state: dict                     # HF names -> tensors in the asked dtype
    tokenizer: object               # engine.tokenizer.Tokenizer
    model_id: str
    int4_groups: dict               # HF names -> Int4Groups of a GGUF's 4-bit weights (when asked), else {}


def load_model_files(path: str | None, dtype: torch.dtype | None = None, int4_groups: bool = False,
                     dense_blocks: bool = True) -> ModelFiles:
    """A path's model (None = default), its weights in ``dtype`` (None: float32). ``int4_groups``: also keep a
    GGUF file's Q4_0 / Q4_1 blocks as they are (``ModelFiles.int4_groups``), for 4-bit serving without
    requantizing; ``dense_blocks=False``: and not the dense weights of the layers kept so (see ``load_gguf``)."""
    import torch

    from engine.loader.gguf_loader import load_gguf
    from engine.loader.hf_loader import load_hf_dir

    dtype = torch.float32 if dtype is None else dtype
    path, model_id = resolve_model(path)
    groups: dict = {}
    if os.path.isdir(path):
        cfg, state, tok = load_hf_dir(path, dtype)
    elif path.endswith(".gguf") and os.path.isfile(path):
        cfg, state, tok = load_gguf(path, dtype, groups if int4_groups else None, dense_blocks)
    else:
        raise FileNotFoundError(f"model {path!r}: expected a .gguf file or a Hugging Face directory")
    return ModelFiles(cfg, state, tok, model_id, groups)


def gguf_weight_types(path: str | None) -> set[str]:
    """The block types of a GGUF file's layer weights (``blk.*``; e.g. ``{"Q4_1"}``); empty for a
    Hugging Face directory. Reads only the header."""
    from engine.loader.gguf_file import read_gguf

    path, _ = resolve_model(path)
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        return set()
    return {t.type_name for t in read_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2}


def gguf_model_config(path: str | None):
    """A GGUF file's ``ModelConfig`` from its header alone; None for a Hugging Face directory."""
    from engine.loader.gguf_arch import config_from_gguf
    from engine.loader.gguf_file import read_gguf

    path, _ = resolve_model(path)
    if not (path.endswith(".gguf") and os.path.isfile(path)):
        return None
    return config_from_gguf(read_gguf(path), path)


def blocks_servable(weight_types: set[str]) -> bool:
    """Whether a GGUF file's layer weights (``gguf_weight_types``) can be served on blocks: 4-bit ones (Q4_0,
    Q4_1, Q4_K) and any wider ones (Q5_K, Q6_K, Q8_0, ...: 8-bit blocks), as the K-quant mixes (Q4_K_M)
    store them."""
    from engine.loader.gguf_file import Q4_TYPES, WIDER_TYPES

    return bool(weight_types & set(Q4_TYPES)) and weight_types <= set(Q4_TYPES) | WIDER_TYPES


__all__ = ["ModelConfig", "ModelFiles", "blocks_servable", "gguf_model_config", "gguf_weight_types",
           "load_model_files", "load_tokenizer", "resolve_model"]
