"""The paged KV pool: a fixed number of pages of ``page_size`` token slots per layer.

A token's slot is ``page * page_size + offset``. Two layouts, chosen by the
attention backend:
- ``"NHD"`` (FlashInfer): ``k[layer]`` is ``[num_pages, page_size, Hkv, D]``;
- ``"HSD"`` (torch): ``k[layer]`` is ``[Hkv, num_pages * page_size, D]``, so any run of
  slots is a strided view per head that matmuls read without a copy.
Page 0 is never handed out: it is scratch space the backends may point padding at.
Pages are handed out lowest id first, which keeps live KV compact in memory.
"""

from __future__ import annotations

import heapq

import torch


class OutOfPages(RuntimeError):
    """Raised by :meth:`PagePool.alloc` when fewer pages are free than asked for."""


class PagePool:
    """Free-list allocator of page ids (no tensors; the scheduler and radix cache use it)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(1, num_pages))  # a min-heap; page 0 reserved
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
        out = [heapq.heappop(self._free) for _ in range(n)]
        for p in out:
            self._is_free[p] = False
        return out

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            heapq.heappush(self._free, p)


class KVCache:
    """The K and V tensors of every layer, in the layout the attention backend asked for."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, layout: str = "NHD") -> None:
        if layout == "NHD":
            shape = (num_pages, page_size, num_kv_heads, head_dim)
        elif layout == "HSD":
            shape = (num_kv_heads, num_pages * page_size, head_dim)
        else:
            raise ValueError(f"unknown KV layout {layout!r} (NHD or HSD)")
        self.layout = layout
        self.page_size = page_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slots`` [T] int64; ``k``, ``v`` [T, Hkv, D]."""
        if self.layout == "HSD":
            self.k[layer][:, slots] = k.transpose(0, 1)
            self.v[layer][:, slots] = v.transpose(0, 1)
        else:
            self.k[layer].view(-1, *self.k[layer].shape[2:])[slots] = k  # (pages*P, Hkv, D)
            self.v[layer].view(-1, *self.v[layer].shape[2:])[slots] = v

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots`` [N] as ``[Hkv, N, D]`` (a copy)."""
        if self.layout == "HSD":
            return self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)
        kf = self.k[layer].flatten(0, 1)
        vf = self.v[layer].flatten(0, 1)
        return kf.index_select(0, slots).transpose(0, 1), vf.index_select(0, slots).transpose(0, 1)

    # -- whole pages, for the KV tiers (engine/kv_tier.py) ------------------------------------------------
    def _page_view(self, t: torch.Tensor, page: int) -> torch.Tensor:
        P = self.page_size
        return t[:, page * P:(page + 1) * P] if self.layout == "HSD" else t[page]

    def read_page(self, page: int) -> torch.Tensor:
        """A CPU copy of one page's K and V in every layer: ``[2, layers, *page]`` (see kv_tier.page_shape)."""
        out = torch.stack([torch.stack([self._page_view(t, page) for t in kv]) for kv in (self.k, self.v)])
        return out.to("cpu") if out.device.type != "cpu" else out

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Copy ``data`` (as :meth:`read_page` returns it) into ``page``: bit for bit."""
        for i, kv in enumerate((self.k, self.v)):
            for layer, t in enumerate(kv):
                self._page_view(t, page).copy_(data[i, layer])
