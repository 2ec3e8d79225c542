"""Turn coalescing: when a reply ends, hold the next step briefly for the agent to come back.

An agent's next turn arrives over HTTP a few tens of milliseconds after its previous reply
ended (the client reads the reply, runs a tool, sends the next turn). An engine that starts
its next step at once runs that step without the returning turn, which then waits for the
whole step: on a CPU, where a prefill step of a few hundred tokens takes seconds, that
doubles the turn's time to first token, although the turn missed the step by milliseconds.
A caller that submits in-process loses nothing, since it submits before the next step.

So after requests finish (stop or length; not aborts or errors), the engine's loop may wait
before its next step until as many new requests have arrived or the window has passed. The
window is a fraction of the recent prefill step time, capped: worth it on slow steps (CPU:
seconds, so up to the cap), next to nothing on fast ones (GPU: tens of milliseconds, so a
few milliseconds at most). Every wait is bounded by the window after the oldest finish it
waits for, so running requests are delayed by at most the window once per finished turn.
"""

from __future__ import annotations

import collections
import threading
import time


class TurnCoalescer:
    """How long the engine's loop should hold its next step (thread-safe; clock injectable)."""

    def __init__(self, max_s: float, fraction: float, clock=time.monotonic) -> None:
        self.max_s = max_s
        self.fraction = fraction
        self.clock = clock
        self._finished: collections.deque[float] = collections.deque()  # finish times owed an arrival
        self._prefill_step_s: float | None = None   # moving average of steps that prefilled
        self._lock = threading.Lock()
        self.waits = 0            # holds started (for stats and tests)
        self.waited_s = 0.0

    @property
    def window_s(self) -> float:
        if self.max_s <= 0 or self.fraction <= 0 or self._prefill_step_s is None:
            return 0.0
        return min(self.max_s, self.fraction * self._prefill_step_s)

    def on_step(self, duration_s: float, prefill_tokens: int) -> None:
        """A step ran; ``prefill_tokens``: prompt tokens it computed (0 for a decode-only step)."""
        if prefill_tokens <= 0:
            return
        with self._lock:
            prev = self._prefill_step_s
            self._prefill_step_s = duration_s if prev is None else 0.7 * prev + 0.3 * duration_s

    def on_finish(self, count: int = 1) -> None:
        """``count`` requests ended naturally: their clients may come straight back."""
        window = self.window_s
        if window <= 0:
            return
        now = self.clock()
        with self._lock:
            while self._finished and self._finished[0] + window <= now:
                self._finished.popleft()   # bounded even where nobody asks for delay()
            self._finished.extend([now] * count)

    def on_arrival(self) -> None:
        """A new request arrived: it settles the oldest finish still owed one."""
        with self._lock:
            if self._finished:
                self._finished.popleft()

    def delay(self) -> float:
        """Seconds to hold the next step (0: go now)."""
        window = self.window_s
        now = self.clock()
        with self._lock:
            while self._finished and self._finished[0] + window <= now:
                self._finished.popleft()   # that client did not come back in time
            if not self._finished:
                return 0.0
            return self._finished[0] + window - now

    def note_wait(self, seconds: float) -> None:
        with self._lock:
            self.waits += 1
            self.waited_s += seconds
