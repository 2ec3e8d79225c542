"""EngineCore: one engine step, on one thread, as a table of contents.

    step():  drain the inbox (typed control messages, dispatched by type)
             schedule                    Scheduler.schedule -> ScheduledBatch
             run                         Executor.prepare -> Step; Executor.forward -> StepResult
             update from the output      Scheduler.update_from_output (append, stop checks, finish,
                                         free, pins, speculative commit/rollback); RequestTable.emit
             publish stats

With overlap scheduling (engine/overlap.py) the run is cut in two: step n+1 is scheduled, prepared
and launched on the forward thread (``Scheduler.launched``) before step n's result is applied, one
step behind; a step that may not be run ahead of is applied first. ``LLMEngine`` (engine/engine.py) is
the front every other thread calls; it owns this core.
"""

from __future__ import annotations

import queue
import time

from engine.admission import Admission
from engine.builder import EngineParts
from engine.coalesce import TurnCoalescer
from engine.commands import Dispatcher
from engine.executor import Executor
from engine.overlap import ForwardWorker
from engine.plan import ScheduledBatch, Step, StepResult
from engine.request_table import RequestTable
from engine.stats import engine_stats
from engine.types import EngineStats, RequestOutput


class EngineCore:
    def __init__(self, parts: EngineParts, executor: Executor, worker: ForwardWorker | None, page_size: int,
                 admission: Admission, requests: RequestTable, coalescer: TurnCoalescer) -> None:
        self.parts, self.executor, self.worker, self.page_size = parts, executor, worker, page_size
        self.scheduler, self.tiers = parts.scheduler, parts.tiers
        self.admission, self.requests, self.coalescer = admission, requests, coalescer
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()   # control messages, engine/commands.py
        self._applied: list[RequestOutput] = []   # outputs of the messages a hold applied, for the next step
        self.dispatch = Dispatcher({**requests.handlers(), **parts.kv_control.handlers()})
        self.publish()

    def step(self) -> list[RequestOutput]:
        if self.worker is not None:
            return self._step_overlapped()
        outputs = self._drain_inbox()
        batch = self._schedule(outputs)
        if batch:
            step = self.executor.prepare(batch)
            outputs.extend(self._update(step, self.executor.forward(step)))
        else:
            self._wait_for_tiers()
        self.publish()
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Schedule and launch step n+1 while step n's forward runs, then apply step n's result; step n
        first when it may not be run ahead of."""
        outputs: list[RequestOutput] = []
        prev = self.scheduler.launched_step
        try:
            if prev is not None and not prev.run_ahead:
                outputs.extend(self._update(prev, self.executor.result(prev)))
                prev = None
            outputs.extend(self._drain_inbox())
            batch = self._schedule(outputs)
            if batch:
                self._launch(batch, prev)
            elif prev is None:
                self._wait_for_tiers()
            if prev is not None:
                outputs.extend(self._update(prev, self.executor.result(prev)))
            nxt = self.scheduler.launched_step
            if nxt is not None and not any(nxt.live(req) for req in nxt.batch.requests):
                outputs.extend(self._update(nxt, self.executor.result(nxt)))   # every row was withdrawn
        except BaseException:
            self.worker.wait_idle()
            self.scheduler.abandon_launched()
            raise
        self.publish()
        return outputs

    def hold(self) -> float:
        """Seconds a serving loop should hold the next step for agents coming back (engine/coalesce.py),
        asked between steps. While a finished turn is owed one, the messages waiting are applied first (as
        the next step would; not while a launched step that may not be run ahead of is in flight), so a
        request that came settles it; their outputs go out with the next step's."""
        if self.coalescer.delay() <= 0:
            return 0.0
        launched = self.scheduler.launched_step
        if launched is None or launched.run_ahead:
            self._applied.extend(self._drain_inbox())
            # what they changed is visible now, not at the next step: a release applied here (the agent's
            # session deleted during the hold) left the pin published as held while the idle loop slept
            self.publish()
        return self.coalescer.delay()

    def _drain_inbox(self) -> list[RequestOutput]:
        """Handle every control message waiting; the outputs of the requests they finished (with those of
        the messages a hold applied)."""
        outputs, self._applied = self._applied, []
        while True:
            try:
                out = self.dispatch(self.inbox.get_nowait())
            except queue.Empty:
                return outputs
            if out is not None:
                outputs.append(out)

    def _schedule(self, outputs: list[RequestOutput]) -> ScheduledBatch:
        """Expire pins, schedule the next batch; the outputs of requests that cannot fit join ``outputs``."""
        self.scheduler.expire_pins()
        batch = self.scheduler.schedule()
        outputs.extend(self.requests.take_failed())
        return batch

    def _launch(self, batch: ScheduledBatch, prev: Step | None) -> None:
        """Prepare the step (reading ``prev``'s tokens), count it in flight, hand it to the forward thread."""
        step = self.executor.prepare(batch, prev)
        self.scheduler.launched(step)
        self.executor.launch(step, prev)

    def _update(self, step: Step, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result in the scheduler; measure it; the outputs of its sampling requests."""
        update = self.scheduler.update_from_output(step, result)
        elapsed = result.forward_s if step.overlapped else time.monotonic() - step.launched_at
        self.coalescer.on_step(elapsed, step.prefill_tokens)
        self.admission.measure(step, elapsed)
        if update.returning:
            self.coalescer.on_finish(update.returning)
        return [self.requests.emit(req) for req in update.requests]

    def _wait_for_tiers(self) -> None:
        if self.tiers is not None and self.scheduler.waiting and self.tiers.loading():
            self.tiers.wait_for_load(0.01)   # nothing can run until a disk read lands

    def publish(self) -> None:
        """Publish stats for other threads (they must not walk the scheduler's live state)."""
        self.stats: EngineStats = engine_stats(self.parts, self.page_size, self.admission.prefill_tokens_per_s)
        self.pin_ids = frozenset(self.scheduler.pins)

    def has_unfinished(self) -> bool:
        s = self.scheduler
        return bool(s.running or s.waiting or not self.inbox.empty() or s.launched_step is not None)
