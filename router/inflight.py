"""The router's own in-flight accounting: requests sent to each worker and not yet finished.

Work is counted in prefill-token equivalents: a request's uncached prompt tokens plus
``decode_token_weight`` per expected output token (how many prefill tokens of compute
one decoded token costs the worker, amortised over a batch; ~10 on a GPU whose prefill
runs ~10x faster per token than a batched decode step). Per router replica, in memory:
it is transient load, not state another replica needs to rebuild (contract 3), and
workers' own load reports cover traffic from other replicas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Entry:
    worker_id: str
    tokens: float


class InFlightTracker:
    def __init__(self, decode_token_weight: float = 10.0) -> None:
        if decode_token_weight < 0:
            raise ValueError(f"decode_token_weight must be >= 0, got {decode_token_weight}")
        self.decode_token_weight = decode_token_weight
        self._entries: dict[str, _Entry] = {}
        self._count: dict[str, int] = {}
        self._tokens: dict[str, float] = {}

    def work(self, uncached_tokens: int, est_output_tokens: int) -> float:
        return float(uncached_tokens) + self.decode_token_weight * est_output_tokens

    def dispatched(self, request_id: str, worker_id: str, uncached_tokens: int,
                   est_output_tokens: int) -> None:
        """Count a request sent to ``worker_id``. A repeated id replaces the earlier entry."""
        self.completed(request_id)
        entry = _Entry(worker_id, self.work(uncached_tokens, est_output_tokens))
        self._entries[request_id] = entry
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        self._tokens[worker_id] = self._tokens.get(worker_id, 0.0) + entry.tokens

    def completed(self, request_id: str) -> None:
        """The request finished or failed; unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self._count[entry.worker_id] -= 1
        self._tokens[entry.worker_id] -= entry.tokens
        if self._count[entry.worker_id] == 0:
            del self._count[entry.worker_id]
            del self._tokens[entry.worker_id]

    def __len__(self) -> int:
        """Requests in flight on all workers."""
        return len(self._entries)

    def worker_of(self, request_id: str) -> str | None:
        """The worker ``request_id`` is in flight on, or None."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry.worker_id

    def count(self, worker_id: str) -> int:
        return self._count.get(worker_id, 0)

    def tokens(self, worker_id: str) -> float:
        return max(0.0, self._tokens.get(worker_id, 0.0))
