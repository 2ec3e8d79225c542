"""Attention backends behind one interface, registered by name and imported lazily.

Code that never touches CUDA never imports flashinfer.
"""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend, BatchLayout

_REGISTRY = {
    "torch": ("engine.attention.torch_backend", "TorchAttentionBackend"),
    "flashinfer": ("engine.attention.flashinfer_backend", "FlashInferAttentionBackend"),
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def create_backend(name: str, **kwargs) -> AttentionBackend:
    return backend_class(name)(**kwargs)


__all__ = ["AttentionBackend", "BatchLayout", "backend_class", "create_backend", "available_backends"]
