"""The plain reference for paged causal attention: one sequence at a time, no tricks.

Reads K/V slot by slot through the page table, expands grouped KV heads, and
applies the bottom-right causal mask explicitly. Tests hold every backend to it.
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import BatchLayout
from engine.kv_pool import KVCache


def reference_attention(kv: KVCache, layer: int, layout: BatchLayout, q: torch.Tensor) -> torch.Tensor:
    """q: (T, Hq, D) for the batch described by ``layout`` (K/V already written) -> (T, Hq, D)."""
    P = kv.page_size
    out = torch.empty_like(q)
    row = 0
    for ql, kl, pages in zip(layout.q_lens, layout.kv_lens, layout.page_tables):
        slots = torch.tensor([pages[i // P] * P + i % P for i in range(kl)])
        k, v = kv.gather(layer, slots)                       # (Hkv, kl, D)
        Hq, Hkv = q.shape[1], k.shape[0]
        k = k.repeat_interleave(Hq // Hkv, dim=0).double()    # (Hq, kl, D)
        v = v.repeat_interleave(Hq // Hkv, dim=0).double()
        qs = q[row:row + ql].transpose(0, 1).double()         # (Hq, ql, D)
        scores = qs @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        allowed = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[row:row + ql] = (torch.softmax(scores, -1) @ v).transpose(0, 1).to(q.dtype)
        row += ql
    return out
