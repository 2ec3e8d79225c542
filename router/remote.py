"""The router's engine client: ``engine.client.EngineClient``, served by workers over HTTP.

``RemoteEngine`` implements the interface ``engine.AsyncEngine`` implements in one process
(``constraint``, ``submit``, the KV lease's ``extend_lease``, ``release_lease``, ``demote_lease``,
``prefetch_lease``, ``stats``, ``cache_snapshot``, ``shutdown``), so the router runs agentrt's own
``Generator``, OpenAI and session services unchanged: the router applies the chat template and
tokenizes, checks the request (``check_request``) and routes it by its prefix and its session hint;
each request goes to one worker's ``/internal/generate`` as token ids (``router/worker_api.py``),
with the structured-output *options* (the worker compiles the grammar). Worker output streams through
line by line, never buffered.

Sessionless conversations: a ``SessionHint`` with ``remember`` set (the client named the
conversation by an affinity key) has its last worker looked up in the ``AffinityMap``
(``router/affinity.py``, in Redis) before routing, and the worker each attempt goes to is
recorded there, so every replica keeps the conversation on one worker while the policy allows.

Workers of kind vllm (``--vllm-worker``, ``router/openai_worker.py``) get the same routing decision
from the same index, and the request as ``/v1/completions`` with the token ids as its prompt; what
they cannot run as agentrt workers do (a grammar constraint, logprobs, a KV lease) goes to agentrt
workers only.

Placement: ``submit`` returns a ``RemoteStream``, whose ``placed()`` waits for the worker's first
output and names the worker (the router's responses carry it in ``x-agentrt-worker``).

Tracing (``agentrt/tracing.py``): a traced request's context comes in ``submit(trace=)``; each routing
decision is set on that span (``agentrt.route.*``: worker, reason, policy, matched prefix, candidates)
and recorded as an ``agentrt.route`` event (a failover makes several), and the worker gets the
context as a W3C ``traceparent`` header, so its span is the child of the router's.

Failover: if the connection to the chosen worker fails, the worker sends no response
headers within ``header_timeout_s`` (hung), or it answers 503 ``worker_draining``, before the
worker produced any output, the worker is marked dead (``RouterCore.mark_dead``) and the request is sent at
once to the next-best live worker, never again to the failed one. A worker that dies after
output was streamed fails that request (the client sees an error; a session turn is then
not recorded, so retrying its ``turn_id`` runs it again, once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any, AsyncGenerator, AsyncIterator

import httpx

from engine.client import SessionHint, StructuredOutput, check_request
from engine.types import EngineStats, RequestOutput, SamplingParams, SchedulingKey

from agentrt import tracing
from agentrt.core.errors import APIError
from agentrt.core.tasks import in_background
from router.core import Route, RouterCore
from router.openai_worker import CompletionStreamError, completion_body, stream_completion
from router.policy import NoWorkerAvailable
from router.worker_api import key_to_wire, lease_body, output_from_wire, sampling_to_wire, structured_to_wire

log = logging.getLogger("router.remote")
# A KV lease call (extend, release, demote, prefetch): tries, each one's timeout, and the pause before the
# next try (times the try's number). A release lost holds the worker's KV until the lease's TTL runs out.
LEASE_ATTEMPTS = 3
LEASE_TIMEOUT_S = 5.0
LEASE_RETRY_S = 0.5


class WorkerUnavailable(httpx.TransportError):
    """The worker cannot take this request: it is draining (503 ``worker_draining``), or it sent no
    response headers within ``header_timeout_s`` (hung: a worker answers with headers at once and
    streams the tokens after, however long the prompt)."""


# A refused or reset connection, a hung or a draining worker: route around it. A read timeout
# mid-stream or another HTTP error status is not.
_CONNECTION_ERRORS = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
                      httpx.ConnectTimeout, WorkerUnavailable)


class RemoteStream:
    """One routed request's outputs (an ``engine.client.OutputStream``). ``worker``: the worker of the
    current attempt (None before the first is routed); :meth:`placed` waits for the first output, from
    which on the request stays on its worker (no failover once output came)."""

    def __init__(self) -> None:
        self.worker: str | None = None
        self._outputs: AsyncGenerator[RequestOutput, None] | None = None
        self._first: RequestOutput | None = None
        self._started = False

    def _attach(self, outputs: AsyncGenerator[RequestOutput, None]) -> None:
        self._outputs = outputs

    def __aiter__(self) -> "RemoteStream":
        return self

    async def __anext__(self) -> RequestOutput:
        self._started = True
        if self._first is not None:
            out, self._first = self._first, None
            return out
        return await self._outputs.__anext__()

    async def placed(self) -> str | None:
        """The worker's id once it produced the first output (held for the next ``__anext__``); raises
        what the routing or the worker raised before that. Once iterated, the worker at once."""
        if not self._started:
            self._started = True
            try:
                self._first = await self._outputs.__anext__()
            except StopAsyncIteration:
                pass
        return self.worker

    async def aclose(self) -> None:
        self._first = None
        await self._outputs.aclose()


class RemoteEngine:
    def __init__(self, core: RouterCore, max_model_len: int, max_attempts: int = 3,
                 read_timeout_s: float = 600.0, remembered_requests: int = 65_536,
                 header_timeout_s: float = 10.0, vocab_size: int | None = None,
                 no_worker_wait_s: float | None = None) -> None:
        self.core = core
        self.vocab_size = vocab_size
        # No worker registered at all (the registry came back empty from a Redis restart until the
        # workers' next heartbeats, or every worker is restarting): hold a request this long for one.
        self.no_worker_wait_s = (core.config.heartbeat_interval_s + core.refresh_interval_s
                                 if no_worker_wait_s is None else no_worker_wait_s)
        self.header_timeout_s = header_timeout_s
        self.max_model_len = max_model_len
        self.max_attempts = max_attempts
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=read_timeout_s),
                                      limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        self._ran_on: OrderedDict[str, str] = OrderedDict()  # request id -> worker id (for its KV lease)
        self._remembered = remembered_requests
        self._background: set[asyncio.Task] = set()
        self.failovers = 0

    def worker_of(self, request_id: str) -> str | None:
        """Where a request of this replica ran (last attempt), if it is remembered."""
        return self._ran_on.get(request_id)

    def constraint(self, options: StructuredOutput) -> StructuredOutput | None:
        """The options themselves: the worker that runs the request compiles (and checks) the grammar."""
        return options if options.given else None

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, *,
               constraint: StructuredOutput | None = None, cache_salt: str = "", lease_ttl_s: float | None = None,
               session: SessionHint | None = None, trace: Any = None,
               key: SchedulingKey | None = None) -> RemoteStream:
        """Check now (``InvalidRequest``), route and stream when iterated (or placed). ``trace``: the
        request's trace context (``agentrt.tracing``), annotated with the routing and sent on. ``key``
        (the session and tenant the worker's scheduler orders the request by) goes to the worker."""
        prompt = check_request(prompt_token_ids, params, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        body = {"request_id": request_id, "prompt_token_ids": prompt, "sampling": sampling_to_wire(params),
                "constraint": None if constraint is None else structured_to_wire(constraint),
                "lease_ttl_s": lease_ttl_s, "cache_salt": cache_salt}
        if key is not None:
            body["key"] = key_to_wire(key)
        stream = RemoteStream()
        # What only agentrt workers run: their own grammar, logprobs by token id (vllm-kind workers get neither)
        agentrt_only = constraint is not None or params.logprobs is not None
        stream._attach(self._stream(stream, body, prompt, params, session, cache_salt, agentrt_only, trace))
        return stream

    async def _stream(self, stream: RemoteStream, body: dict, prompt: list[int], params: SamplingParams,
                      session: SessionHint | None, cache_salt: str,
                      agentrt_only: bool = False, trace: Any = None) -> AsyncIterator[RequestOutput]:
        request_id = body["request_id"]
        est_output = params.max_tokens
        failed: set[str] = set()
        remembered = session is not None and session.remember and self.core.affinity.enabled
        if remembered and session.last_worker is None:
            session = dataclasses.replace(session, last_worker=await self.core.affinity.worker_of(session.session_id))
        for attempt in range(1, self.max_attempts + 1):
            route = await self._route(request_id, prompt, est_output, session, failed, cache_salt, agentrt_only)
            await self.core.dispatched(route)
            if trace is not None:
                decision = route_attributes(route, self.core.policy.name, attempt)
                tracing.annotate(trace, decision)
                tracing.add_event(trace, "agentrt.route", decision)
            stream.worker = route.worker.worker_id
            self._remember(request_id, route.worker.worker_id)
            produced = completed = False
            try:
                if remembered:  # where the conversation goes now (refreshing its TTL), for every replica
                    await self.core.affinity.remember(session.session_id, route.worker.worker_id, session.last_worker)
                    session = dataclasses.replace(session, last_worker=route.worker.worker_id)
                if self._is_vllm(route.worker.worker_id):
                    sent = self._send_openai(route, body, params, trace)
                else:
                    move = self.core.kv_move(route)   # the holder of the prefix, if pulling beats recomputing
                    if move is not None:   # the worker answers after its pull: within half the header wait
                        move["timeout_s"] = self.header_timeout_s / 2
                    sent = self._send(route, body if move is None else {**body, "kv_source": move}, trace)
                async for out in sent:
                    produced = True
                    if out.finished:  # accounted now: a consumer need not iterate past the last output
                        completed = True
                        self.core.completed(route, ok=out.error is None)
                    yield out
                return
            except _CONNECTION_ERRORS as exc:
                if produced:
                    raise APIError(502, f"worker {route.worker.worker_id} failed mid-reply ({type(exc).__name__}); "
                                        "retry the request", type="server_error") from None
                failed.add(route.worker.worker_id)
                self.failovers += 1
                tracing.add_event(trace, "agentrt.failover", {"agentrt.route.worker": route.worker.worker_id,
                                                              "error.type": type(exc).__name__})
                await self.core.mark_dead(route.worker.worker_id, wait=False)
            finally:
                if not completed:
                    self.core.completed(route, ok=False)
        raise APIError(503, f"{len(failed)} workers failed for this request; giving up", type="server_error")

    def _is_vllm(self, worker_id: str) -> bool:
        return self.core.vllm is not None and worker_id in self.core.vllm

    async def _route(self, request_id: str, prompt: list[int], est_output: int, session: SessionHint | None,
                     failed: set[str], cache_salt: str, agentrt_only: bool = False) -> Route:
        """The worker for this attempt. With no live worker, a first attempt waits up to
        ``no_worker_wait_s`` for one to register (the router re-reads the registry every
        ``refresh_interval_s``) before 503 ``no_worker_available``; a retry after a worker failed does not.
        ``agentrt_only``: not to a vllm-kind worker (a grammar constraint or logprobs)."""
        deadline = time.monotonic() + (0.0 if failed else self.no_worker_wait_s)
        exclude = frozenset(failed)
        if agentrt_only and self.core.vllm is not None:
            exclude |= frozenset(self.core.vllm.states)
        while True:
            try:
                return await self.core.choose(request_id, prompt, est_output, exclude=exclude,
                                              cache_salt=cache_salt, session_id=session.session_id if session else None,
                                              last_worker=session.last_worker if session else None)
            except NoWorkerAvailable as exc:
                if time.monotonic() >= deadline:
                    why = str(exc)
                    if agentrt_only and self.core.vllm is not None:
                        why += ("; tools, response_format and logprobs run on agentrt workers only, not on the "
                                "vLLM-kind workers (--vllm-worker)")
                    raise APIError(503, why, type="server_error", code="no_worker_available") from None
            await asyncio.sleep(0.05)

    async def _response(self, request: httpx.Request, wid: str) -> httpx.Response:
        """The worker's response (status and headers; the body streams) within ``header_timeout_s``, else
        ``WorkerUnavailable`` (hung). ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for``
        returns the response when the caller's cancellation (a client that went away) lands as it arrives,
        and the request then ran on for nobody, its turn recorded (tests/router/test_remote_cancel.py)."""
        try:
            async with asyncio.timeout(self.header_timeout_s):
                return await self.http.send(request, stream=True)
        except TimeoutError:
            raise WorkerUnavailable(f"worker {wid} sent no response in {self.header_timeout_s} s (hung)") from None

    async def _send(self, route: Route, body: dict, trace: Any = None) -> AsyncIterator[RequestOutput]:
        url = route.worker.url + "/internal/generate"
        wid = route.worker.worker_id
        request = self.http.build_request("POST", url, json=body, headers=tracing.inject(trace))
        resp = await self._response(request, wid)
        async with contextlib.aclosing(resp):
            if resp.status_code != 200:
                error = await _worker_error(resp, wid)
                if error.code == "worker_draining":
                    raise WorkerUnavailable(f"worker {wid} is draining")
                raise error
            async for line in resp.aiter_lines():
                if not line:
                    continue
                try:
                    out = output_from_wire(line, body["request_id"])
                except ValueError as exc:
                    raise APIError(502, f"worker {route.worker.worker_id}: {exc}", type="server_error") from None
                yield out
                if out.finished:
                    return
        raise httpx.RemoteProtocolError(f"worker {route.worker.worker_id} ended the stream before the reply finished")

    async def _send_openai(self, route: Route, body: dict, params: SamplingParams,
                           trace: Any = None) -> AsyncIterator[RequestOutput]:
        """The request to a vllm-kind worker's ``/v1/completions`` (``router/openai_worker.py``)."""
        wid = route.worker.worker_id
        model = self.core.vllm.states[wid].served_model or self.core.model_id
        request = completion_body(model, body["prompt_token_ids"], params, body["cache_salt"])
        resp = await self._response(self.http.build_request(
            "POST", route.worker.url + "/v1/completions", json=request, headers=tracing.inject(trace)), wid)
        async with contextlib.aclosing(resp):
            if resp.status_code != 200:
                error = await _worker_error(resp, wid)
                if error.code == "worker_draining" or resp.status_code == 503:
                    raise WorkerUnavailable(f"worker {wid} answered 503")
                raise error
            try:
                async for out in stream_completion(resp, body["request_id"], len(body["prompt_token_ids"])):
                    yield out
            except CompletionStreamError as exc:
                raise APIError(502, f"worker {wid}: {exc}", type="server_error") from None

    def _remember(self, request_id: str, worker_id: str) -> None:
        self._ran_on[request_id] = worker_id
        self._ran_on.move_to_end(request_id)
        while len(self._ran_on) > self._remembered:
            self._ran_on.popitem(last=False)

    # ------------------------------------------------------------ the KV lease (fire and forget)

    def extend_lease(self, lease_id: str, ttl_s: float, worker: str | None = None) -> None:
        self._lease("extend", lease_id, worker, ttl_s)

    def release_lease(self, lease_id: str, worker: str | None = None) -> None:
        self._lease("release", lease_id, worker)

    def demote_lease(self, lease_id: str, worker: str | None = None) -> None:
        self._lease("demote", lease_id, worker)

    def prefetch_lease(self, lease_id: str, worker: str | None = None) -> None:
        self._lease("prefetch", lease_id, worker)

    def _lease(self, op: str, lease_id: str, worker_id: str | None, ttl_s: float | None = None) -> None:
        """``POST /internal/lease/{op}`` on the worker that holds the lease: ``worker_id`` (the session
        record's last worker, so any replica reaches a lease another one made), else the worker this
        replica sent the request to. Workers hold leases by id, so the call is exact. A worker this replica
        no longer counts as live still gets the call at its last URL: it may only have been marked dead
        after a failed connection under load, and a lost release holds its KV for the lease's whole TTL.
        Only a worker never seen here is skipped (its lease expires there)."""
        wid = worker_id or self.worker_of(lease_id)
        if wid is None:   # a lost call: at warning, as a failed one is (the lease holds its KV until its TTL)
            log.warning("lease %s %s: no worker is known for it here; it expires on its worker", op, lease_id)
            return
        if self._is_vllm(wid):  # vllm-kind workers hold no leases; their caches evict by LRU
            return
        worker = self.core.workers.get(wid)
        url = worker.url if worker is not None else self.core.last_urls.get(wid)
        if url is None:
            log.warning("lease %s %s: worker %s was never seen by this router; the lease expires there",
                        op, lease_id, wid)
            return
        body = lease_body(lease_id, ttl_s)
        in_background(self._background, self._post_quietly(f"{url}/internal/lease/{op}", body))

    async def _post_quietly(self, url: str, body: dict) -> None:
        """A lease call, tried ``LEASE_ATTEMPTS`` times (each op is idempotent: an extend of a lease that is
        gone does not bring it back); losing it costs recomputation or a held lease until its TTL, never a
        failure, so the last error is logged and dropped."""
        for attempt in range(1, LEASE_ATTEMPTS + 1):
            try:
                resp = await self.http.post(url, json=body, timeout=LEASE_TIMEOUT_S)
            except httpx.TransportError as exc:   # unreachable, or too slow under load: worth another try
                error = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 500:
                    if resp.status_code >= 400:   # a refused call: the same body would be refused again
                        log.warning("lease call %s refused (%d): %s", url, resp.status_code, resp.text[:200])
                    return
                error = f"HTTP {resp.status_code}"
            if attempt < LEASE_ATTEMPTS:
                await asyncio.sleep(LEASE_RETRY_S * attempt)
        log.warning("lease call %s failed %d times, last: %s", url, LEASE_ATTEMPTS, error)

    # ------------------------------------------------------------ the rest of the EngineClient

    def stats(self) -> EngineStats:
        """The live workers' last load reports, summed (per worker they are in /metrics: router/metrics.py)."""
        loads = [self.core.loads[w] for w in self.core.workers if w in self.core.loads]
        used = sum(l.pages_used for l in loads)
        free = sum(l.pages_free for l in loads)
        return EngineStats(running=sum(l.running for l in loads), waiting=sum(l.waiting for l in loads),
                           pages_total=used + free, pages_used=used, pages_free=free, pages_cached=0,
                           pages_pinned=0, num_pins=0, prompt_tokens_total=0, cached_tokens_total=0,
                           generation_tokens_total=0, num_preemptions=0, page_size=self.core.config.block_size,
                           waiting_tokens=sum(l.waiting_tokens for l in loads))

    async def cache_snapshot(self) -> list[int]:
        """Every block hash some live worker holds, as this replica's index has it from their KV events."""
        return sorted({h for w in self.core.workers for h in self.core.index.hashes_of(w)})

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        deadline = time.monotonic() + drain_timeout_s
        while len(self.core.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.http.aclose()


def route_attributes(route: Route, policy: str, attempt: int) -> dict[str, Any]:
    """A routing decision as span attributes: the chosen worker, why (the policy's rule), the prompt
    tokens it is believed to hold (index and tentative entries), and the candidates the policy weighed
    as it saw them (``Route.candidates``; parallel lists: id, cached blocks, queued requests)."""
    request, decision = route.request, route.decision
    return {"agentrt.route.worker": route.worker.worker_id, "agentrt.route.reason": decision.reason,
            "agentrt.route.policy": policy, "agentrt.route.attempt": attempt,
            "agentrt.route.prompt_tokens": request.num_tokens,
            "agentrt.route.cached_blocks": decision.cached_blocks,
            "agentrt.route.matched_tokens": min(decision.cached_blocks * request.block_size, request.num_tokens),
            "agentrt.route.session_id": request.session_id, "agentrt.route.last_worker": request.last_worker,
            "agentrt.route.candidates": [w.worker_id for w in route.candidates],
            "agentrt.route.candidate_cached_blocks": [w.cached_blocks for w in route.candidates],
            "agentrt.route.candidate_queue": [w.queue for w in route.candidates]}


async def _worker_error(resp: httpx.Response, worker_id: str) -> APIError:
    """The worker's own error (400, 429, 503...) passed through with its message."""
    await resp.aread()
    try:
        err = resp.json()["error"]
        return APIError(resp.status_code, err["message"], type=err.get("type"), param=err.get("param"),
                        code=err.get("code"), headers={k: v for k, v in resp.headers.items() if k == "retry-after"})
    except (ValueError, KeyError, TypeError):
        return APIError(502, f"worker {worker_id} answered {resp.status_code}: {resp.text[:200]}", type="server_error")
