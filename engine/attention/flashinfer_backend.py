"""FlashInfer paged attention (CUDA only), on the same NHD page layout as the torch backend.

Per step: build the CSR page table (``kv_indptr``, ``kv_indices``,
``kv_last_page_len``; ``qo_indptr`` for prefill) and ``plan`` a decode wrapper
when every sequence has one query, else a prefill wrapper (bottom-right causal,
which is right for extends over a cached prefix). Per layer: write K/V into the
pages, then ``run``. Checked against the plain reference and the torch backend by
scripts/gpu_check.py.

FlashInfer compiles its kernels on first use. ``AGENTRT_FLASHINFER_PREFILL_BACKEND`` picks the
prefill kernel family: ``auto`` (FlashInfer's choice: FA3 on Hopper), ``fa2`` or ``fa3``.
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend, BatchLayout

_WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    kv_layout = "NHD"

    def __init__(self, kv, num_heads, num_kv_heads, head_dim) -> None:
        super().__init__(kv, num_heads, num_kv_heads, head_dim)
        try:
            import flashinfer
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError("attention_backend='flashinfer' needs the CUDA extra: "
                               "pip install 'agentrt[cuda]'") from e
        device = kv.k[0].device
        if device.type != "cuda":
            raise RuntimeError("the flashinfer attention backend runs on CUDA only; use 'torch' on CPU")
        self._workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        prefill_backend = os.environ.get("AGENTRT_FLASHINFER_PREFILL_BACKEND", "auto")
        if prefill_backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"AGENTRT_FLASHINFER_PREFILL_BACKEND={prefill_backend!r}: "
                             "use 'auto', 'fa2' or 'fa3'")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                       backend=prefill_backend)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._wrapper = None

    def plan(self, layout: BatchLayout) -> None:
        P = self.kv.page_size
        dev = self.kv.k[0].device
        dtype = self.kv.k[0].dtype
        n_pages = [(kl + P - 1) // P for kl in layout.kv_lens]
        kv_indptr = torch.zeros(len(n_pages) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(torch.tensor(n_pages, dtype=torch.int32), 0)
        kv_indices = torch.tensor([p for pt, n in zip(layout.page_tables, n_pages) for p in pt[:n]],
                                  dtype=torch.int32)
        last_len = torch.tensor([kl - (n - 1) * P for kl, n in zip(layout.kv_lens, n_pages)],
                                dtype=torch.int32)
        kv_indptr, kv_indices, last_len = kv_indptr.to(dev), kv_indices.to(dev), last_len.to(dev)
        self.slots = layout.slot_mapping
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if all(q == 1 for q in layout.q_lens):
            self._decode.plan(kv_indptr, kv_indices, last_len, H, Hkv, D, P,
                              q_data_type=dtype, kv_data_type=dtype)
            self._wrapper = self._decode
        else:
            qo_indptr = torch.zeros(len(layout.q_lens) + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(layout.q_lens, dtype=torch.int32), 0)
            self._prefill.plan(qo_indptr.to(dev), kv_indptr, kv_indices, last_len, H, Hkv, D, P,
                               causal=True, q_data_type=dtype, kv_data_type=dtype)
            self._wrapper = self._prefill

    def forward(self, layer, q, k, v):
        self.kv.write(layer, self.slots, k, v)
        return self._wrapper.run(q.contiguous(), (self.kv.k[layer], self.kv.v[layer]))
