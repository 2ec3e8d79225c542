"""The engine's front: ``LLMEngine``, which every other thread calls (its commands go to the engine
thread's inbox; ``step()`` reads as a table of contents: apply the control messages, schedule, run,
update from the output), and ``AsyncEngine``, which steps it in a thread of its own and streams to
asyncio (the in-process ``engine.client.EngineClient``; the router's ``RemoteEngine`` is the other).

The parts and who owns what:
- construction: engine/builder.py (``build_engine`` -> ``EngineParts``: model, KV pool, radix cache,
  scheduler, tiers, runner, speculative decoder, wired together);
- admission control (any thread): engine/admission.py;
- control messages (any thread puts one in the inbox; ``step()`` dispatches them by type at its start,
  so the scheduler's state is only ever touched by the thread running ``step()``): engine/commands.py,
  handled by the request table (engine/request_table.py: add, abort, stop; outputs) and the KV control
  operations (engine/kv_control.py: pins, demote, prefetch, flush, snapshots, KV transfers);
- the plan (engine/plan.py): ``Scheduler.schedule`` -> ``ScheduledBatch`` -> ``Executor.prepare`` ->
  ``Step`` -> ``Executor.forward`` -> ``StepResult`` -> ``Scheduler.update_from_output`` (append, stop
  checks, finish, free, pins, speculative commit and rollback);
- overlap scheduling (engine/overlap.py): the forward of step n runs on a forward thread while
  ``step()`` schedules step n+1, and step n is committed one step behind;
- offline generation: engine/offline.py, over ``LLMEngine``'s public API.

A request may carry an opaque ``trace`` (``add_request``): when it finishes, the engine thread hands it
to ``on_finished`` with its phase timestamps set (arrival, first admission, first token, finish), and
the serving layer's tracing emits its spans from those (agentrt/tracing.py); no span is held open across
threads, and a request without ``trace`` costs nothing.

``AsyncEngine``: each request gets an asyncio queue on the submitting loop; the engine thread
hands outputs over with ``call_soon_threadsafe``, in tokens. The stream turns them into text
with the request's ``OutputProcessor`` (engine/tokenizer.py) on the loop, off the engine
thread: detokenizing, stop strings, held-back text; a stop string it finds ends the stream and asks
the engine to finish the request as stopped. Closing a stream (or cancelling
its consumer) aborts the request, which frees its pages at the next step. After a
session turn ends the loop may hold its next step briefly for the agent's next turn
(``engine.coalesce``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
import uuid
from typing import Callable, Sequence

import torch

from engine import offline
from engine.admission import Admission
from engine.builder import EngineParts, build_engine, step_cost_setup
from engine.client import SessionHint, StructuredOutput, check_closing, check_request
from engine.coalesce import TurnCoalescer
from engine.commands import (KV_OPS, Abort, AddRequest, CacheSnapshot, Demote, ExtendPin, FlushCache, KVTransfer,
                             Pin, Prefetch, StopRequest, TierSnapshot, Unpin)
from engine.config import EngineConfig
from engine.constraints import TokenConstraint
from engine.core import EngineCore
from engine.executor import Executor
from engine.tokenizer import OutputProcessor
from engine.overlap import ForwardWorker
from engine.request import Request
from engine.request_table import RequestTable
from engine.types import EngineStats, GenerationResult, InvalidRequest, RequestOutput, SamplingParams, SchedulingKey


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, on_kv_event=None, kv_event_tokens: bool = False) -> None:
        self.config = config = config or EngineConfig()
        self.overlap = config.overlap_schedule
        worker = ForwardWorker() if self.overlap else None
        try:   # with overlap, on the forward thread: the thread that runs the model loads it (AsyncEngine says why)
            if worker is None:
                parts = build_engine(config, on_kv_event, kv_event_tokens)
            else:
                parts = worker.submit(build_engine, config, on_kv_event, kv_event_tokens, worker).result()
        except BaseException:
            if worker is not None:
                worker.close()
            raise
        self._assemble(parts, worker)

    def _assemble(self, parts: EngineParts, worker: ForwardWorker | None) -> None:
        """The parts as attributes (tests, benchmarks and the serving layers read them), and the objects that
        run them: executor, admission, coalescer, request table, core."""
        self.parts = m = parts
        model = parts.model
        self.model, self.tokenizer, self.model_config = model.model, model.tokenizer, model.model_config
        self.model_id, self.max_model_len, self.device = model.model_id, model.max_model_len, model.device
        self.quantization, self.ep, self.prefill_on_blocks = model.quantization, model.ep, model.prefill_on_blocks
        self.pool, self.kv, self.cache, self.scheduler, self.tiers = m.pool, m.kv, m.cache, m.scheduler, m.tiers
        self.ledger, self.mover, self.runner, self.spec = m.ledger, m.mover, m.runner, m.spec
        self.kv_control = m.kv_control
        self.backend_name, self.attention_desc, self.active_kernels = m.backend_name, m.attention_desc, m.active_kernels
        self.window_layers, self.speculative = m.window_layers, m.spec.mode
        # the most tokens a prompt may have: what the KV pool holds (fixed at start)
        self.pool_tokens = self.pool.capacity * self.config.page_size
        self.executor = Executor(m.runner, m.spec, worker, self.max_model_len, self.config.close_constrained_outputs)
        self.admission = Admission(self.config, m.scheduler, m.waiting_tokens_limit)
        # how long a serving loop holds its next step for agents coming back (engine/coalesce.py)
        self.coalescer = TurnCoalescer(self.config.turn_coalesce_max_s, self.config.turn_coalesce_fraction)
        self.on_command: Callable[[], None] | None = None   # called after every message put in the inbox
        # called in the engine thread with each finished request that carries a ``trace``; must not raise
        self.on_finished: Callable[[Request], None] | None = None
        self.requests = RequestTable(m.scheduler, self.admission, m.kv_control, self.coalescer,
                                     lambda req: self.on_finished(req) if self.on_finished is not None else None)
        self._worker = worker
        self.core = EngineCore(m, self.executor, worker, self.config.page_size, self.admission, self.requests,
                               self.coalescer)

    def close(self) -> None:
        """Release what outlives the object: the forward thread (after the step it runs), the
        expert-parallel worker processes (they also stop at interpreter exit), the disk tier's files."""
        for part in (self._worker, self.ep, self.tiers):
            if part is not None:
                part.close()

    def close_tiers(self) -> None:
        """Close the KV tiers now: a disk tier's files go, unless ``kv_disk_keep`` (a server's shutdown)."""
        if self.tiers is not None:
            self.tiers.close()

    def step_cost_setup(self) -> dict:
        """What a step-cost measurement must match to apply here (engine/step_cost.py)."""
        return step_cost_setup(self.config, self.device, self.quantization, self.active_kernels["packed_linear"])

    # -- commands (any thread) -------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, constraint: TokenConstraint | None = None,
                    cache_salt: str = "", pin_ttl_s: float | None = None, trace: object | None = None,
                    key: SchedulingKey | None = None) -> str:
        """Check and enqueue a request; returns its id. ``trace``: an opaque context handed back with the
        finished request to ``on_finished`` (the serving layer's trace parent). ``key``: the session and
        tenant it serves (engine/session_priority.py; None: a session of its own, of no tenant)."""
        params, key = params or SamplingParams(), key if key is not None else SchedulingKey()
        if not isinstance(key, SchedulingKey):
            raise InvalidRequest(f"key must be a SchedulingKey, got {type(key).__name__}")
        prompt = check_request(prompt_token_ids, params, max_model_len=self.max_model_len,
                               vocab_size=self.model_config.vocab_size)
        if len(prompt) > self.pool_tokens:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens but the KV cache holds only "
                                 f"{self.pool_tokens} tokens; send a shorter prompt")
        if constraint is not None and constraint.closes_outputs and self.config.close_constrained_outputs:
            check_closing(constraint, params.max_tokens, self.max_model_len - len(prompt))
        started = key.continuing or self.ledger.started(key.session)
        self.admission.admit(len(prompt), started)   # or EngineOverloaded (429)
        req = Request(request_id or uuid.uuid4().hex, prompt, params, constraint, cache_salt, pin_ttl_s,
                      trace=trace, key=key, started=started)
        if not params.greedy:
            req.generator = torch.Generator(device="cpu")
            req.generator.manual_seed(params.seed if params.seed is not None
                                      else int.from_bytes(uuid.uuid4().bytes[:8], "little"))
        self._send(AddRequest(req))
        return req.request_id

    def _send(self, message) -> None:
        """Put a control message (engine/commands.py) in the engine thread's inbox."""
        self.core.inbox.put(message)
        if self.on_command is not None:
            self.on_command()

    def abort_request(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stop_request(self, request_id: str, stop: str) -> None:
        """The output processor found stop string ``stop`` in the request's text: finish it as stopped (a
        session turn pinned, as for an EOS); the tokens it gained since are not emitted to anyone."""
        self._send(StopRequest(request_id, stop))

    def pin(self, pin_id: str, token_ids: Sequence[int], ttl_s: float, cache_salt: str = "") -> None:
        self._send(Pin(pin_id, list(token_ids), ttl_s, cache_salt))

    def extend_pin(self, pin_id: str, ttl_s: float) -> None:
        """Make an existing pin expire ``ttl_s`` from now; no-op if it already expired or was released."""
        self._send(ExtendPin(pin_id, ttl_s))

    def unpin(self, pin_id: str) -> None:
        self._send(Unpin(pin_id))

    def demote(self, pin_id: str) -> None:
        """Copy the pin's pages into the KV tiers now and release it (engine/kv_control.py)."""
        self._send(Demote(pin_id))

    def prefetch(self, pin_id: str) -> None:
        """Start reading a demoted pin's prefix back from the disk tier (engine/kv_control.py)."""
        self._send(Prefetch(pin_id))

    def flush_cache(self) -> None:
        self._send(FlushCache())

    def request_cache_snapshot(self, extra=None) -> concurrent.futures.Future:
        """Every cached block hash, read by the engine thread at its next step; ``(hashes, extra())`` with
        ``extra``, run at the same moment (e.g. the KV-event publisher's last sequence number)."""
        return self._ask(lambda fut: CacheSnapshot(fut, extra))

    def request_tier_snapshot(self) -> concurrent.futures.Future:
        """The block hashes each KV tier holds (``{"host": [...], "disk": [...]}``; empty without tiers)."""
        return self._ask(TierSnapshot)

    def request_kv(self, op: str, *args) -> concurrent.futures.Future:
        """A page-transfer operation run by the engine thread between steps (engine/kv_move.py): ``held``,
        ``export``, ``import``, ``pinned``. Keep ``export`` and ``import`` chunks small: the step waits."""
        if op not in KV_OPS:
            raise ValueError(f"unknown KV transfer operation {op!r}")
        return self._ask(lambda fut: KVTransfer(fut, op, args))

    def _ask(self, message: Callable[[concurrent.futures.Future], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._send(message(fut))
        return fut

    # -- the step (one thread) ------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Apply the control messages, schedule, run, update from the output (engine/core.py)."""
        return self.core.step()

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After a step raised: end every running and waiting request with ``message`` as its error, and
        their outputs (engine thread)."""
        return self.requests.fail_all(message)

    # -- state (any thread) ---------------------------------------------------
    def stats(self) -> EngineStats:
        """As of the end of the last step, waiting requests and tokens as of now (safe from any thread)."""
        waiting, tokens = self.admission.waiting()
        return dataclasses.replace(self.core.stats, waiting=waiting, waiting_tokens=tokens)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def has_request(self, request_id: str) -> bool:
        """Whether the engine still holds the request (not finished, or its stop not applied yet)."""
        return request_id in self.requests

    def step_hold(self) -> float:
        """How long a serving loop should hold its next step for agents coming back (engine/coalesce.py):
        the engine thread asks between steps (``EngineCore.hold``)."""
        return self.core.hold()

    def held(self, waited_s: float) -> None:
        """A serving loop held its next step ``waited_s`` seconds (``step_hold``; the engine thread)."""
        self.coalescer.note_wait(waited_s)

    def has_pins(self) -> bool:
        """Whether a pin is held (it may expire: a serving loop steps now and then to expire it)."""
        return bool(self.scheduler.pins)

    def pin_active(self, pin_id: str) -> bool:
        """Whether a pin still holds (it may have expired or given way to memory pressure)."""
        return pin_id in self.core.pin_ids

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 constraints: list[TokenConstraint | None] | None = None) -> list[GenerationResult]:
        """Run ``prompts`` together to completion, their text through an output processor each
        (engine/offline.py)."""
        return offline.generate(self, prompts, params, constraints)


# ------------------------------------------------------------ AsyncEngine: the engine thread, streamed to asyncio


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
