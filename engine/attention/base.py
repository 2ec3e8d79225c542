"""The attention backend interface.

Per step the model runner describes the batch once (:class:`BatchLayout`) and
calls ``plan``; then every layer calls ``forward(layer, q, k, v)``, which must
write the new tokens' K/V into the paged cache at ``slot_mapping`` (unless the layer's
``rotate_and_store`` already did) and return
causal attention of each sequence's new queries over all its cached keys
(bottom-right aligned: query ``i`` of a sequence with ``kv_len`` keys and
``q_len`` queries sees keys ``0 .. kv_len - q_len + i``).

A layer whose attention differs from plain ``softmax(q k^T / sqrt(D)) v`` (a sliding window,
sinks, soft-capping, another scale: :class:`LayerAttention`) is described once, after the
model is built, by ``set_layer_attention``; a backend that cannot do what a layer asks refuses
there, at start-up.
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
    # the same in the sliding layers' own pool, when they keep only a window (engine/window_pool.py;
    # page 0 where a page's sliding page was dropped); None: every layer reads the tables above
    window_page_tables: list[list[int]] | None = None
    window_slot_mapping: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """One layer's attention beyond the plain causal softmax, as transformers computes it.

    ``window``: the query at position p sees keys at positions ``p - window < j <= p`` (transformers'
    ``sliding_window``: the query and the ``window - 1`` keys before it); None: the whole context.
    ``scale``: scores are ``q . k * scale`` (Gemma's ``query_pre_attn_scalar ** -0.5``); None:
    ``1 / sqrt(head_dim)``. ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before
    the mask (Gemma 2). ``sinks``: (Hq,) a learned logit per query head that joins each row's softmax
    denominator and attends to nothing (gpt-oss).
    """

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"attention window must be a positive integer or None, got {self.window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"attention softcap must be > 0 or None, got {self.softcap!r}")
        if self.scale is not None and not self.scale > 0:
            raise ValueError(f"attention scale must be > 0 or None, got {self.scale!r}")

    @property
    def plain(self) -> bool:
        return self.window is None and self.scale is None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        parts = [f"window {self.window}" if self.window else "",
                 f"scale {self.scale:g}" if self.scale is not None else "",
                 f"softcap {self.softcap:g}" if self.softcap else "", "sinks" if self.sinks is not None else ""]
        return ", ".join(p for p in parts if p) or "plain"


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
        self.layer_attention: list[LayerAttention] = []   # empty: every layer plain

    def set_layer_attention(self, layers: list[LayerAttention]) -> None:
        """Each layer's attention (one entry per layer). A backend that supports only plain layers
        (this default) refuses any other."""
        special = [i for i, a in enumerate(layers) if not a.plain]
        if special:
            raise ValueError(f"attention backend {type(self).__name__} supports plain causal attention only; "
                             f"layers {special} ask for {layers[special[0]].describe()} (use the 'torch' backend)")
        self.layer_attention = list(layers)

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
