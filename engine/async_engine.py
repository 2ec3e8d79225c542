"""AsyncEngine: runs ``LLMEngine.step()`` in a background thread and streams to asyncio.

It is the in-process ``engine.client.EngineClient`` (the router's ``RemoteEngine`` is the other).

Each request gets an asyncio queue on the submitting loop; the engine thread
hands outputs over with ``call_soon_threadsafe``, in tokens. The stream turns them into text
with the request's ``OutputProcessor`` (engine/output_processor.py) on the loop, off the engine
thread: detokenizing, stop strings, held-back text; a stop string it finds ends the stream and asks
the engine to finish the request as stopped. Closing a stream (or cancelling
its consumer) aborts the request, which frees its pages at the next step. After a
session turn ends the loop may hold its next step briefly for the agent's next turn
(``engine.coalesce``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Callable, Sequence

from engine.client import SessionHint, StructuredOutput
from engine.config import EngineConfig
from engine.constraints import TokenConstraint
from engine.engine import LLMEngine
from engine.output_processor import OutputProcessor
from engine.types import RequestOutput, SamplingParams, SchedulingKey


class RequestStream:
    """Async iterator of one request's :class:`RequestOutput` updates, with their text."""

    def __init__(self, engine: "AsyncEngine", request_id: str, q: asyncio.Queue, processor: OutputProcessor) -> None:
        self._engine, self.request_id, self._q = engine, request_id, q
        self._processor = processor
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            raw = await self._q.get()
        except BaseException:
            await self.aclose()
            raise
        out = self._processor.process(raw)
        if out.finished:
            self._done = True
            self._engine._forget(self.request_id)
            if not raw.finished:   # a stop string the engine has not seen
                self._engine.engine.stop_request(self.request_id, self._processor.stopped)
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def placed(self) -> None:
        """In one process a request runs here: nothing to wait for, no worker to name."""
        return None


class AsyncEngine:
    """``engine``: the ``LLMEngine`` to run; or ``build``, a callable that makes one (``from_config``),
    which then runs in the engine's own thread, so that every torch operation of the process runs in
    that one thread.

    Why it matters on the CPU: each thread that runs torch's parallel operations gets its own OpenMP
    thread team, and once a process holds more OpenMP threads than CPUs, libgomp stops letting idle
    workers spin (GOMP_SPINCOUNT's throttled value), so every parallel region of every step waits for
    a sleeping worker to wake. An engine loaded in the main thread and stepped in this one decoded the
    default model at 24 tok/s at batch 1 on 2 cores; loaded and stepped here, 54 tok/s. With
    ``overlap_schedule`` the engine loads and runs its model on its own forward thread instead
    (engine/overlap.py), for the same reason.
    """

    def __init__(self, engine: LLMEngine | None = None, *, build: Callable[[], LLMEngine] | None = None) -> None:
        if (engine is None) == (build is None):
            raise ValueError("AsyncEngine takes an engine or a build callable, exactly one of them")
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._dead: BaseException | None = None   # what stopped the loop (AsyncEngine._died), if it did
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.engine: LLMEngine | None = engine
        self._thread = threading.Thread(target=self._run, args=(build,), name="agentrt-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        """Load the model and run the engine in the engine thread (what a server should do)."""
        return cls(build=lambda: LLMEngine(config))

    def _run(self, build) -> None:
        try:
            if build is not None:
                self.engine = build()
            self.engine.on_command = self._wake.set
        except BaseException as e:   # raised in the constructing thread
            self._start_error = e
            return
        finally:
            self._started.set()
        try:
            self._loop()
        except BaseException as e:   # a fault outside a step: fail every open stream instead of leaving it hanging
            self._died(e)

    def _died(self, error: BaseException) -> None:
        """The loop stopped on ``error``: no request will run again. Every open stream ends with it, and
        ``submit`` refuses new requests, naming it."""
        import logging
        logging.getLogger("agentrt.engine").error("the engine loop stopped; failing every open request",
                                                  exc_info=error)
        self.error = self._dead = error
        with self._lock:
            streams = list(self._streams.items())
        for rid, (loop, q) in streams:
            out = RequestOutput(rid, "", [], finished=True, finish_reason="error",
                                error=f"the engine loop stopped: {error!r}")
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def constraint(self, options: StructuredOutput) -> TokenConstraint | None:
        """The compiled grammar for these options (None: free output); ``InvalidRequest`` for options
        it refuses (a bad JSON schema, a tool_choice naming no tool...)."""
        if not options.given:
            return None
        from engine.grammar import constraint_for_request  # xgrammar loads on first structured request
        return constraint_for_request(self.engine.tokenizer, options.response_format, options.tools,
                                      options.tool_choice, options.parallel_tool_calls, options.call_format)

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, *, constraint: TokenConstraint | None = None,
               cache_salt: str = "", lease_ttl_s: float | None = None,
               session: SessionHint | None = None, trace: object | None = None,
               key: SchedulingKey | None = None) -> RequestStream:
        """Check and enqueue (``LLMEngine.add_request``); raises InvalidRequest / EngineOverloaded at
        once. ``lease_ttl_s``: the engine pins the finished sequence (``LLMEngine``'s ``pin_ttl_s``).
        ``session`` is a routing hint, moot in one process. ``trace`` rides on the request to
        ``LLMEngine.on_finished`` (its phase spans). ``key``: the session and tenant the scheduler
        orders it by (engine/session_priority.py)."""
        if self._stop:
            raise RuntimeError("the engine is shutting down")
        if self._dead is not None:
            raise RuntimeError(f"the engine loop stopped after an internal error ({self._dead!r}); restart the "
                               f"server")
        rid = request_id or uuid.uuid4().hex
        params = params or SamplingParams()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[rid] = (asyncio.get_running_loop(), q)
        try:
            self.engine.add_request(prompt_token_ids, params, rid, constraint=constraint,
                                    cache_salt=cache_salt, pin_ttl_s=lease_ttl_s, trace=trace, key=key)
        except BaseException:
            self._forget(rid)
            raise
        # built once add_request has checked the parameters (a bad ``stop`` is its InvalidRequest)
        processor = OutputProcessor(self.engine.tokenizer, params, self.engine.tokenizer.eos_token_ids)
        return RequestStream(self, rid, q, processor)

    def abort(self, request_id: str) -> None:
        self._forget(request_id)
        self.engine.abort_request(request_id)

    # the KV lease (``EngineClient``): the engine's pins, under the request id that made them

    def extend_lease(self, lease_id: str, ttl_s: float, worker: str | None = None) -> None:
        self.engine.extend_pin(lease_id, ttl_s)

    def release_lease(self, lease_id: str, worker: str | None = None) -> None:
        self.engine.unpin(lease_id)

    def demote_lease(self, lease_id: str, worker: str | None = None) -> None:
        self.engine.demote(lease_id)

    def prefetch_lease(self, lease_id: str, worker: str | None = None) -> None:
        self.engine.prefetch(lease_id)

    def stats(self):
        return self.engine.stats()

    async def cache_snapshot(self) -> list[int]:
        """Every cached block hash, read by the engine thread between steps."""
        hashes, _ = await asyncio.wrap_future(self.engine.request_cache_snapshot(lambda: None))
        return hashes

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5 if self.engine.has_pins() else None)
                self._wake.clear()
                if not self.engine.has_unfinished():
                    self.engine.step()   # applies pin/unpin commands and expires pins
                    continue
            hold = self.engine.step_hold()
            if hold > 0:  # a session turn just ended: give its agent a moment to come back
                t = time.monotonic()
                self._wake.wait(timeout=hold)
                self._wake.clear()
                self.engine.held(time.monotonic() - t)
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # keep serving: fail what was running, log, go on
                self.error = e
                outputs = self._fail_all(repr(e))
            for out in outputs:
                with self._lock:
                    target = self._streams.get(out.request_id)
                if target is not None:
                    loop, q = target
                    try:
                        loop.call_soon_threadsafe(q.put_nowait, out)
                    except RuntimeError:  # the loop is closed: nobody is listening
                        pass

    def _fail_all(self, message: str) -> list[RequestOutput]:
        import logging
        logging.getLogger("agentrt.engine").exception("engine step failed; failing running requests")
        return self.engine.fail_all(message)

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the loop; with a drain timeout, let running requests finish first."""
        deadline = asyncio.get_running_loop().time() + drain_timeout_s
        while self.engine.has_unfinished() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.engine.abort_request(rid)
        self._wake.set()
        await asyncio.sleep(0.1)
        self._stop = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5.0)
        # a disk tier's files go now, unless kv_disk_keep
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close_tiers)
