"""Turns a scheduled batch into tensors, runs the model, returns the logits to sample from.

``run`` is ``prepare`` then ``execute``. Overlap scheduling (engine/overlap.py) calls them apart:
``prepare`` in the engine thread while the previous step's forward runs, ``execute`` in the forward
thread. A token that previous step is still sampling is a ``PLACEHOLDER`` in the request's output;
``prepare`` notes its row and where that step's result will hold it, and ``execute`` writes it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine.attention import AttentionBackend, BatchLayout
from engine.request import Request
from engine.plan import ScheduledBatch, StepInputs


@dataclass(eq=False)
class ModelRunner:
    model: Any
    attn: AttentionBackend
    P: int   # page size, in tokens
    device: str
    # page id -> the sliding layers' page (engine/window_pool.py), read as each step is prepared, and
    # their (largest) window: pages wholly before it are never read, and left 0 in their tables
    window_page: list[int] | None = None
    window: int | None = None

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Returns (logits (S, V) float32, indices into the batch of the requests that sample).

        A request samples when this step reaches the end of its tokens (its prefill
        completes, or it is decoding); a mid-prompt chunk only fills the cache. A request
        with a draft (``batch.drafts``) gets ``1 + len(draft)`` consecutive logits rows: after
        its last token and after each draft token.
        """
        inputs = self.prepare(batch)
        return self.execute(inputs), inputs.samplers

    def prepare(self, batch: ScheduledBatch, source: Callable[[Request], int] | None = None) -> StepInputs:
        """The step's inputs. ``source(req)``: for a request whose last token is a pending placeholder,
        the index of that token among the previous step's sampled tokens (overlap scheduling)."""
        ids, pos, slots, q_lens, kv_lens, tables, sample_rows, samplers = [], [], [], [], [], [], [], []
        futures: list[tuple[int, int]] = []
        row = 0
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new)):
            start = req.num_computed
            draft = batch.drafts.get(i, ())
            m = n + len(draft)
            ids.extend(req.token_slice(start, start + n))
            if req.pending:
                futures.extend(self._placeholder_rows(req, start, n, row, source))
            ids.extend(draft)
            pos.extend(range(start, start + m))
            slots.extend(req.pages[p // self.P] * self.P + p % self.P for p in range(start, start + m))
            q_lens.append(m)
            kv_lens.append(start + m)
            tables.append(req.pages[:-(-(start + m) // self.P)])
            row += m
            if start + n == req.num_tokens:
                sample_rows.extend(range(row - 1 - len(draft), row))
                samplers.append(i)
        dev = self.device
        layout = BatchLayout(q_lens, kv_lens, tables, torch.tensor(slots, dtype=torch.long, device=dev))
        if self.window_page is not None:
            wp, P = self.window_page, self.P
            firsts = [max(0, kl - ql - self.window + 1) // P for ql, kl in zip(q_lens, kv_lens)]
            layout.window_page_tables = [[0] * f + [wp[p] for p in table[f:]] for f, table in zip(firsts, tables)]
            layout.window_slot_mapping = torch.tensor([wp[s // P] * P + s % P for s in slots], dtype=torch.long,
                                                      device=dev)
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(pos, dtype=torch.long, device=dev), layout, sample_rows, samplers, futures)

    @staticmethod
    def _placeholder_rows(req: Request, start: int, n: int, row: int,
                          source: Callable[[Request], int] | None) -> list[tuple[int, int]]:
        """The (row, source index) of the placeholder among tokens ``start .. start + n`` of ``req``."""
        at = req.num_tokens - req.pending   # the oldest placeholder; later ones are not this step's input
        if at >= start + n:
            return []
        if req.pending > 1 or at < start or source is None:
            raise RuntimeError(f"request {req.request_id}: a step reads {req.pending} token(s) not sampled yet "
                               f"(tokens {start}..{start + n}, first unknown at {at}); overlap scheduling runs "
                               f"one step ahead at most")
        return [(row + at - start, source(req))]

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, previous_tokens: list[int] | None = None) -> torch.Tensor:
        """Plan attention and run the model; returns the logits of ``inputs.sample_rows`` (S, V) float32.
        ``previous_tokens``: the previous step's sampled tokens, for the placeholder rows."""
        if inputs.futures:
            if previous_tokens is None:
                raise RuntimeError("this step reads tokens of the previous step, which gave none")
            rows = torch.tensor([r for r, _ in inputs.futures], dtype=torch.long, device=self.device)
            inputs.ids[rows] = torch.tensor([previous_tokens[s] for _, s in inputs.futures],
                                            dtype=torch.long, device=self.device)
        self.attn.plan(inputs.layout)
        hidden = self.model(inputs.ids, inputs.positions, self.attn)
        if not inputs.sample_rows:
            return torch.empty(0, device=self.device)
        return self.model.compute_logits(hidden[torch.tensor(inputs.sample_rows, device=self.device)])
