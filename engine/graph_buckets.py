"""Batch-size buckets and static decode inputs, the shapes CUDA graphs need.

A CUDA graph replays the kernels it captured on the same memory with the same shapes, so a decode
step must run at one of a few batch sizes (buckets), from input tensors that never move. A step of
``n`` decoding rows runs at the smallest bucket ``>= n``: its real rows first, then padding rows.
A padding row must be harmless and cheap:
- its token id and position are 0;
- its K/V is written to slot 0, on the pool's scratch page 0 (``PagePool`` never hands it out);
- it attends over one key, that slot (``kv_len`` 1, page table all page 0), so its softmax is
  defined and it reads no page of a real sequence;
- its logits are dropped (``PaddedDecode.num_real``).
Real rows are copied as given, so the real rows of a padded step compute what the unpadded step
computes (tests/engine/test_graph_buckets.py checks it against the unpadded torch backend).

Buckets are 1, 2, 4, 8, then every multiple of 8, up to and including ``max_num_seqs`` (as vLLM and
SGLang capture), so padding wastes fewer than 8 rows past 8 and at most half below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.attention import BatchLayout

SCRATCH_PAGE = 0   # engine/kv_pool.py: never handed out, padding rows write and read it


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: 1, 2, 4, 8, 16, 24, ... below ``max_num_seqs``, and it."""
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
    small = {b for b in (1, 2, 4) if b < max_num_seqs}
    return tuple(sorted(small | set(range(8, max_num_seqs, 8)) | {max_num_seqs}))


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows; ValueError past the largest (run such a step eagerly)."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one row, got {batch}")
    for b in buckets:
        if b >= batch:
            return b
    raise ValueError(f"a decode step of {batch} rows is past the largest bucket ({max(buckets)})")


@dataclass
class PaddedDecode:
    """One decode step in the static buffers: views of their first ``bucket`` rows."""

    bucket: int
    num_real: int
    input_ids: torch.Tensor     # (bucket,) int64
    positions: torch.Tensor     # (bucket,) int64
    slot_mapping: torch.Tensor  # (bucket,) int64
    kv_lens: torch.Tensor       # (bucket,) int32
    page_table: torch.Tensor    # (bucket, max_pages) int32, padding rows and unused entries: page 0

    def layout(self, page_size: int) -> BatchLayout:
        """The step as a ``BatchLayout`` (every row one query), for a backend's ``plan``."""
        kv = self.kv_lens.tolist()
        tables = [row[:-(-k // page_size)] for row, k in zip(self.page_table.tolist(), kv)]
        return BatchLayout([1] * self.bucket, kv, tables, self.slot_mapping)


class DecodeBuffers:
    """Static decode inputs for up to ``max_batch`` rows of at most ``max_pages`` pages each. ``fill``
    writes a step into the same tensors every time (a captured graph reads them in place)."""

    def __init__(self, max_batch: int, max_pages: int, page_size: int, device: str | torch.device = "cpu",
                 buckets: Sequence[int] | None = None) -> None:
        if max_pages < 1 or page_size < 1:
            raise ValueError(f"max_pages and page_size must be >= 1, got {max_pages} and {page_size}")
        self.buckets = tuple(buckets) if buckets is not None else batch_buckets(max_batch)
        if not self.buckets or max(self.buckets) != max_batch:
            raise ValueError(f"the largest bucket must be max_batch ({max_batch}), got {self.buckets}")
        self.max_pages, self.P = max_pages, page_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.kv_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)

    def fill(self, token_ids: Sequence[int], kv_lens: Sequence[int], page_tables: Sequence[Sequence[int]]
             ) -> PaddedDecode:
        """Write ``n`` decode rows (row ``i``: its new token ``token_ids[i]`` at position ``kv_lens[i] - 1``,
        its pages ``page_tables[i]``) and pad to the bucket; returns the bucket's views."""
        n = len(token_ids)
        if len(kv_lens) != n or len(page_tables) != n:
            raise ValueError(f"token_ids, kv_lens and page_tables differ in length: {n}, {len(kv_lens)}, "
                             f"{len(page_tables)}")
        bucket = bucket_for(n, self.buckets)
        table = torch.zeros(bucket, self.max_pages, dtype=torch.int32)   # (bucket, max_pages)
        for i, (k, pages) in enumerate(zip(kv_lens, page_tables)):
            need = -(-k // self.P)
            if k < 1 or need > len(pages) or need > self.max_pages:
                raise ValueError(f"row {i}: {k} keys need {need} pages (at most {self.max_pages}), "
                                 f"got {len(pages)}")
            table[i, :need] = torch.tensor(pages[:need], dtype=torch.int32)
        pos = torch.tensor([k - 1 for k in kv_lens], dtype=torch.long)
        slots = table[torch.arange(n), pos // self.P].long() * self.P + pos % self.P
        self._write(self.input_ids, bucket, torch.tensor(list(token_ids), dtype=torch.long), 0)
        self._write(self.positions, bucket, pos, 0)
        self._write(self.slot_mapping, bucket, slots, SCRATCH_PAGE * self.P)
        self._write(self.kv_lens, bucket, torch.tensor(list(kv_lens), dtype=torch.int32), 1)
        self.page_table[:bucket].copy_(table)
        return PaddedDecode(bucket, n, self.input_ids[:bucket], self.positions[:bucket],
                            self.slot_mapping[:bucket], self.kv_lens[:bucket], self.page_table[:bucket])

    @staticmethod
    def _write(buf: torch.Tensor, bucket: int, real: torch.Tensor, pad_value: int) -> None:
        """``buf[:n] = real``, ``buf[n:bucket] = pad_value``, in place."""
        n = real.shape[0]
        buf[:n].copy_(real)
        buf[n:bucket].fill_(pad_value)
