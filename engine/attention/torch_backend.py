"""Pure-torch paged attention (CPU and CUDA): gather K/V from pages, then SDPA.

Decode sequences (one query each) are batched into one padded SDPA call with a
key-padding mask; prefill chunks run one SDPA call per sequence with a
bottom-right causal mask (plain ``is_causal`` when nothing is cached before them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, BatchLayout


class TorchAttentionBackend(AttentionBackend):
    def plan(self, layout: BatchLayout) -> None:
        dev = self.kv.k[0].device
        P = self.kv.page_size
        self.slots = layout.slot_mapping
        self.decode_rows: list[int] = []      # token row of each decode sequence
        decode_seqs: list[int] = []
        self.prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        row = 0
        for i, (ql, kl) in enumerate(zip(layout.q_lens, layout.kv_lens)):
            if ql == 1 and kl > 1:
                self.decode_rows.append(row)
                decode_seqs.append(i)
            else:
                idx = _slot_index(layout.page_tables[i], kl, P, dev)      # (kl,)
                mask = None
                if kl != ql:
                    qpos = torch.arange(kl - ql, kl, device=dev).unsqueeze(1)
                    mask = torch.arange(kl, device=dev).unsqueeze(0) <= qpos  # (ql, kl)
                self.prefills.append((row, row + ql, idx, mask))
            row += ql
        self.decode_idx = self.decode_mask = None
        if decode_seqs:
            kmax = max(layout.kv_lens[i] for i in decode_seqs)
            idx = torch.zeros(len(decode_seqs), kmax, dtype=torch.long)    # padding -> slot 0 (scratch page)
            mask = torch.zeros(len(decode_seqs), 1, 1, kmax, dtype=torch.bool)
            for b, i in enumerate(decode_seqs):
                kl = layout.kv_lens[i]
                idx[b, :kl] = _slot_index(layout.page_tables[i], kl, P, "cpu")
                mask[b, ..., :kl] = True
            self.decode_idx, self.decode_mask = idx.to(dev), mask.to(dev)
            self.decode_rows_t = torch.tensor(self.decode_rows, device=dev)

    def forward(self, layer, q, k, v):
        self.kv.write(layer, self.slots, k, v)
        kf = self.kv.k[layer].flatten(0, 1)                      # (slots, Hkv, D)
        vf = self.kv.v[layer].flatten(0, 1)
        out = torch.empty_like(q)                                # (T, Hq, D)
        for start, end, idx, mask in self.prefills:
            qs = q[start:end].transpose(0, 1)                     # (Hq, ql, D)
            ks = kf[idx].transpose(0, 1)                          # (Hkv, kl, D)
            vs = vf[idx].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        if self.decode_idx is not None:
            qd = q[self.decode_rows_t].unsqueeze(2)               # (B, Hq, 1, D)
            kd = kf[self.decode_idx].transpose(1, 2)              # (B, Hkv, K, D)
            vd = vf[self.decode_idx].transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, enable_gqa=True)
            out[self.decode_rows_t] = o.squeeze(2)
        return out


def _slot_index(pages: list[int], kv_len: int, page_size: int, device) -> torch.Tensor:
    """Cache slot of each of the first ``kv_len`` tokens of a sequence."""
    p = torch.tensor(pages, dtype=torch.long)
    slots = (p.unsqueeze(1) * page_size + torch.arange(page_size)).flatten()
    return slots[:kv_len].to(device)
