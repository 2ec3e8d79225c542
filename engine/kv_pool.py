"""The paged KV pool: a fixed number of pages of ``page_size`` token slots per layer.

Layout per layer is FlashInfer's NHD: ``k[layer]`` and ``v[layer]`` are
``[num_pages, page_size, num_kv_heads, head_dim]``. A token's slot is
``page * page_size + offset``. Page 0 is never handed out: it is scratch space the
backends may point padding at.
"""

from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    """Raised by :meth:`PagePool.alloc` when fewer pages are free than asked for."""


class PagePool:
    """Free-list allocator of page ids (no tensors; the scheduler and radix cache use it)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 reserved
        self._is_free = [True] * num_pages
        self._is_free[0] = False

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = False
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)


class KVCache:
    """The K and V tensors of every layer, shaped for paged attention."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.page_size = page_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slots`` [T] int64; ``k``, ``v`` [T, Hkv, D]."""
        kf = self.k[layer].view(-1, *self.k[layer].shape[2:])  # (pages*page_size, Hkv, D)
        vf = self.v[layer].view(-1, *self.v[layer].shape[2:])
        kf[slots] = k
        vf[slots] = v
