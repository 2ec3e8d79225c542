"""Which keys each query may see in a layer with a sliding window (or any non-plain layer).

A layer described by a non-plain ``LayerAttention`` (engine/attention/base.py) is served by the
torch backend one sequence at a time: the keys the step's queries can see (for a window ``W``,
from position ``kv_len - q_len - W + 1`` on, never the whole context) are gathered once per
sequence and attended with an explicit mask, through ``grouped_attention`` with the layer's
scale, soft-cap and sinks. Layers that share a window share one plan per step.

The mask is transformers' ``sliding_window_causal_mask_function``: query position ``p`` sees key
position ``j`` when ``j <= p`` and ``j > p - W``.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import BatchLayout


class WindowedPlan:
    """One step's per-sequence key slots and masks, for each window some layer uses. A layer with a window
    reads the sliding layers' own page tables when the pool keeps only their window
    (``layout.window_page_tables``, engine/window_pool.py); a layer without, the full ones."""

    def __init__(self, layout: BatchLayout, windows: set[int | None], page_size: int, device) -> None:
        # window -> [(first row, end row, key slots (n,) int64, mask (q_len, n) bool)] per sequence
        self.by_window = {}
        for w in windows:
            tables = layout.page_tables if w is None or layout.window_page_tables is None else layout.window_page_tables
            self.by_window[w] = _sequence_keys(layout, tables, w, page_size, device)


def _sequence_keys(layout: BatchLayout, tables: list[list[int]], window: int | None, P: int, device) -> list:
    entries, row = [], 0
    for ql, kl, pages in zip(layout.q_lens, layout.kv_lens, tables):
        first = 0 if window is None else max(0, kl - ql - window + 1)   # oldest key any query sees
        pos = np.arange(first, kl)                                      # key positions (n,)
        p = np.asarray(pages, dtype=np.int64)[pos // P]
        if window is not None and len(p) and not p.all():   # page 0: a sliding page dropped, never handed out
            raise RuntimeError(f"a sliding layer's window reads a dropped page (positions {first}..{kl - 1})")
        slots = p * P + pos % P                                         # (n,)
        qpos = np.arange(kl - ql, kl)[:, None]                          # (ql, 1)
        allowed = pos[None, :] <= qpos                                  # (ql, n)
        if window is not None:
            allowed &= pos[None, :] > qpos - window
        entries.append((row, row + ql, torch.from_numpy(slots).to(device), torch.from_numpy(allowed).to(device)))
        row += ql
    return entries

