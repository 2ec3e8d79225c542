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
import math
import mmap

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
    def num_free_ids(self) -> int:
        """Page ids free (here every page; a windowed pool's may lack a sliding page: engine/window_pool.py)."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        return PagePool.alloc_ids(self, n)

    def alloc_ids(self, n: int) -> list[int]:
        """Page ids only: a windowed pool hands them out without sliding pages (here the same as ``alloc``)."""
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


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: x (..., D) -> values (..., D) int8, scales (...) float32,
    with x ~= values * scale. scale = absmax / 127 (1 for an all-zero row); values round half to even,
    as the C ``rope_store`` does, so both write the same bytes."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127.0                                    # (...)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of K and V a token takes in the pool, over every layer (int8: values and one float32 scale
    per KV head)."""
    per_head = head_dim + 4 if kv_dtype == torch.int8 else head_dim * torch.empty((), dtype=kv_dtype).element_size()
    return 2 * num_layers * num_kv_heads * per_head


def pool_pages(config, bytes_per_token: int) -> int:
    """Pages of the pool for an ``EngineConfig``: ``config.num_pages``, or with ``kv_cache_memory_bytes``
    as many pages as that many bytes hold at ``bytes_per_token`` (at least 4)."""
    if config.kv_cache_memory_bytes is None:
        return config.num_pages
    return max(4, config.kv_cache_memory_bytes // (bytes_per_token * config.page_size))


def zeros_on_first_write(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zero tensor for a pool. On the CPU it lives in an anonymous memory mapping of its own: the OS maps
    every page to its zero page and gives it memory when it is first written, so a pool costs time and memory
    for the pages that get used, not its whole size at start-up (``torch.zeros`` writes every byte: the
    default model's 32,768-token float32 pool took 1.1 of an engine build's 1.4 CPU-s on a 2-core EPYC). The
    mapping lives as long as the tensor (``torch.frombuffer`` holds it) and is unmapped with it. Elsewhere
    ``torch.zeros``."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """The K and V tensors of every layer, in the layout the attention backend asked for.

    ``dtype`` is the activations' dtype (what ``gather`` returns); ``kv_dtype`` the stored one (default:
    ``dtype``). With ``torch.int8`` (HSD layout only) each token's K and V row of each KV head is stored
    as int8 values with one float32 scale (``quantize_int8``): ``k_scale[layer]``, ``v_scale[layer]``
    are ``[Hkv, num_pages * page_size]``, and every read dequantizes.

    ``window_layers`` (the sliding layers of a model whose cache keeps only their window, HSD layout only,
    engine/window_pool.py) hold ``window_pages`` pages, the others ``num_pages``: slots passed for such a
    layer are slots of its own pool (``BatchLayout.window_slot_mapping``).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, layout: str = "NHD",
                 kv_dtype: torch.dtype | None = None, window_layers: tuple[int, ...] = (),
                 window_pages: int = 0) -> None:
        if layout not in ("NHD", "HSD"):
            raise ValueError(f"unknown KV layout {layout!r} (NHD or HSD)")
        if window_layers and layout != "HSD":
            raise ValueError("sliding-window pages need the torch attention backend (HSD layout)")

        def shape_of(pages: int) -> tuple[int, ...]:
            if layout == "NHD":
                return (pages, page_size, num_kv_heads, head_dim)
            return (num_kv_heads, pages * page_size, head_dim)
        shapes = [shape_of(window_pages if i in window_layers else num_pages) for i in range(num_layers)]
        self.kv_dtype = kv_dtype or dtype
        self.quantized = self.kv_dtype == torch.int8
        if self.quantized and layout != "HSD":
            raise ValueError("int8 KV pages need the torch attention backend (HSD layout)")
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self.num_slots = num_pages * page_size     # slots of a full layer: the range of ``slot_mapping``
        self.window_layers = frozenset(window_layers)
        self.k = [zeros_on_first_write(s, self.kv_dtype, device) for s in shapes]
        self.v = [zeros_on_first_write(s, self.kv_dtype, device) for s in shapes]
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = [torch.ones(s[:2], device=device) for s in shapes]   # (Hkv, S) float32
            self.v_scale = [torch.ones(s[:2], device=device) for s in shapes]
        n_window = len(self.window_layers)
        # bytes the pool holds per token of its page ids (the sliding layers' share over their smaller pool,
        # rounded up: a model whose every layer slides still reports a positive figure)
        window_bytes = kv_bytes_per_token(n_window, num_kv_heads, head_dim, self.kv_dtype) * window_pages
        self.bytes_per_token = (kv_bytes_per_token(num_layers - n_window, num_kv_heads, head_dim, self.kv_dtype)
                                + -(-window_bytes // num_pages))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. ``slots`` [T] int64; ``k``, ``v`` [T, Hkv, D]."""
        if self.quantized:
            for t, st, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                q, s = quantize_int8(x.transpose(0, 1))                   # (Hkv, T, D), (Hkv, T)
                t[layer][:, slots] = q
                st[layer][:, slots] = s
        elif self.layout == "HSD":
            self.k[layer][:, slots] = k.transpose(0, 1).to(self.kv_dtype)
            self.v[layer][:, slots] = v.transpose(0, 1).to(self.kv_dtype)
        else:
            self.k[layer].view(-1, *self.k[layer].shape[2:])[slots] = k.to(self.kv_dtype)  # (pages*P, Hkv, D)
            self.v[layer].view(-1, *self.v[layer].shape[2:])[slots] = v.to(self.kv_dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots`` [N] as ``[Hkv, N, D]`` in ``dtype`` (a copy)."""
        if self.quantized:
            return tuple(self._dequant(t[layer].index_select(1, slots), st[layer].index_select(1, slots))
                         for t, st in ((self.k, self.k_scale), (self.v, self.v_scale)))
        if self.layout == "HSD":
            k, v = self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)
        else:
            kf = self.k[layer].flatten(0, 1)
            vf = self.v[layer].flatten(0, 1)
            k, v = kf.index_select(0, slots).transpose(0, 1), vf.index_select(0, slots).transpose(0, 1)
        return k.to(self.dtype), v.to(self.dtype)

    def slot_range(self, layer: int, s0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the slots ``s0 .. s0 + n`` (HSD) as ``[Hkv, n, D]`` in ``dtype``: views of the pool when
        it stores ``dtype``, else dequantized / converted copies."""
        k, v = self.k[layer][:, s0:s0 + n], self.v[layer][:, s0:s0 + n]
        if self.quantized:
            return (self._dequant(k, self.k_scale[layer][:, s0:s0 + n]),
                    self._dequant(v, self.v_scale[layer][:, s0:s0 + n]))
        return k.to(self.dtype), v.to(self.dtype)

    def _dequant(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """int8 values (Hkv, N, D) and scales (Hkv, N) -> (Hkv, N, D) in ``dtype``."""
        return (q.float() * scale[..., None]).to(self.dtype)

    # -- blocks, for the KV tiers (engine/kv_tier.py) ----------------------------------------------------
    # A block is one page's K/V in every layer that holds it. With ``window_layers`` the sliding layers' part
    # lives in the page's sliding page (engine/window_pool.py) and may be gone: a *whole* block has every
    # layer, a *partial* one only the full-attention layers (:attr:`partial_page_shape`).
    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of a whole block as :meth:`read_page` returns it: ``[2, layers, *one layer's page]``; int8
        pools: bytes, ``[2, layers, Hkv, P * D + 4 * P]`` (each head's values, then its P float32 scales)."""
        t = self.k[0]
        if self.quantized:
            return (2, len(self.k), t.shape[0], self.page_size * (t.shape[2] + 4))
        one = tuple(t.shape[1:]) if self.layout == "NHD" else (t.shape[0], self.page_size, t.shape[2])
        return (2, len(self.k), *one)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(len(self.k)) if layer not in self.window_layers)

    @property
    def partial_page_shape(self) -> tuple[int, ...] | None:
        """Shape of a block without the sliding layers' K/V (None: this pool has no sliding layers)."""
        if not self.window_layers:
            return None
        return (2, len(self.full_layers), *self.page_shape[2:])

    @property
    def page_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.kv_dtype

    def _block_layers(self, page: int, window_page: int) -> list[tuple[int, int]]:
        """(layer, page of that layer's pool) of every layer a block of ``page`` holds: the full layers at
        ``page``, the sliding ones at ``window_page`` unless it is 0 (then the block is partial)."""
        return [(layer, window_page if layer in self.window_layers else page) for layer in range(len(self.k))
                if window_page or layer not in self.window_layers]

    def _page_view(self, t: torch.Tensor, page: int) -> torch.Tensor:
        P = self.page_size
        return t[:, page * P:(page + 1) * P] if self.layout == "HSD" else t[page]

    def _page_bytes(self, layer: int, i: int, page: int) -> torch.Tensor:
        """One int8 layer page as bytes: (Hkv, P * D + 4 * P)."""
        vals, scales = (self.k, self.k_scale) if i == 0 else (self.v, self.v_scale)
        q = self._page_view(vals[layer], page)                               # (Hkv, P, D) int8
        s = self._page_view(scales[layer], page)                              # (Hkv, P) float32
        return torch.cat([q.reshape(q.shape[0], -1).view(torch.uint8), s.contiguous().view(torch.uint8)], dim=1)

    def read_page(self, page: int, window_page: int = 0) -> torch.Tensor:
        """A CPU copy of one block (int8 pools: with its scales): whole, shaped :attr:`page_shape`, unless the
        pool has sliding layers and ``window_page`` is 0: then partial, :attr:`partial_page_shape`."""
        layers = self._block_layers(page, window_page)
        if not layers:   # every layer slides (Mistral) and the window is gone: the block holds nothing
            return torch.empty((2, 0, *self.page_shape[2:]), dtype=self.page_dtype)
        if self.quantized:
            out = torch.stack([torch.stack([self._page_bytes(layer, i, p) for layer, p in layers]) for i in (0, 1)])
        else:
            out = torch.stack([torch.stack([self._page_view(kv[layer], p) for layer, p in layers])
                               for kv in (self.k, self.v)])
        return out.to("cpu") if out.device.type != "cpu" else out

    def write_page(self, page: int, data: torch.Tensor, window_page: int = 0) -> None:
        """Copy a block (as :meth:`read_page` returns it) into ``page``, bit for bit: the full layers, and the
        sliding layers into ``window_page`` when it is not 0 (a whole block's sliding part is skipped
        without one). A partial block cannot fill a sliding page: that is refused."""
        L, full = len(self.k), self.full_layers
        if data.shape[1] == L:
            row = {layer: layer for layer in range(L)}
        elif self.window_layers and data.shape[1] == len(full):
            if window_page:
                raise ValueError(f"a block without its sliding layers' K/V cannot fill sliding page {window_page}")
            row = {layer: j for j, layer in enumerate(full)}
        else:
            raise ValueError(f"a block of {data.shape[1]} layers fits neither this pool's {L} layers nor its "
                             f"{len(full)} full-attention layers")
        for layer, p in self._block_layers(page, window_page):
            self._write_layer(layer, p, data[:, row[layer]])

    def _write_layer(self, layer: int, page: int, data: torch.Tensor) -> None:
        """One layer's K and V of a block (``data[0]``, ``data[1]``) into ``page`` of that layer's pool."""
        for i, kv in enumerate((self.k, self.v)):
            t = kv[layer]
            if not self.quantized:
                self._page_view(t, page).copy_(data[i])
                continue
            Hkv, P, D = t.shape[0], self.page_size, t.shape[2]
            raw = data[i].to(t.device)                                        # (Hkv, P * D + 4 * P) uint8
            self._page_view(t, page).copy_(raw[:, :P * D].contiguous().view(torch.int8).view(Hkv, P, D))
            scales = (self.k_scale, self.v_scale)[i][layer]
            self._page_view(scales, page).copy_(raw[:, P * D:].contiguous().view(torch.float32))
