"""Prefix block hashes: contract 1 of the design card, shared by router and engine.

A prefix is named block by block. With ``B = block_size`` and tokens encoded as
little-endian uint32::

    h_0 = H(seed || tokens[0:B])
    h_i = H(h_{i-1} || tokens[i*B:(i+1)*B])

``H`` is BLAKE2b with an 8-byte digest read as an unsigned little-endian int:
stable across processes, machines and Python versions (never ``hash()``).
``seed`` is 8 bytes derived from the model id and the tenant's cache salt, so
tenants with different salts never name the same block the same way. Only full
blocks are hashed; a partial last block is never indexed.

This is the only module that computes block hashes; router and engine import it.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

DEFAULT_BLOCK_SIZE = 16


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def make_seed(model_id: str, cache_salt: str = "") -> bytes:
    """8-byte seed for a (model, tenant cache salt) pair."""
    return hashlib.blake2b(f"{model_id}\x00{cache_salt}".encode(), digest_size=8).digest()


def hash_block(parent: int | None, seed: bytes, block: Sequence[int]) -> int:
    """Hash one full block given its parent's hash (``None`` for the first block)."""
    prefix = seed if parent is None else parent.to_bytes(8, "little")
    return _h(prefix + np.asarray(block, dtype="<u4").tobytes())


def block_hashes(tokens: Sequence[int], block_size: int, seed: bytes,
                 parent: int | None = None) -> list[int]:
    """Hashes of every full block of ``tokens``; ``parent`` continues an earlier chain."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    raw = np.asarray(tokens, dtype="<u4")
    out: list[int] = []
    for i in range(len(raw) // block_size):
        prefix = seed if parent is None else parent.to_bytes(8, "little")
        parent = _h(prefix + raw[i * block_size:(i + 1) * block_size].tobytes())
        out.append(parent)
    return out
