"""Pure-torch paged attention (CPU and CUDA) on the head-major ``HSD`` KV layout.

Decode: all decoding sequences are served by one pair of batched matmuls over
the *union* of their pages. Sequences that share a prefix (one system prompt,
one session's history) share its pages, so each page is read once per step
instead of once per sequence, and with pages handed out lowest-first the union
is usually one compact range that is read in place, without a copy. A
per-sequence mask selects each row's own slots.

Prefill chunks: per sequence, the keys are gathered (one copy) and attended with
a bottom-right causal mask, or SDPA's ``is_causal`` when nothing was cached
before the chunk.

``engine/attention/reference.py`` is the plain oracle both paths are tested against.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout

# read the union as one range when it wastes at most this factor over the union itself
_RANGE_SLACK = 1.5


class TorchAttentionBackend(AttentionBackend):
    kv_layout = "HSD"

    def plan(self, layout: BatchLayout) -> None:
        dev = self.kv.k[0].device
        P = self.kv.page_size
        self.slots = layout.slot_mapping
        self.prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        rows, dec_pages, dec_lens = [], [], []
        row = 0
        for ql, kl, pages in zip(layout.q_lens, layout.kv_lens, layout.page_tables):
            n_pages = -(-kl // P)
            if ql == 1 and kl > 1:
                rows.append(row)
                dec_pages.append(pages[:n_pages])
                dec_lens.append(kl)
            else:
                idx = _slots_of(pages[:n_pages], kl, P)
                mask = None
                if kl != ql:
                    qpos = np.arange(kl - ql, kl)[:, None]
                    mask = torch.from_numpy(np.arange(kl)[None, :] <= qpos).to(dev)  # (ql, kl)
                self.prefills.append((row, row + ql, torch.from_numpy(idx).to(dev), mask))
            row += ql
        self.decode = None
        if rows:
            self.decode = self._plan_decode(rows, dec_pages, dec_lens, P, dev)

    @staticmethod
    def _plan_decode(rows, dec_pages, dec_lens, P, dev):
        union = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in dec_pages]))
        lo, hi = int(union[0]), int(union[-1])
        if hi - lo + 1 <= _RANGE_SLACK * len(union):
            col_of_page = lambda p: np.asarray(p, dtype=np.int64) - lo       # noqa: E731
            n_cols, source = (hi - lo + 1) * P, (lo * P, (hi - lo + 1) * P)  # a view of this range
        else:
            col_of_page = lambda p: np.searchsorted(union, p)                # noqa: E731
            n_cols, source = len(union) * P, torch.from_numpy(_slots_of(union.tolist(), len(union) * P, P)).to(dev)
        mask = np.zeros((len(rows), n_cols), dtype=bool)
        for b, (pages, kl) in enumerate(zip(dec_pages, dec_lens)):
            cols = (col_of_page(pages)[:, None] * P + np.arange(P)[None, :]).reshape(-1)[:kl]
            mask[b, cols] = True
        return (torch.tensor(rows, device=dev), source, torch.from_numpy(mask).to(dev))

    def forward(self, layer, q, k, v):
        self.kv.write(layer, self.slots, k, v)
        out = torch.empty_like(q)                                     # (T, Hq, D)
        for start, end, idx, mask in self.prefills:
            ks, vs = self.kv.gather(layer, idx)                       # (Hkv, kl, D)
            qs = q[start:end]                                         # (ql, Hq, D)
            if mask is None:
                o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks, vs, is_causal=True,
                                                   enable_gqa=True)   # (Hq, ql, D)
                out[start:end] = o.transpose(0, 1)
            else:
                out[start:end] = grouped_attention(qs, ks, vs, mask)
        if self.decode is not None:
            rows, source, mask = self.decode
            if isinstance(source, tuple):
                s0, n = source
                kd, vd = self.kv.k[layer][:, s0:s0 + n], self.kv.v[layer][:, s0:s0 + n]  # views
            else:
                kd, vd = self.kv.gather(layer, source)
            # every decode row is a "query position" that may see only its own columns
            out[rows] = grouped_attention(q[rows], kd, vd, mask)
        return out


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked attention with grouped KV heads.

    q: (Q, Hq, D); k, v: (Hkv, N, D); mask: (Q, N) bool, True = may attend -> (Q, Hq, D).
    Query head h reads KV head h // (Hq // Hkv), as Hugging Face's repeat_kv does.
    """
    Q, Hq, D = q.shape
    Hkv, N, _ = k.shape
    G = Hq // Hkv
    qg = q.view(Q, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Q, D)   # (Hkv, G*Q, D)
    s = torch.bmm(qg, k.transpose(1, 2)).view(Hkv, G, Q, N)                # (Hkv, G, Q, N)
    s = s.float().mul_(1.0 / math.sqrt(D)).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype).view(Hkv, G * Q, N)
    o = torch.bmm(p, v).view(Hkv, G, Q, D)                                  # (Hkv, G, Q, D)
    return o.permute(2, 0, 1, 3).reshape(Q, Hq, D)


def _slots_of(pages: list[int], kv_len: int, page_size: int) -> np.ndarray:
    """Cache slot of each of the first ``kv_len`` tokens held in ``pages``."""
    p = np.asarray(pages, dtype=np.int64)
    return (p[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)[:kv_len]
