"""The worker endpoints a router uses, and their wire format (both sides import this module).

* ``POST /internal/generate``: a rendered prompt (token ids), sampling parameters, the
  constraint *options* (the worker builds the grammar: a constraint object does not travel),
  a KV lease TTL (``lease_ttl_s``), the scheduling key (session, tenant and its weight, whether the
  session already ran a turn: ``engine.types.SchedulingKey``); optionally ``kv_source``, a worker
  holding the prompt's prefix to pull it from first (router/kv_moves.py); a traced request's W3C
  ``traceparent`` header (its span continues the router's trace). Errors found before generation
  starts are ordinary JSON errors (400, 429, 503); otherwise the body is NDJSON, one
  ``RequestOutput`` per line, the last one finished.
  A client that disconnects aborts the request and frees its pages.
* ``POST /internal/lease/{op}``, ``op`` one of :data:`LEASE_OPS` (extend, release, demote, prefetch):
  the KV lease calls of ``engine.client.EngineClient`` on the worker's engine, by lease id (the
  request id that acquired it), so any router reaches a lease another router made; body
  ``{"lease_id": ..., "ttl_s": ...}`` (``ttl_s`` for extend only). ``GET /internal/lease/{id}``:
  whether it holds.
* ``GET /internal/kv_snapshot``: every cached block hash and the last KV event seq.
* ``POST /internal/drain``: drain as a SIGTERM does, but stay up (router/worker.py ``WorkerRuntime.drain``).
* ``GET /internal/status``: the worker's block of the dashboard's status (``agentrt.dashboard.engine_worker``:
  load, KV use per tier, cached blocks, prompt and cached token totals), read by routers' dashboards.

Routes are open like ``/health``: workers sit on a private network behind routers, which
hold the API keys (docs/deploy.md).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, AsyncIterator

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask

from engine.client import StructuredOutput
from engine.types import RequestOutput, SamplingParams, SchedulingKey, TokenLogprob

from agentrt import tracing
from agentrt.dashboard import engine_worker
from agentrt.server import services
from agentrt.core.errors import bad_request, draining, not_found
from router.events import cache_snapshot

worker_routes = APIRouter()

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


class ConstraintSpec(BaseModel):
    """The request options a grammar constraint is built from (``engine.client.StructuredOutput``)."""

    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    call_format: str = "hermes"  # an unknown one is refused by the grammar's builder (a 400)


class KeySpec(BaseModel):
    """The scheduling key (``engine.types.SchedulingKey``) as it travels."""

    session: str = Field(default="", max_length=256)
    tenant: str = Field(default="", max_length=256)
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    continuing: bool = False


class KVSource(BaseModel):
    """Where this turn's prefix is cached (a router's hint, router/core.py ``kv_move``): the worker pulls the
    blocks it lacks from there before it runs the turn (router/kv_moves.py)."""

    url: str = Field(min_length=1, max_length=2048, pattern=r"^https?://")
    worker: str | None = None
    blocks: int | None = Field(default=None, ge=1)
    # the longest the pull may take: the router waits for this worker's response headers, which come after it
    timeout_s: float | None = Field(default=None, gt=0)


class GenerateBody(BaseModel):
    # an unknown field is refused (422 naming it), never dropped: a field this worker does not know is one
    # it would not honour
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    constraint: ConstraintSpec | None = None
    # ``pin_ttl_s``: its name from routers before the lease was one method set; still honoured
    lease_ttl_s: float | None = Field(default=None, gt=0, validation_alias=AliasChoices("lease_ttl_s", "pin_ttl_s"))
    cache_salt: str = ""
    key: KeySpec | None = None   # absent from an older router: the request is a session of its own
    kv_source: KVSource | None = None


LEASE_OPS = ("extend", "release", "demote", "prefetch")
"""The KV lease calls a router sends a worker, as ``POST /internal/lease/{op}``."""


class LeaseBody(BaseModel):
    lease_id: str = Field(min_length=1, max_length=256)
    ttl_s: float | None = Field(default=None, gt=0)   # extend: the new TTL from now


def lease_body(lease_id: str, ttl_s: float | None = None) -> dict[str, Any]:
    """The JSON body of a lease call (``RemoteEngine``'s side of :class:`LeaseBody`)."""
    return {"lease_id": lease_id} if ttl_s is None else {"lease_id": lease_id, "ttl_s": ttl_s}


# ------------------------------------------------------------ wire format


class WireOutput(msgspec.Struct):
    """One ``/internal/generate`` NDJSON line: a ``RequestOutput`` without its request id (the router
    knows it). Typed: a line whose fields have other types is refused with the field's path."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None
    # (token id, logprob, [(token id, logprob), ...] of the top alternatives), per generated token
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None
    stop_reason: str | int | None = None          # the stop string or token id (absent from older workers)
    cached_tokens_by_tier: dict[str, int] = {}


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(WireOutput)


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def sampling_from_wire(data: dict[str, Any]) -> SamplingParams:
    """The parameters as sent, typed (a field of another type is a 400 naming it); the engine checks their
    values with the prompt (``check_request``)."""
    unknown = set(data) - _SAMPLING_FIELDS
    if unknown:
        raise bad_request(f"unknown sampling fields {sorted(unknown)}", param="sampling")
    try:
        return msgspec.convert(data, SamplingParams)
    except msgspec.ValidationError as exc:
        raise bad_request(f"sampling: {exc}", param="sampling") from None


def key_to_wire(key: SchedulingKey) -> dict[str, Any]:
    return asdict(key)


def structured_to_wire(options: StructuredOutput) -> dict[str, Any]:
    return asdict(options)


def output_to_wire(out: RequestOutput) -> bytes:
    logprobs = None if out.logprobs is None else [(lp.token_id, lp.logprob, list(lp.top)) for lp in out.logprobs]
    wire = WireOutput(text=out.text, token_ids=list(out.token_ids), finished=out.finished,
                      finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                      cached_tokens=out.cached_tokens, completion_tokens=out.completion_tokens, error=out.error,
                      logprobs=logprobs, stop_reason=out.stop_reason,
                      cached_tokens_by_tier=dict(out.cached_tokens_by_tier or {}))
    return _ENCODER.encode(wire) + b"\n"


def output_from_wire(line: str | bytes, request_id: str) -> RequestOutput:
    """One NDJSON line back into a ``RequestOutput``; ``ValueError`` naming the field if it is not one."""
    try:
        w = _DECODER.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"malformed generate line from worker: {exc}") from None
    logprobs = None if w.logprobs is None else [TokenLogprob(t, lp, list(top)) for t, lp, top in w.logprobs]
    return RequestOutput(request_id=request_id, text=w.text, token_ids=w.token_ids, finished=w.finished,
                         finish_reason=w.finish_reason, stop_reason=w.stop_reason, prompt_tokens=w.prompt_tokens,
                         cached_tokens=w.cached_tokens, completion_tokens=w.completion_tokens, logprobs=logprobs,
                         error=w.error, cached_tokens_by_tier=w.cached_tokens_by_tier)


# ------------------------------------------------------------ routes


@worker_routes.post("/internal/generate")
async def internal_generate(body: GenerateBody, request: Request) -> StreamingResponse:
    """One request through the worker's ``Generator`` (its admission and its engine's check), its
    outputs streamed as they come."""
    parts = services(request)
    gen = parts.generator
    tracing.annotate(tracing.current(), {"agentrt.worker.id": request.app.state.worker.settings.worker_id})
    if parts.stopping:  # draining or shutting down: the router sends this request elsewhere
        raise draining(gen.config.retry_after_s)
    params = sampling_from_wire(body.sampling)
    spec = body.constraint
    constraint = None if spec is None else gen.constraint(StructuredOutput(**spec.model_dump()))
    key = None if body.key is None else SchedulingKey(**body.key.model_dump())
    moves = getattr(request.app.state, "kv_moves", None)
    if body.kv_source is not None and moves is not None:   # a hint: whatever fails is recomputed
        src = body.kv_source
        await moves.pull(src.url, body.prompt_token_ids, body.cache_salt, src.blocks, src.timeout_s)
    generation = await gen.start(body.prompt_token_ids, params, constraint=constraint, lease_ttl_s=body.lease_ttl_s,
                                 request_id=body.request_id, cache_salt=body.cache_salt, key=key)

    async def lines() -> AsyncIterator[bytes]:
        async for out in generation.outputs():
            yield output_to_wire(out)

    # the background close covers a client that left before the first line was read
    return StreamingResponse(lines(), media_type="application/x-ndjson", background=BackgroundTask(generation.close))


@worker_routes.post("/internal/drain")
async def internal_drain(request: Request) -> dict:
    """Drain as the first SIGTERM does (``WorkerRuntime.drain``: leave the routing table, answer new work
    with 503 ``worker_draining``, let requests in flight finish within ``--shutdown-timeout-s``, hand the
    pinned sessions' KV to the other workers) and answer when done, with what it did; the process stays
    up (drained) until it is stopped. A second call, or the SIGTERM that follows, returns the same result."""
    return await request.app.state.worker.drain(request.app, services(request).config.shutdown_timeout_s)


@worker_routes.post("/internal/lease/{op}")
async def internal_lease(op: str, body: LeaseBody, request: Request) -> dict:
    """One KV lease call on the worker's engine client (``EngineClient.extend_lease`` and the rest);
    404 for an unknown ``op``, 400 for an extend without ``ttl_s``."""
    engine = services(request).engine
    calls = {"extend": lambda: engine.extend_lease(body.lease_id, body.ttl_s),
             "release": lambda: engine.release_lease(body.lease_id),
             "demote": lambda: engine.demote_lease(body.lease_id),
             "prefetch": lambda: engine.prefetch_lease(body.lease_id)}
    if op not in calls:
        raise not_found(f"no lease call '{op}'; the calls are {', '.join(LEASE_OPS)}", param="op")
    if op == "extend" and body.ttl_s is None:
        raise bad_request("extend needs ttl_s, the lease's new TTL in seconds", param="ttl_s")
    calls[op]()
    return {"lease_id": body.lease_id, "op": op}


@worker_routes.get("/internal/lease/{lease_id}")
async def internal_lease_state(lease_id: str, request: Request) -> dict:
    """Whether the lease holds on this worker (it may have expired, been released or given way to memory)."""
    return {"lease_id": lease_id, "held": request.app.state.llm.pin_active(lease_id)}


@worker_routes.get("/internal/kv_snapshot")
async def kv_snapshot(request: Request) -> JSONResponse:
    """Cached block hashes (contract 1) and ``seq``, the last event published when they were read
    (both read by the engine thread at one moment, so later events apply on top)."""
    runtime = request.app.state.worker
    hashes, seq = await cache_snapshot(request.app.state.llm, runtime.publisher)
    return JSONResponse({"worker": runtime.settings.worker_id, "seq": seq, "hashes": hashes})


@worker_routes.get("/internal/status")
async def internal_status(request: Request) -> dict:
    """This worker as a router's dashboard shows it (its state: ``up``, or ``draining`` once told to stop;
    ``kv_moves``: KV page bytes it pulled from and served to other workers, its pulls and failed pulls)."""
    state, parts = request.app.state, services(request)
    worker = engine_worker(state.worker.settings.worker_id,
                           "draining" if parts.stopping or parts.generator.draining else "up",
                           state.llm.stats(), state.worker.settings.advertise_url)
    worker["load"]["in_flight"] = parts.generator.in_flight
    moves = getattr(state, "kv_moves", None)   # router/kv_moves.py: its pages moved in and out (None: moves off)
    worker["kv_moves"] = None if moves is None else {
        k: getattr(moves.stats, k) for k in ("pulled_bytes", "served_bytes", "pulls", "pull_failures")}
    return worker
