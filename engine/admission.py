"""Admission control: whether a new request may join the queue, counted from any thread.

A request is counted in when ``add_request`` accepts it (``admit``, the caller's thread) and moves from
the inbox to the scheduler's waiting queue in the engine thread (``enqueue``) under the same lock, so
the count of queued requests and tokens stays exact. The queue is full at ``max_waiting`` requests or
``max_waiting_tokens`` of KV demand; when nothing is queued any request is admitted. Under the session
policy a new session's first turn may fill only ``1 - started_session_reserve`` of either limit, and a
refusal's Retry-After is the queue's drain time at the engine's recent rate of computed tokens.
"""

from __future__ import annotations

import threading

from engine.config import EngineConfig
from engine.plan import Step
from engine.request import Request
from engine.scheduler import Scheduler
from engine.types import EngineOverloaded


class Admission:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, waiting_tokens_limit: int) -> None:
        self.config, self.scheduler = config, scheduler
        self.waiting_tokens_limit = waiting_tokens_limit
        self._pending = 0                      # requests in the inbox
        self._pending_tokens = 0               # and their prompt tokens
        self._lock = threading.Lock()          # held while a request moves from the inbox to the scheduler
        self.tokens_per_s = 0.0                # recent tokens computed per second of step, for Retry-After
        self.prefill_tokens_per_s = 0.0        # measured on prefill steps (EWMA): the router's cost of a recompute

    def admit(self, tokens: int, started: bool = True) -> None:
        """Count a new request of ``tokens`` prompt tokens into the queue, or raise ``EngineOverloaded``
        (429). ``started``: it continues a started session (the session policy's reserve is for those)."""
        share, why = 1.0, ""
        if not started and self.scheduler.order is not None:
            share = 1.0 - self.config.started_session_reserve
            why = (f" for a new session ({self.config.started_session_reserve:.0%} of the queue is kept for "
                   f"later turns of started sessions)")
        with self._lock:
            queued = self._pending + len(self.scheduler.waiting)
            queued_tokens = self._pending_tokens + self.scheduler.waiting_tokens
            max_waiting = max(1, int(self.config.max_waiting * share))
            if queued >= max_waiting:
                raise EngineOverloaded(f"{queued} requests are waiting (limit {max_waiting}{why})",
                                       self.retry_after(queued_tokens))
            limit = int(self.waiting_tokens_limit * share)
            if queued and queued_tokens + tokens > limit:
                raise EngineOverloaded(f"{queued_tokens} tokens of queued requests are waiting for KV cache "
                                       f"and this request's prompt adds {tokens}, over the limit of "
                                       f"{limit} waiting tokens{why}", self.retry_after(queued_tokens))
            self._pending += 1
            self._pending_tokens += tokens

    def retry_after(self, queued_tokens: int) -> float:
        """The Retry-After of an ``EngineOverloaded``: under the session policy, seconds until the queue has
        drained at the recent rate of computed tokens (1 to 60; 1 before any step was measured); 1 under
        FCFS, as before the session policy existed."""
        if self.scheduler.order is None or self.tokens_per_s <= 0:
            return 1.0
        return min(60.0, max(1.0, queued_tokens / self.tokens_per_s))

    def enqueue(self, req: Request) -> None:
        """Move an admitted request from the inbox to the scheduler's waiting queue (engine thread)."""
        with self._lock:
            self._pending -= 1
            self._pending_tokens -= len(req.prompt_ids)
            self.scheduler.enqueue(req)

    def waiting(self) -> tuple[int, int]:
        """Waiting requests and tokens as of now: the inbox's and the scheduler's queue's, read under the
        lock a request holds while it moves from one to the other (a step's snapshot of the queue would
        miss a request that left the inbox after it was taken)."""
        with self._lock:
            return self._pending + len(self.scheduler.waiting), self._pending_tokens + self.scheduler.waiting_tokens

    def measure(self, step: Step, elapsed: float) -> None:
        """The engine's recent tokens per second (~10 steps, for a 429's Retry-After) and prefill tokens per
        second on prefill steps of 64+ tokens (what a router weighs a KV transfer against)."""
        if elapsed <= 0:
            return
        rate = sum(step.batch.num_new) / elapsed
        self.tokens_per_s = rate if self.tokens_per_s <= 0 else 0.9 * self.tokens_per_s + 0.1 * rate
        if step.prefill_tokens >= 64:   # short chunks say more about step overhead than prefill
            rate = step.prefill_tokens / elapsed
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                0.7 * self.prefill_tokens_per_s + 0.3 * rate
