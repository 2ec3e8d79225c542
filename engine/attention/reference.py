"""The plain reference for paged causal attention: one sequence at a time, no tricks.

Reads K/V slot by slot through the page table, expands grouped KV heads, and
applies the bottom-right causal mask explicitly (and a layer's sliding window, scale, soft-cap
and sinks, as ``LayerAttention`` defines them). Tests hold every backend to it.
"""

from __future__ import annotations

import math

import torch

from engine.attention.base import BatchLayout, LayerAttention
from engine.kv_pool import KVCache


def reference_attention(kv: KVCache, layer: int, layout: BatchLayout, q: torch.Tensor,
                        spec: LayerAttention = LayerAttention()) -> torch.Tensor:
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
        scale = 1 / math.sqrt(q.shape[-1]) if spec.scale is None else spec.scale
        scores = qs @ k.transpose(1, 2) * scale                # (Hq, ql, kl)
        if spec.softcap is not None:
            scores = spec.softcap * torch.tanh(scores / spec.softcap)
        key_pos, query_pos = torch.arange(kl)[None, :], torch.arange(kl - ql, kl)[:, None]
        allowed = key_pos <= query_pos
        if spec.window is not None:
            allowed &= query_pos - key_pos < spec.window
        scores = scores.masked_fill(~allowed, float("-inf"))
        # softmax whose denominator also holds exp(sink) of the head: sum_j exp(s_j) + exp(sink)
        denom = torch.logsumexp(scores, -1, keepdim=True)      # (Hq, ql, 1)
        if spec.sinks is not None:
            sink = spec.sinks.double()[:, None, None].expand(Hq, ql, 1)
            denom = torch.logaddexp(denom, sink)
        out[row:row + ql] = (torch.exp(scores - denom) @ v).transpose(0, 1).to(q.dtype)
        row += ql
    return out
