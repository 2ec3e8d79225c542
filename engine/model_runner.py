"""Turns a scheduled batch into tensors, runs the model, returns the logits to sample from."""

from __future__ import annotations

import torch

from engine.attention import BatchLayout
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, attn_backend, page_size: int, device: str) -> None:
        self.model = model
        self.attn = attn_backend
        self.P = page_size
        self.device = device

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits (S, V) float32, indices into the batch of the requests that sample).

        A request samples when this step reaches the end of its tokens (its prefill
        completes, or it is decoding); a mid-prompt chunk only fills the cache. A request
        with a draft (``batch.drafts``) gets ``1 + len(draft)`` consecutive logits rows: after
        its last token and after each draft token.
        """
        ids, pos, slots, q_lens, kv_lens, tables, sample_rows, samplers = [], [], [], [], [], [], [], []
        row = 0
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new)):
            start = req.num_computed
            draft = batch.drafts.get(i, ())
            m = n + len(draft)
            ids.extend(req.token_slice(start, start + n))
            ids.extend(draft)
            pos.extend(range(start, start + m))
            slots.extend(req.pages[p // self.P] * self.P + p % self.P for p in range(start, start + m))
            q_lens.append(m)
            kv_lens.append(start + m)
            tables.append(req.pages)
            row += m
            if start + n == req.num_tokens:
                sample_rows.extend(range(row - 1 - len(draft), row))
                samplers.append(i)
        dev = self.device
        layout = BatchLayout(q_lens, kv_lens, tables, torch.tensor(slots, dtype=torch.long, device=dev))
        self.attn.plan(layout)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), self.attn)
        if not sample_rows:
            return torch.empty(0, device=dev), []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits, samplers
