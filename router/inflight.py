"""The router's own in-flight accounting: requests sent to each worker and not yet finished.

Work is counted in prefill-token equivalents: a request's uncached prompt tokens plus
``decode_token_weight`` per expected output token (how many prefill tokens of compute
one decoded token costs the worker, amortised over a batch; ~10 on a GPU whose prefill
runs ~10x faster per token than a batched decode step). Per router replica, in memory:
it is transient load, not state another replica needs to rebuild (contract 3), and
workers' own load reports cover traffic from other replicas.

It also remembers, for ``RECENT_S``, when each of its finished requests was sent and when it ended
(wall-clock seconds, the clock a worker stamps its load report with): a report taken while such a
request was queued or running counts it, and may reach the router after the request has ended (a report
trails the worker by up to a heartbeat and a refresh). ``ended_since(worker, t)`` is how many of this
replica's requests a report taken at ``t`` still counts though they have ended; the router takes them off
that report's queue (``router/core.py``), so a worker is not priced for work it has finished.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

RECENT_S = 30.0   # how long an ended request is remembered: far longer than a load report's age


@dataclass
class _Entry:
    worker_id: str
    tokens: float
    sent_at: float


class InFlightTracker:
    def __init__(self, decode_token_weight: float = 10.0) -> None:
        if decode_token_weight < 0:
            raise ValueError(f"decode_token_weight must be >= 0, got {decode_token_weight}")
        self.decode_token_weight = decode_token_weight
        self._entries: dict[str, _Entry] = {}
        self._count: dict[str, int] = {}
        self._tokens: dict[str, float] = {}
        self._ended: dict[str, deque[tuple[float, float]]] = {}   # worker -> (sent_at, ended_at), oldest first
        self._ended_at: dict[str, tuple[float, int]] = {}   # worker -> (t, ended_since(t)) of its last query

    def work(self, uncached_tokens: int, est_output_tokens: int) -> float:
        return float(uncached_tokens) + self.decode_token_weight * est_output_tokens

    def dispatched(self, request_id: str, worker_id: str, uncached_tokens: int,
                   est_output_tokens: int, now: float | None = None) -> None:
        """Count a request sent to ``worker_id`` (at ``now``, default the wall clock). A repeated id
        replaces the earlier entry."""
        self._drop(request_id)
        entry = _Entry(worker_id, self.work(uncached_tokens, est_output_tokens), time.time() if now is None else now)
        self._entries[request_id] = entry
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        self._tokens[worker_id] = self._tokens.get(worker_id, 0.0) + entry.tokens

    def completed(self, request_id: str, now: float | None = None) -> None:
        """The request finished or failed (at ``now``, default the wall clock); unknown ids are ignored."""
        entry = self._drop(request_id)
        if entry is None:
            return
        now = time.time() if now is None else now
        ended = self._ended.setdefault(entry.worker_id, deque())
        ended.append((entry.sent_at, now))
        while ended and ended[0][1] < now - RECENT_S:
            ended.popleft()
        cached = self._ended_at.get(entry.worker_id)
        if cached is not None and entry.sent_at < cached[0] < now:   # kept up to date: one count a completion
            self._ended_at[entry.worker_id] = (cached[0], cached[1] + 1)

    def ended_since(self, worker_id: str, t: float) -> int:
        """This replica's requests to ``worker_id`` sent before ``t`` and ended after it: a load report
        the worker took at ``t`` counts each of them as running or waiting. The answer for the worker's
        latest ``t`` (its current report) is kept and counted on as requests end, so asking again is O(1)."""
        cached = self._ended_at.get(worker_id)
        if cached is not None and cached[0] == t:
            return cached[1]
        n = 0
        for sent, ended in reversed(self._ended.get(worker_id, ())):   # newest first: only those after t
            if ended <= t:
                break
            n += sent < t
        self._ended_at[worker_id] = (t, n)
        return n

    def forget(self, worker_id: str) -> None:
        """The worker left the live set: nothing of it is remembered (in-flight entries stay until
        their requests end)."""
        self._ended.pop(worker_id, None)
        self._ended_at.pop(worker_id, None)

    def _drop(self, request_id: str) -> _Entry | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        self._count[entry.worker_id] -= 1
        self._tokens[entry.worker_id] -= entry.tokens
        if self._count[entry.worker_id] == 0:
            del self._count[entry.worker_id]
            del self._tokens[entry.worker_id]
        return entry

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
