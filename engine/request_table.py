"""The engine's live requests, by id, and their outputs.

``RequestTable`` handles the control messages that name a request (``AddRequest``, ``Abort``,
``StopRequest``: engine/commands.py) and turns a request's progress into a ``RequestOutput``
(``emit``): the tokens since its last output, and on its end its finish reason; a finished request
leaves the table, and one that carries a ``trace`` is handed to the finish hook (the serving layer's
tracing, agentrt/tracing.py) in the engine thread.
"""

from __future__ import annotations

import time
from typing import Callable

from engine.admission import Admission
from engine.coalesce import TurnCoalescer
from engine.commands import Abort, AddRequest, StopRequest
from engine.kv_control import KVControl
from engine.request import Request, Status
from engine.scheduler import Scheduler
from engine.types import RequestOutput


class RequestTable:
    def __init__(self, scheduler: Scheduler, admission: Admission, kv_control: KVControl,
                 coalescer: TurnCoalescer, on_finished: Callable[[Request], None]) -> None:
        self.scheduler, self.admission, self.kv_control = scheduler, admission, kv_control
        self.coalescer, self.on_finished = coalescer, on_finished
        self._requests: dict[str, Request] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def handlers(self) -> dict[type, Callable]:
        """The handler of each request message; each returns the output of a request it ended, or None."""
        return {AddRequest: self.add, Abort: self.abort, StopRequest: self.stop}

    def add(self, msg: AddRequest) -> None:
        req = msg.req
        self._requests[req.request_id] = req
        self.admission.enqueue(req)
        self.coalescer.on_arrival(req.arrival)   # it may be a finished turn's agent coming back
        self.kv_control.prefetch_request(req)

    def abort(self, msg: Abort) -> RequestOutput | None:
        req = self._requests.get(msg.request_id)
        if req is None or req.finished:
            return None
        self.scheduler.abort(req)
        return self.emit(req)

    def stop(self, msg: StopRequest) -> RequestOutput | None:
        """The output processor found a stop string: finish the request as stopped (its pages cached, a
        session turn's pinned, as for an EOS)."""
        req = self._requests.get(msg.request_id)
        if req is None or req.finished:
            return None
        req.finish_reason, req.stop_reason = "stop", msg.stop
        req.status = Status.FINISHED
        if self.scheduler.finish_committed(req):
            self.coalescer.on_finish(1)
        return self.emit(req)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every running and waiting request with ``message`` as its error; their outputs."""
        outs = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            req.finish_reason, req.error = "error", message
            self.scheduler.finish(req)
            outs.append(self.emit(req))
        return outs

    def take_failed(self) -> list[RequestOutput]:
        """The outputs of the requests the scheduler ended (they do not fit in the KV cache)."""
        outputs = [self.emit(req) for req in self.scheduler.failed]
        self.scheduler.failed.clear()
        return outputs

    def emit(self, req: Request) -> RequestOutput:
        """The update since the last one, in tokens (its text is the output processor's)."""
        out = RequestOutput(
            request_id=req.request_id, text="", token_ids=req.pending_ids,
            finished=req.finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens or 0,
            cached_tokens_by_tier=_by_tier(req),
            completion_tokens=len(req.output_ids) - req.pending,
            logprobs=req.pending_logprobs if req.params.logprobs is not None else None, error=req.error)
        req.pending_ids, req.pending_logprobs = [], []
        if req.finished:
            self._requests.pop(req.request_id, None)
            req.finished_at = time.monotonic()
            if req.trace is not None:
                self.on_finished(req)
        return out


def _by_tier(req: Request) -> dict[str, int]:
    """The request's cached prompt tokens by where they were found: the device pool, or loaded back
    from the host or disk tier (they add up to ``cached_tokens``)."""
    cached = req.cached_tokens or 0
    host = min(req.tier_tokens.get("host", 0), cached)
    disk = min(req.tier_tokens.get("disk", 0), cached - host)
    return {"device": cached - host - disk, "host": host, "disk": disk}
