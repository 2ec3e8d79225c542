"""Replay of Mooncake-format traces (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

Each hash id names a 512-token block together with everything before it (see
``/work/shared/traces/README.md``). Here every id becomes a fixed pseudo-random block of
real words (``benchmarks.workload.words`` seeded by the id), so two records that share
their first k ids share their first k blocks of text, and a prefix cache shares them for
real. ``block_tokens`` shrinks the blocks (and the inputs with them) for machines that
cannot prefill 12k-token prompts at the trace's rate; ``time_scale`` stretches arrivals.
Every record becomes a one-call session (the traces carry no session ids).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from agentrt.bench.workload import SessionPlan, TurnPlan
from agentrt.bench.text import words

TRACE_BLOCK_TOKENS = 512


def load_records(path: str | Path, limit: int | None = None) -> list[dict]:
    """The trace's records in file order; a clear error for a line that is not a Mooncake record."""
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ok = all(k in rec for k in ("timestamp", "input_length", "output_length", "hash_ids"))
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record (timestamp, input_length, "
                                 f"output_length, hash_ids)")
            records.append(rec)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class BlockText:
    """Hash id -> its block's text (cached; a shorter cut of one block is a prefix of the full block)."""

    def __init__(self, tokenizer, block_tokens: int, seed: int = 0) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.tokenizer, self.block_tokens, self.seed = tokenizer, block_tokens, seed
        self._cache: dict[tuple[int, int], str] = {}

    def text(self, hash_id: int, n_tokens: int) -> str:
        key = (hash_id, n_tokens)
        if key not in self._cache:
            self._cache[key] = words(random.Random(f"block-{self.seed}-{hash_id}"), self.tokenizer, n_tokens)
        return self._cache[key]


def plan_trace(records: list[dict], tokenizer, block_tokens: int = TRACE_BLOCK_TOKENS, time_scale: float = 1.0,
               max_reply_tokens: int | None = None, seed: int = 0) -> list[SessionPlan]:
    """One single-call :class:`SessionPlan` per record, arriving at ``timestamp * time_scale``."""
    if time_scale < 0:
        raise ValueError(f"time_scale must be >= 0, got {time_scale}")
    blocks = BlockText(tokenizer, block_tokens, seed)
    t0 = min(r["timestamp"] for r in records)
    plans = []
    for i, rec in enumerate(records):
        ids = rec["hash_ids"]
        n_tokens = max(1, round(rec["input_length"] * block_tokens / TRACE_BLOCK_TOKENS))
        parts = []
        for k, hid in enumerate(ids):
            take = min(block_tokens, n_tokens - k * block_tokens)
            if take <= 0:
                break
            parts.append(blocks.text(hid, take))
        reply = max(1, int(rec["output_length"]))
        if max_reply_tokens is not None:
            reply = min(reply, max_reply_tokens)
        turn = TurnPlan(" ".join(parts), reply, 0.0)
        plans.append(SessionPlan(i, "trace", None, (rec["timestamp"] - t0) / 1000.0 * time_scale, (turn,), seed))
    return plans
