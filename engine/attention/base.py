"""The attention backend interface.

Per step the model runner describes the batch once (:class:`BatchLayout`) and
calls ``plan``; then every layer calls ``forward(layer, q, k, v)``, which must
write the new tokens' K/V into the paged cache at ``slot_mapping`` (unless the layer's
``rotate_and_store`` already did) and return
causal attention of each sequence's new queries over all its cached keys
(bottom-right aligned: query ``i`` of a sequence with ``kv_len`` keys and
``q_len`` queries sees keys ``0 .. kv_len - q_len + i``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_pool import KVCache


@dataclass
class BatchLayout:
    """One step's batch. Sequences are in the order their tokens appear in the flat batch."""

    q_lens: list[int]            # new tokens per sequence this step
    kv_lens: list[int]           # tokens in cache per sequence after this step (incl. new)
    page_tables: list[list[int]]  # page ids per sequence, covering kv_lens
    slot_mapping: torch.Tensor   # (T,) int64 cache slot of each new token

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class AttentionBackend:
    """Paged causal attention. Subclasses implement ``plan`` and ``forward``.

    ``kv_layout`` names the KV pool layout the backend reads (see engine/kv_pool.py).
    """

    kv_layout = "NHD"

    def __init__(self, kv: KVCache, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.kv = kv
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def plan(self, layout: BatchLayout) -> None:
        raise NotImplementedError

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D). k and v are None after :meth:`rotate_and_store`
        stored them."""
        raise NotImplementedError

    def rotate_and_store(self, layer: int, qkv: torch.Tensor, rope) -> torch.Tensor | None:
        """Optional fast path before ``forward``: RoPE (``rope``: engine/models/llama.py's ``RopeTable``) on
        the q and k heads of a fused projection ``qkv`` (T, Hq + 2 Hkv, D), k and v written into the cache
        as ``forward`` would; returns q rotated, (T, Hq, D), and the layer then calls ``forward(layer, q,
        None, None)``. None: not offered for this step (the layer rotates and passes k, v to ``forward``)."""
        return None
