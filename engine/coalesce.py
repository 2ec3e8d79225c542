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

Everything here runs on the engine thread: finishes are counted as a step's result is applied,
arrivals as the engine takes a new request from its inbox (``RequestTable.add``; the loop's hold,
``EngineCore.hold``, applies what came while it waits), each at the time it was submitted, so a
request submitted before a turn ended settles nothing that turn owes. The submitting thread never
touches it.
"""

from __future__ import annotations

import collections
import time


class TurnCoalescer:
    """How long the engine's loop should hold its next step (the engine thread's; clock injectable)."""

    def __init__(self, max_s: float, fraction: float, clock=time.monotonic) -> None:
        self.max_s = max_s
        self.fraction = fraction
        self.clock = clock
        self._finished: collections.deque[float] = collections.deque()  # finish times owed an arrival
        self._prefill_step_s: float | None = None   # moving average of steps that prefilled
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
        prev = self._prefill_step_s
        self._prefill_step_s = duration_s if prev is None else 0.7 * prev + 0.3 * duration_s

    def on_finish(self, count: int = 1) -> None:
        """``count`` requests ended naturally: their clients may come straight back."""
        window = self.window_s
        if window <= 0:
            return
        now = self.clock()
        while self._finished and self._finished[0] + window <= now:
            self._finished.popleft()   # bounded even where nobody asks for delay()
        self._finished.extend([now] * count)

    def on_arrival(self, at: float | None = None) -> None:
        """A new request arrived (``at``: when it was submitted; None: now): it settles the oldest finish
        still owed one, if that finish came before it."""
        if self._finished and (at is None or self._finished[0] <= at):
            self._finished.popleft()

    def delay(self) -> float:
        """Seconds to hold the next step (0: go now)."""
        window = self.window_s
        now = self.clock()
        while self._finished and self._finished[0] + window <= now:
            self._finished.popleft()   # that client did not come back in time
        if not self._finished:
            return 0.0
        return self._finished[0] + window - now

    def note_wait(self, seconds: float) -> None:
        self.waits += 1
        self.waited_s += seconds
