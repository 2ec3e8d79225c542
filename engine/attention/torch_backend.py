"""Pure-torch paged attention (CPU and CUDA) on the head-major ``HSD`` KV layout.

Decode has two plans; per step the one with the smaller estimated cost (slots
scored plus slots copied) is taken:

* **union**: all decoding sequences are served by one pair of batched matmuls over
  the *union* of their pages, with a per-sequence mask selecting each row's own
  slots. Sequences that share most of their context (one session's forks, one
  long system prompt with short histories) read each page once per step, and with
  pages handed out lowest-first the union is usually one compact range read in
  place, without a copy. But every row scores every other row's slots: over
  distinct contexts a step costs O(batch x total context).
* **cascade**: the pages every row shares (their common prefix) are scored once
  for all rows, as one matmul; then each row scores only its own remaining pages
  (long rows whose pages are one range in place, the others gathered, grouped by
  length and padded within a group), and the two partial results are merged by
  their log-sum-exp, as cascade attention does. A step costs O(shared prefix x
  batch + the sum of each row's own context).

Where the compiled CPU kernel builds (engine/attention/cpu_kernel.py, on by default on the CPU in
float32 and bfloat16), decode rows go through it instead: one call per layer reads each row's own
pages in place, split into (row, KV head, chunk of keys) tasks over every thread, so a step costs
the sum of each row's own context; a prefix that every row shares is still scored once for all
rows by one matmul and merged by log-sum-exp, as in the cascade. The two torch plans stay as the
path without a compiler and as the reference the kernel is tested against.

A short extend over a cached prefix (at most ``_DECODE_MAX_Q`` new tokens: a speculative
verification, the last few prompt tokens after a cache hit) joins the decode plans as one
decode row per query, each seeing the keys up to its own position; the cascade then scores
the sequence's context once for all of its queries.

Longer prefill chunks: per sequence, the keys are gathered (one copy) and attended with
a bottom-right causal mask (through SDPA from ``_SDPA_MIN_Q`` queries on), or SDPA's
``is_causal`` when nothing was cached before the chunk. In float32 on the CPU a chunk from
``_SDPA_MIN_Q`` queries on takes no mask (``extend_attention``): the cached keys and the chunk's own
are attended apart by torch's fused kernel and merged by log-sum-exp.

On a bfloat16 pool (bfloat16 pages, or int8 pages read as bfloat16) where the compiled prefill kernel
(engine/attention/csrc/prefill_attention.c) runs vdpbf16ps (AVX512-BF16) and measured faster than torch's path
at start (``prefill_kernel_wins``: on a CPU with AMX tiles oneDNN's may win), every prefill chunk, cold or over
a cached prefix, goes through it instead: the sequence's keys read in place at its slots, bfloat16 products
summed in float32, flash attention over blocks of 64 keys. One turn of the agent workload (750 new tokens over
5,000 cached, bf16 on the GGUF blocks, 2 threads, a 2-core AVX-512 EPYC; ``benchmarks/prefill_profile.py
--dtype bfloat16 --ab-prefill-kernel``, benchmarks/results/prefill_profile-prefill-kernel-epyc-cpu.json):
attention 2,281 -> 1,268 ms, the turn 2,679 -> 1,663 ms. On a float32 pool (every AVX2-only CPU's default) the
kernel's float32 path takes every prefill chunk the same way where it is vectorized (AVX) and its own probe timed it
faster: the pages read in place, no gather and no two-call merge (the same turn on a 2-core AVX2 EPYC, float32 on the
GGUF blocks, benchmarks/results/prefill_profile-f32-prefill-kernel-avx2-epyc-cpu.json: attention 3,156 -> 2,690 ms,
the turn 4,358 -> 3,911 ms). Elsewhere the paths above stay.

On an int8 pool (``EngineConfig.kv_cache_dtype="int8"``) the kernel reads the int8 pages in place and
``rope_store`` writes them quantized; the torch paths read through ``KVCache.gather`` / ``slot_range``,
which dequantize the slots they read.

``engine/attention/reference.py`` is the plain oracle both paths are tested against.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout, LayerAttention
from engine.attention.cpu_kernel import MAX_GROUP, KernelRows, log
from engine.attention.windowed import WindowedPlan

# read the union as one range when it wastes at most this factor over the union itself
_RANGE_SLACK = 1.5
# cascade: rows join a group (one padded matmul) while the padding stays within this factor
_GROUP_SLACK = 1.25
# cascade: a row whose own pages are one range of at least this many slots is read in place, alone
# (no copy; its few extra kernel launches cost less than copying that much KV)
_VIEW_MIN_SLOTS = 256
# an extend of at most this many queries over a cached prefix is served as that many decode rows
_DECODE_MAX_Q = 16
# a prefill chunk over a cached prefix of at least this many queries goes through SDPA (its fused CPU
# kernel never holds the (heads, queries, keys) scores): 2.5x faster for 512 queries over 7,000 keys
# (186 -> 76 ms a layer, bf16, 2 cores), 2.1x at 128; slower below (64 x 7,000: 7.3 vs 11.1 ms)
_SDPA_MIN_Q = 128


# torch's fused CPU attention, which returns each query's log-sum-exp beside its output (None where this
# torch lacks it: the masked SDPA path serves every long chunk then)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# the activations whose long chunks over a cached prefix take ``extend_attention``: float32, and bfloat16 where
# the C prefill kernel does not run (one layer, 9 / 3 heads of 64, 512 queries over 5,000 cached keys, a 2-core
# AVX-512 EPYC: 83 against the masked SDPA's 98 ms on one thread, 42.5 against 51.1 ms on two)
_EXTEND_DTYPES = (torch.float32, torch.bfloat16)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_cached: int) -> torch.Tensor:
    """A prefill chunk over a cached prefix without a mask: the cached keys, which every query sees, and
    the chunk's own keys, causal from its first query, attended apart and merged by log-sum-exp.

    q: (Q, Hq, D); k, v: (Hkv, n_cached + Q, D), the chunk's own keys last -> (Q, Hq, D).
    The cached part stacks the G query heads of a KV head as one head of G * Q queries (no mask: each
    block of keys is read once for all G); the own part is top-left causal, as SDPA's ``is_causal``.
    Against the masked SDPA (one layer, 9 query / 3 KV heads of 64, torch capped at AVX2, one thread on
    a shared host, medians of 8 alternating runs): 512 queries over 5,512 keys 287 -> 221 ms, 238 over
    5,750 124 -> 97 ms, 512 over 2,712 127 -> 98 ms.
    """
    Q, Hq, D = q.shape
    Hkv = k.shape[0]
    G = Hq // Hkv
    qh = q.transpose(0, 1)                                                     # (Hq, Q, D)
    o_c, lse_c = _FLASH_CPU(qh.reshape(Hkv, G * Q, D)[None], k[None, :, :n_cached], v[None, :, :n_cached])
    o_n, lse_n = _FLASH_CPU(qh[None], k[None, :, n_cached:], v[None, :, n_cached:], is_causal=True)  # (1, Hq, Q, D)
    o = _merge(o_c.reshape(Hq, Q, D), lse_c.reshape(Hq, Q), o_n[0], lse_n[0])   # (Hq, Q, D)
    return o.transpose(0, 1).to(q.dtype)


def chunk_attention(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One prefill chunk in torch: qs (ql, Hq, D) over its sequence's gathered keys ks, vs (Hkv, kl, D), the
    chunk's own last; ``mask`` (ql, kl) bottom-right causal, or None when nothing was cached -> (ql, Hq, D)."""
    ql = qs.shape[0]
    if mask is None:
        o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks, vs, is_causal=True, enable_gqa=True)   # (Hq, ql, D)
        return o.transpose(0, 1)
    if ql >= _SDPA_MIN_Q and _FLASH_CPU is not None and qs.dtype in _EXTEND_DTYPES and qs.device.type == "cpu":
        return extend_attention(qs, ks, vs, ks.shape[1] - ql)
    if ql >= _SDPA_MIN_Q:  # a long chunk over a cached prefix: SDPA's fused kernel
        o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks[None], vs[None], attn_mask=mask,
                                           enable_gqa=True)   # (1, Hq, ql, D)
        return o[0].transpose(0, 1)
    return grouped_attention(qs, ks, vs, mask)


# the probe's chunk: this many queries over _PROBE_CACHED cached keys
_PROBE_Q, _PROBE_CACHED = 128, 1024


@functools.cache
def prefill_kernel_wins(kernel, num_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the C prefill kernel is faster here than torch's path (``chunk_attention`` after the gather) on a
    chunk of 128 queries over 1,024 cached keys in ``dtype``: best of 3 each, alternating, once per process,
    shape and dtype, logged. On a CPU whose oneDNN attention runs on AMX tiles torch's may be the faster one."""
    g = torch.Generator().manual_seed(0)
    L = _PROBE_CACHED + _PROBE_Q
    q = torch.randn(_PROBE_Q, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_kv_heads, L, head_dim, generator=g).to(dtype)
    v = torch.randn(num_kv_heads, L, head_dim, generator=g).to(dtype)
    slots = torch.arange(L)
    mask = torch.arange(L)[None, :] <= torch.arange(_PROBE_CACHED, L)[:, None]
    out = torch.empty_like(q)
    sides = {"C kernel": lambda: kernel(q, k, v, slots, out=out),
             "torch": lambda: chunk_attention(q, k.index_select(1, slots), v.index_select(1, slots), mask)}
    best = {name: math.inf for name in sides}
    for r in range(4):   # the first round warms up
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
    wins = best["C kernel"] < best["torch"]
    log.info("%s prefill attention, %d queries over %d cached keys: C kernel %.2f ms, torch %.2f ms: %s",
             str(dtype).removeprefix("torch."), _PROBE_Q, _PROBE_CACHED, best["C kernel"] * 1e3, best["torch"] * 1e3,
             "the C kernel" if wins else "torch")
    return wins


class TorchAttentionBackend(AttentionBackend):
    kv_layout = "HSD"
    # None: the kernel where it loaded, else the cheaper torch plan each step; "torch": the cheaper torch
    # plan even with the kernel loaded; "union", "cascade" or "kernel": always that one (tests, benchmarks)
    force_decode_plan: str | None = None
    # None: the C prefill kernel where it loaded and ``prefill_kernel_wins`` measured it faster; True / False:
    # wherever it loaded / never (tests, benchmarks)
    force_prefill_kernel: bool | None = None

    def __init__(self, kv, num_heads: int, num_kv_heads: int, head_dim: int, cpu_kernel: bool = True) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim)
        self._windows: set[int | None] = set()   # the windows of the non-plain layers (None: no window)
        self._plain_layers = True                  # whether any layer takes the plans below
        self.kernel = self.prefill_kernel = None
        if cpu_kernel and kv.k[0].device.type == "cpu" and 256 % kv.page_size == 0:
            from engine.attention.cpu_kernel import load
            # an int8 pool's build holds the loop nest of its query group and head dim (cpu_kernel.i8_case_flags)
            kernel = load((num_heads // num_kv_heads, head_dim) if kv.k[0].dtype == torch.int8 else None)
            if kernel is not None and kernel.supports(kv.k[0].dtype, num_heads, num_kv_heads, head_dim):
                self.kernel = kernel
        # pages of the activations' dtype (bfloat16 or float32), or int8 ones read as that dtype
        pages_ok = kv.dtype in (torch.bfloat16, torch.float32) and kv.k[0].dtype in (kv.dtype, torch.int8)
        if cpu_kernel and kv.k[0].device.type == "cpu" and pages_ok:
            from engine.attention.cpu_kernel import PrefillKernel, load_prefill
            if PrefillKernel.supports(num_heads, num_kv_heads, head_dim):
                prefill = load_prefill()
                # only on vector instructions (``PrefillKernel.vectorized``), and only where it measured faster than
                # torch's path (or is forced)
                if prefill is not None and prefill.vectorized(kv.dtype) and self.force_prefill_kernel is not False \
                        and (self.force_prefill_kernel
                             or prefill_kernel_wins(prefill, num_heads, num_kv_heads, head_dim, kv.dtype)):
                    self.prefill_kernel = prefill

    def set_layer_attention(self, layers: list[LayerAttention]) -> None:
        """Every kind is supported: a non-plain layer (window, sinks, soft-cap, scale) is attended by
        the masked per-sequence path of engine/attention/windowed.py, never the CPU decode kernel
        or the union / cascade plans."""
        self.layer_attention = list(layers)
        special = [i for i, a in enumerate(layers) if not a.plain]
        self._windows = {layers[i].window for i in special}
        self._plain_layers = len(special) < len(layers)
        if special:
            log.info("attention: layers %s (%s) use the torch masked path%s", special,
                     "; ".join(sorted({layers[i].describe() for i in special})),
                     ", not the CPU decode kernel" if self.kernel is not None else "")

    def plan(self, layout: BatchLayout) -> None:
        dev = self.kv.k[0].device
        self.windowed = WindowedPlan(layout, self._windows, self.kv.page_size, dev) if self._windows else None
        P = self.kv.page_size
        self.slots = layout.slot_mapping
        self.window_slots = layout.window_slot_mapping   # the sliding layers' own, when they keep a window only
        if self.kv.window_layers and self.window_slots is None:
            raise ValueError("the KV pool keeps only a window for the sliding layers: the step needs their page "
                             "tables (BatchLayout.window_page_tables, window_slot_mapping)")
        # rotate_and_store's C side writes slots unchecked: every one must lie in the pool
        self.store_in_c = (self.kernel is not None and self.force_decode_plan in (None, "kernel")
                           and self.slots.dtype == torch.int64 and self.slots.is_contiguous()
                           and (self.slots.numel() == 0 or (int(self.slots.min()) >= 0
                                                            and int(self.slots.max()) < self.kv.num_slots)))
        self.prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        self.decode = self.cascade = self.kernel_decode = None
        if not self._plain_layers:   # every layer takes the masked path (Gemma 3, gpt-oss)
            return
        rows, dec_pages, dec_lens = [], [], []
        row = 0
        for ql, kl, pages in zip(layout.q_lens, layout.kv_lens, layout.page_tables):
            n_pages = -(-kl // P)
            if kl > ql and ql <= _DECODE_MAX_Q:   # decode, or a short extend: a decode row per query
                for i in range(ql):
                    n = kl - ql + 1 + i
                    rows.append(row + i)
                    dec_pages.append(pages[:-(-n // P)])
                    dec_lens.append(n)
            else:
                idx = _slots_of(pages[:n_pages], kl, P)
                mask = None
                if kl != ql:
                    qpos = np.arange(kl - ql, kl)[:, None]
                    mask = torch.from_numpy(np.arange(kl)[None, :] <= qpos).to(dev)  # (ql, kl)
                self.prefills.append((row, row + ql, torch.from_numpy(idx).to(dev), mask))
            row += ql
        if rows and self.kernel is not None and self.force_decode_plan in (None, "kernel"):
            self.kernel_decode = _KernelDecode(self.kernel, rows, dec_pages, dec_lens, P, dev, row)
        elif rows:
            if self.force_decode_plan == "kernel":
                raise RuntimeError("decode plan 'kernel' forced, but the CPU kernel is not loaded")
            union = _UnionPlan(dec_pages, P)
            cascade = _CascadePlan(dec_pages, dec_lens, P)
            if self.force_decode_plan == "cascade" or (self.force_decode_plan in (None, "torch")
                                                       and cascade.cost < union.cost):
                self.cascade = cascade.to_device(rows, dec_lens, dev)
            else:
                self.decode = union.to_device(rows, dec_lens, dev)

    def c_decode_rows(self):
        """``(slots, rows)`` when this step is decode rows only, with RoPE + the K/V write in C, on plain layers of
        a full pool: the step engine/models/decode_step.py runs whole in C. ``rows`` is the kernel's
        ``KernelRows`` where each row reads its own pages in place, None where the rows share a prefix (scored
        once by ``_KernelDecode.attend``: the C loop calls ``forward`` back for each layer's attention);
        None for any other step (with the kernel's decode rows there is no torch decode plan besides)."""
        kd = self.kernel_decode
        if (kd is None or kd.rows is not None or self.prefills or not self.store_in_c or self.kv.window_layers
                or self._windows):
            return None
        return self.slots, (kd.own if kd.shared is None else None)

    def rotate_and_store(self, layer, qkv, rope):
        """With the CPU kernel loaded: RoPE and the K/V write in one C call (the kernel library's
        ``rope_store``), the same values as the model's RoPE and ``KVCache.write``."""
        if not self.store_in_c or qkv.dtype != self.kv.dtype:
            return None
        slots = self.window_slots if layer in self.kv.window_layers else self.slots
        if self.kv.quantized:   # int8 pages: quantized in the same call
            return self.kernel.rope_store_int8(qkv, rope.cos, rope.signed_sin, slots, self.kv, layer,
                                               self.num_heads)
        if qkv.dtype != self.kv.k[layer].dtype:
            return None
        return self.kernel.rope_store(qkv, rope.cos, rope.signed_sin, slots, self.kv.k[layer],
                                      self.kv.v[layer], self.num_heads)

    def forward(self, layer, q, k, v):
        if k is not None:
            self.kv.write(layer, self.window_slots if layer in self.kv.window_layers else self.slots, k, v)
        if self.layer_attention and not self.layer_attention[layer].plain:
            return self._attend_special(layer, q, self.layer_attention[layer])
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # (T, Hq, D), contiguous
        in_c = self.prefill_kernel is not None and q.dtype == self.kv.dtype
        for start, end, idx, mask in self.prefills:
            if in_c:   # the pool read in place, whatever the chunk's length and its cached prefix
                self.prefill_kernel.paged(q[start:end].contiguous(), self.kv, layer, idx, out=out[start:end])
                continue
            ks, vs = self.kv.gather(layer, idx)                       # (Hkv, kl, D)
            out[start:end] = chunk_attention(q[start:end], ks, vs, mask)
        if self.decode is not None:
            rows, source, mask = self.decode
            if isinstance(source, tuple):
                s0, n = source
                kd, vd = self.kv.slot_range(layer, s0, n)                 # views (int8 pages: dequantized)
            else:
                kd, vd = self.kv.gather(layer, source)
            # every decode row is a "query position" that may see only its own columns
            out[rows] = grouped_attention(q[rows], kd, vd, mask)
        if self.cascade is not None:
            out[self.cascade.rows] = self.cascade.attend(self.kv, layer, q[self.cascade.rows])
        if self.kernel_decode is not None:
            kd = self.kernel_decode
            if kd.rows is None:                                       # every row decodes
                return kd.attend(self.kv, layer, q)
            out[kd.rows] = kd.attend(self.kv, layer, q[kd.rows])
        return out

    def _attend_special(self, layer: int, q: torch.Tensor, spec: LayerAttention) -> torch.Tensor:
        """q: (T, Hq, D) -> (T, Hq, D), each sequence over the keys its window keeps, masked."""
        out = torch.empty_like(q)
        for start, end, idx, mask in self.windowed.by_window[spec.window]:
            ks, vs = self.kv.gather(layer, idx)                       # (Hkv, n, D)
            out[start:end] = grouped_attention(q[start:end], ks, vs, mask, spec.scale, spec.softcap, spec.sinks)
        return out


class _KernelDecode:
    """Decode rows through the CPU kernel: each row's own pages read in place; the pages every row
    starts with (the cascade's shared prefix, only with more than one row) scored once for all rows
    and merged by log-sum-exp. The shared prefix goes through the kernel too, as one row whose query
    heads are every row's (stacked per KV head, as many rows at a time as the kernel's group holds):
    its keys read once per such call, in place, instead of by a handful of torch ops per layer (on a
    2-core AVX2 EPYC in float32, 4 rows over a 1,536-token shared prefix: the torch cascade made the
    step slower than reading the prefix once per row)."""

    def __init__(self, kernel, rows: list[int], dec_pages, dec_lens, P: int, dev, num_rows: int) -> None:
        self.kernel = kernel
        n_shared = _shared_prefix_pages(dec_pages, dec_lens, P)
        self.own = KernelRows([p[n_shared:] for p in dec_pages], [n - n_shared * P for n in dec_lens], P)
        self.rows = None if rows == list(range(num_rows)) else torch.tensor(rows, device=dev)
        self.shared = KernelRows([dec_pages[0][:n_shared]], [n_shared * P], P) if n_shared else None

    def attend(self, kv, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: (B, Hq, D), one query per decode row -> (B, Hq, D)."""
        if self.shared is None:
            return self.kernel.paged(q, kv, layer, self.own)
        B, Hq, D = q.shape
        Hkv = kv.k[layer].shape[0]
        G = Hq // Hkv
        lse_own = torch.empty(B, Hq, dtype=torch.float32)
        o_own = self.kernel.paged(q, kv, layer, self.own, lse=lse_own)          # (B, Hq, D)
        qh = q.view(B, Hkv, G, D).transpose(0, 1)                                # (Hkv, B, G, D)
        step = max(1, MAX_GROUP // G)                                            # rows a call stacks
        o_sh, lse_sh = [], []
        for r in range(0, B, step):
            n = min(step, B - r)
            qs = qh[:, r:r + n].reshape(1, Hkv * n * G, D).contiguous()          # one row, n * G heads a KV head
            lse = torch.empty(1, Hkv * n * G, dtype=torch.float32)
            o = self.kernel.paged(qs, kv, layer, self.shared, lse=lse)
            o_sh.append(o.view(Hkv, n, G, D))
            lse_sh.append(lse.view(Hkv, n, G))
        o_sh = torch.cat(o_sh, dim=1).transpose(0, 1).reshape(B, Hq, D)
        lse_sh = torch.cat(lse_sh, dim=1).transpose(0, 1).reshape(B, Hq)
        return _merge(o_own.float(), lse_own, o_sh.float(), lse_sh).to(q.dtype)


class _UnionPlan:
    """Every decode row over the union of all rows' pages, each row masked to its own slots."""

    def __init__(self, dec_pages: list[list[int]], P: int) -> None:
        self.P = P
        self.dec_pages = dec_pages
        self.union = np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in dec_pages]))
        lo, hi = int(self.union[0]), int(self.union[-1])
        self.range = (lo, hi) if hi - lo + 1 <= _RANGE_SLACK * len(self.union) else None
        self.n_cols = (hi - lo + 1) * P if self.range else len(self.union) * P
        # slots scored by every row, plus the slots copied when the union is gathered
        self.cost = len(dec_pages) * self.n_cols + (0 if self.range else self.n_cols)

    def to_device(self, rows, dec_lens, dev):
        P = self.P
        if self.range:
            lo, hi = self.range
            col_of_page = lambda p: np.asarray(p, dtype=np.int64) - lo       # noqa: E731
            source = (lo * P, (hi - lo + 1) * P)                              # a view of this range
        else:
            col_of_page = lambda p: np.searchsorted(self.union, p)           # noqa: E731
            source = torch.from_numpy(_slots_of(self.union.tolist(), len(self.union) * P, P)).to(dev)
        mask = np.zeros((len(rows), self.n_cols), dtype=bool)
        for b, (pages, kl) in enumerate(zip(self.dec_pages, dec_lens)):
            cols = (col_of_page(pages)[:, None] * P + np.arange(P)[None, :]).reshape(-1)[:kl]
            mask[b, cols] = True
        return (torch.tensor(rows, device=dev), source, torch.from_numpy(mask).to(dev))


class _CascadePlan:
    """The rows' common prefix once for all rows, then each row's own pages; merged by log-sum-exp.

    The shared prefix is the longest run of page ids every row starts with, cut so that each row
    keeps at least one token of its own (the token it decodes is never in a shared page).
    """

    def __init__(self, dec_pages: list[list[int]], dec_lens: list[int], P: int) -> None:
        self.P = P
        n_shared = _shared_prefix_pages(dec_pages, dec_lens, P)
        first = dec_pages[0]
        self.shared_pages = first[:n_shared]
        shared = np.asarray(self.shared_pages, dtype=np.int64)
        self.shared_range = bool(n_shared) and _consecutive(shared)
        self.own = [(pages[n_shared:], kl - n_shared * P) for pages, kl in zip(dec_pages, dec_lens)]
        self.in_place = [b for b, (pages, n) in enumerate(self.own)
                         if n >= _VIEW_MIN_SLOTS and _consecutive(np.asarray(pages))]
        in_place = set(self.in_place)
        rest = [b for b in range(len(self.own)) if b not in in_place]
        self.groups = [[rest[i] for i in g] for g in _length_groups([self.own[b][1] for b in rest])]
        padded = sum(len(g) * self.own[g[0]][1] for g in self.groups)
        S = n_shared * P
        # slots scored (shared once per row, own slots padded per group), plus slots copied
        self.cost = (len(dec_pages) * S + 2 * padded + sum(self.own[b][1] for b in self.in_place)
                     + (0 if self.shared_range else S))

    def to_device(self, rows, dec_lens, dev) -> "_Cascade":
        P = self.P
        shared = _shared_source(self.shared_pages, P, dev) if self.shared_pages else None
        groups = []
        for g in self.groups:
            L = self.own[g[0]][1]                      # the group's longest (rows are sorted longest first)
            slots = np.zeros((len(g), L), dtype=np.int64)
            valid = np.zeros((len(g), L), dtype=bool)
            for i, b in enumerate(g):
                pages, n = self.own[b]
                slots[i, :n] = _slots_of(pages, n, P)
                valid[i, :n] = True
            groups.append((torch.tensor(g, device=dev), torch.from_numpy(slots.reshape(-1)).to(dev),
                           torch.from_numpy(valid).to(dev)))
        in_place = [(b, self.own[b][0][0] * P, self.own[b][1]) for b in self.in_place]  # (row, first slot, n)
        return _Cascade(torch.tensor(rows, device=dev), shared, groups, in_place)


class _Cascade:
    def __init__(self, rows: torch.Tensor, shared, groups, in_place) -> None:
        self.rows, self.shared, self.groups, self.in_place = rows, shared, groups, in_place

    def attend(self, kv, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: (B, Hq, D), one query per decode row -> (B, Hq, D)."""
        B, Hq, D = q.shape
        Hkv = kv.k[layer].shape[0]
        G = Hq // Hkv
        o_own = torch.empty(Hkv, B, G, D, dtype=torch.float32, device=q.device)
        lse_own = torch.empty(Hkv, B, G, dtype=torch.float32, device=q.device)
        qh = q.view(B, Hkv, G, D).transpose(0, 1)                                # (Hkv, B, G, D)
        for idx, slots, valid in self.groups:
            n, L = valid.shape
            k, v = kv.gather(layer, slots)                                       # (Hkv, n*L, D)
            o, lse = _attend_lse(qh[:, idx], k.view(Hkv, n, L, D), v.view(Hkv, n, L, D),
                                 valid[None, :, None, :])                        # (Hkv, n, G, D)
            o_own[:, idx], lse_own[:, idx] = o, lse
        for b, s0, n in self.in_place:
            k, v = (t[:, None] for t in kv.slot_range(layer, s0, n))             # views, (Hkv, 1, n, D)
            o, lse = _attend_lse(qh[:, b:b + 1], k, v, None)
            o_own[:, b:b + 1], lse_own[:, b:b + 1] = o, lse
        if self.shared is not None:
            o_sh, lse_sh = _attend_shared(kv, layer, qh, self.shared)           # (Hkv, B, G, D), (Hkv, B, G)
            o_own = _merge(o_own, lse_own, o_sh, lse_sh)
        return o_own.to(q.dtype).permute(1, 0, 2, 3).reshape(B, Hq, D)


def _shared_prefix_pages(dec_pages: list[list[int]], dec_lens: list[int], P: int) -> int:
    """How many pages every decode row starts with, cut so that each row keeps at least one token of
    its own (the token it decodes is never in a shared page); 0 for a single row."""
    if len(dec_pages) == 1:
        return 0  # one row: its own pages are the whole context
    n_shared = min((kl - 1) // P for kl in dec_lens)
    first = dec_pages[0]
    for pages in dec_pages[1:]:
        n = 0
        while n < n_shared and pages[n] == first[n]:
            n += 1
        n_shared = n
    return n_shared


def _shared_source(pages: list[int], P: int, dev):
    """Where the shared prefix's keys are: ``(first slot, n)`` when its pages are one run (read as a
    view), else the slots to gather."""
    if _consecutive(np.asarray(pages, dtype=np.int64)):
        return pages[0] * P, len(pages) * P
    return torch.from_numpy(_slots_of(pages, len(pages) * P, P)).to(dev)


def _attend_shared(kv, layer: int, qh: torch.Tensor, shared) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's queries over the shared prefix as one batch. qh: (Hkv, B, G, D)
    -> out (Hkv, B, G, D) float32, lse (Hkv, B, G) float32."""
    Hkv, B, G, D = qh.shape
    if isinstance(shared, tuple):
        s0, S = shared
        ks, vs = kv.slot_range(layer, s0, S)                                    # views, (Hkv, S, D)
    else:
        ks, vs = kv.gather(layer, shared)
    o, lse = _attend_lse(qh.reshape(Hkv, 1, B * G, D), ks[:, None], vs[:, None], None)  # (Hkv, 1, B*G, D)
    return o.view(Hkv, B, G, D), lse.view(Hkv, B, G)


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets, from each one's output (..., D) and log-sum-exp (...),
    float32."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b)[..., None]


def _attend_lse(q, k, v, valid):
    """Softmax attention that also returns each query's log-sum-exp of scores.

    q: (Hkv, n, G, D); k, v: (Hkv, n, L, D); valid: bool broadcastable to (Hkv, n, G, L), or None
    -> out (Hkv, n, G, D) float32, lse (Hkv, n, G) float32.
    """
    if k.dtype == torch.float32:
        s, keys = torch.matmul(q, k.transpose(-1, -2)), -1                      # (Hkv, n, G, L)
    else:  # bf16/fp16 matmul copies a transposed operand: keep the large one (k) as stored
        s, keys = torch.matmul(k, q.transpose(-1, -2)), -2                      # (Hkv, n, L, G)
        valid = None if valid is None else valid.transpose(-1, -2)
    s = s.float().mul_(1.0 / math.sqrt(q.shape[-1]))
    if valid is not None:
        s.masked_fill_(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=keys)                                          # (Hkv, n, G)
    p = torch.exp(s - lse.unsqueeze(keys)).to(v.dtype)
    if keys == -2:
        p = p.transpose(-1, -2)                                                 # (Hkv, n, G, L)
    return torch.matmul(p, v).float(), lse


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped for padded batching: longest first, a row joins the current group while
    the group's padded size stays within ``_GROUP_SLACK`` of its real size."""
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    groups: list[list[int]] = []
    total = 0
    for b in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= _GROUP_SLACK * (total + lengths[b]):
            groups[-1].append(b)
            total += lengths[b]
        else:
            groups.append([b])
            total = lengths[b]
    return groups


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention with grouped KV heads.

    q: (Q, Hq, D); k, v: (Hkv, N, D); mask: (Q, N) bool, True = may attend -> (Q, Hq, D).
    Query head h reads KV head h // (Hq // Hkv), as Hugging Face's repeat_kv does. ``scale``,
    ``softcap``, ``sinks`` (Hq,): as ``LayerAttention`` defines them (None: plain).
    """
    Q, Hq, D = q.shape
    Hkv, N, _ = k.shape
    G = Hq // Hkv
    qg = q.view(Q, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Q, D)   # (Hkv, G*Q, D)
    s = torch.bmm(qg, k.transpose(1, 2)).view(Hkv, G, Q, N)                # (Hkv, G, Q, N)
    s = s.float().mul_(1.0 / math.sqrt(D) if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    s.masked_fill_(~mask, float("-inf"))
    if sinks is not None:  # one more logit per head in the denominator, attending to nothing
        sink = sinks.float().view(Hkv, G, 1, 1).expand(Hkv, G, Q, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :N].to(v.dtype).reshape(Hkv, G * Q, N)
    else:
        p = torch.softmax(s, dim=-1).to(v.dtype).view(Hkv, G * Q, N)
    o = torch.bmm(p, v).view(Hkv, G, Q, D)                                  # (Hkv, G, Q, D)
    return o.permute(2, 0, 1, 3).reshape(Q, Hq, D)


def _consecutive(pages: np.ndarray) -> bool:
    """Whether ``pages`` are p, p+1, p+2, ... in order (their slots are one range of the pool)."""
    return bool(np.all(np.diff(pages) == 1))


def _slots_of(pages: list[int], kv_len: int, page_size: int) -> np.ndarray:
    """Cache slot of each of the first ``kv_len`` tokens held in ``pages``."""
    p = np.asarray(pages, dtype=np.int64)
    return (p[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)[:kv_len]
