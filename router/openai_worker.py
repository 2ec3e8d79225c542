"""Workers of kind vllm: vLLM/SGLang-style servers the router follows by their KV events and reaches by
their OpenAI endpoint.

Such a worker (``agentrt router --vllm-worker [ID=]URL,EVENTS[,REPLAY]``, ``router/config.py``) is not
in Redis: the router knows it from its flags (every replica has the same ones, so contract 3 holds),
and ``VllmWorkers`` keeps, per worker, a ``VllmEventFollower`` feeding the router's ``PrefixIndex``
(``router/vllm_consumer.py``) and a health probe: ``GET {url}/v1/models`` every
``vllm_health_interval_s``, which also gives the model name the worker serves (the ``model`` of the
requests sent to it). A worker is live while its last probe answered 200 with a model and no request
failed to connect to it since (``mark_dead``). Load is what the router itself sends it: the
``InFlightTracker`` counts (such workers publish no load reports).

``stream_completion`` runs one routed request there: the router has already applied the chat template
and tokenized, so it posts the token ids as the ``prompt`` of ``/v1/completions`` (vLLM and SGLang
accept token-id prompts) with ``stream``, ``stream_options.include_usage`` and vLLM's
``return_token_ids`` (the reply's token ids per chunk; agentrt's own server honours it too) and turns
the server-sent chunks into ``RequestOutput`` deltas. A server that sends no token ids still streams
its text; the token counts then come from its usage. Grammar-constrained requests (tools,
``response_format``) and logprobs are not sent to these workers: their grammar is agentrt's own
(``RemoteEngine`` routes them to agentrt workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import httpx
from httpx_sse import EventSource

from agentrt.core.tasks import cancel_and_wait
from engine.hashing import make_seed
from engine.types import RequestOutput, SamplingParams
from router.config import RouterConfig, VllmWorkerSpec
from router.index import PrefixIndex
from router.registry import WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class VllmWorkerState:
    spec: VllmWorkerSpec
    served_model: str | None = None   # from /v1/models
    healthy: bool = False
    probed_at: float = -math.inf      # monotonic start of the last successful probe
    dead_at: float = -math.inf        # monotonic time of the last mark_dead
    probe_failures: int = 0

    @property
    def live(self) -> bool:
        return self.healthy and self.served_model is not None and self.probed_at > self.dead_at


class VllmWorkers:
    """The vllm-kind workers of one router replica: their followers, health and ``WorkerInfo``."""

    def __init__(self, config: RouterConfig, model_id: str, index: PrefixIndex,
                 on_blocks: Callable[[str, tuple[int, ...]], None] | None = None,
                 probe_timeout_s: float = 2.0) -> None:
        from router.vllm_consumer import VllmEventFollower  # pyzmq only where such workers are configured
        from router.vllm_hashmap import ChainMapper

        self.config = config
        self.model_id = model_id
        self.probe_timeout_s = probe_timeout_s
        self.states = {s.worker_id: VllmWorkerState(s) for s in config.vllm_workers}
        seed = make_seed(model_id)  # routed prompts without a cache salt (salted ones match nothing here)
        self.followers = {
            s.worker_id: VllmEventFollower(s.worker_id, s.events, index, ChainMapper(seed, config.block_size),
                                           replay_endpoint=s.replay, topic=config.vllm_events_topic,
                                           on_blocks=on_blocks)
            for s in config.vllm_workers}
        self._http = httpx.AsyncClient(timeout=probe_timeout_s)
        self._tasks: list[asyncio.Task] = []

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.states

    def __bool__(self) -> bool:
        return bool(self.states)

    async def start(self) -> None:
        """Subscribe to every worker's events, probe each once, then keep probing in the background."""
        for follower in self.followers.values():
            follower.start()
        await asyncio.gather(*(self.probe(wid) for wid in self.states))
        self._tasks = [asyncio.create_task(self._probe_forever(wid), name=f"vllm-health-{wid}")
                       for wid in self.states]

    async def stop(self) -> None:
        await asyncio.gather(*(cancel_and_wait(task) for task in self._tasks))   # the health probes
        for follower in self.followers.values():
            await follower.stop()
        await self._http.aclose()

    async def _probe_forever(self, worker_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.vllm_health_interval_s)
            await self.probe(worker_id)

    async def probe(self, worker_id: str) -> bool:
        """``GET /v1/models``: live when it answers 200 with at least one model."""
        state = self.states[worker_id]
        started = time.monotonic()
        try:
            resp = await self._http.get(state.spec.url + "/v1/models")
            models = resp.json().get("data") if resp.status_code == 200 else None
            name = models[0]["id"] if isinstance(models, list) and models else None
            if not isinstance(name, str):
                raise ValueError(f"answered {resp.status_code} without a model")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if state.healthy or state.probe_failures == 0:
                log.warning("vLLM worker %s (%s) failed its health probe: %s", worker_id, state.spec.url, exc)
            state.healthy = False
            state.probe_failures += 1
            return False
        if name != self.model_id and state.served_model != name:
            log.info("vLLM worker %s serves %r as this router's %r", worker_id, name, self.model_id)
        state.served_model, state.healthy, state.probed_at = name, True, started
        return True

    def mark_dead(self, worker_id: str) -> None:
        """A connection failed: not live until a probe that starts after now succeeds."""
        self.states[worker_id].dead_at = time.monotonic()
        self.states[worker_id].healthy = False

    def live(self) -> dict[str, WorkerInfo]:
        return {wid: WorkerInfo(worker_id=wid, url=s.spec.url, model=self.model_id,
                                block_size=self.config.block_size)
                for wid, s in self.states.items() if s.live}

    def held(self, worker_id: str) -> frozenset[int]:
        return self.followers[worker_id].held()

    def state(self) -> list[dict]:
        out = []
        for wid, s in sorted(self.states.items()):
            f = self.followers[wid]
            out.append({"id": wid, "url": s.spec.url, "events": s.spec.events, "replay": s.spec.replay,
                        "live": s.live, "served_model": s.served_model, "probe_failures": s.probe_failures,
                        "next_seq": f.next_seq, "events_stats": vars(f.stats).copy(),
                        "mapper": {"blocks": len(f.mapper), **vars(f.mapper.stats)}})
        return out


# ------------------------------------------------------------------ requests


def completion_body(model: str, prompt: list[int], params: SamplingParams, cache_salt: str) -> dict:
    """The ``/v1/completions`` request for one routed prompt (vLLM's extensions: top_k, stop_token_ids,
    ignore_eos, return_token_ids, cache_salt)."""
    body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if not params.skip_special_tokens:
        body["skip_special_tokens"] = False
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


class CompletionStreamError(ValueError):
    """A chunk of the worker's stream that is not what ``/v1/completions`` streams."""


async def stream_completion(resp: httpx.Response, request_id: str, prompt_tokens: int) -> AsyncIterator[RequestOutput]:
    """``RequestOutput`` deltas from an open ``/v1/completions`` event stream (status 200); the last one is
    finished and carries the usage. Raises ``CompletionStreamError`` on a response that is not an event
    stream or a chunk it cannot read, and ``httpx.RemoteProtocolError`` if the stream ends before the
    reply finished."""
    completion = cached = 0
    usage_seen = False
    finish: tuple[str, str | int | None] | None = None
    content_type = resp.headers.get("content-type", "")
    if "text/event-stream" not in content_type:
        raise CompletionStreamError(f"the worker answered {content_type or 'no content type'!r}, not an event stream")
    async with contextlib.aclosing(EventSource(resp).aiter_sse()) as events:
        async for event in events:
            data = event.data.strip()
            if data == "[DONE]":
                break
            if not data:
                continue
            try:
                chunk = json.loads(data)
                if "error" in chunk:
                    raise CompletionStreamError(f"the worker failed the request: {chunk['error']}")
                usage = chunk.get("usage")
                if usage:
                    usage_seen = True
                    prompt_tokens = int(usage.get("prompt_tokens", prompt_tokens))
                    completion = int(usage.get("completion_tokens", completion))
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") or ""
                    token_ids = [int(t) for t in choice.get("token_ids") or ()]
                    if not usage_seen:
                        completion += len(token_ids)
                    if text or token_ids:
                        yield RequestOutput(request_id, text, token_ids, prompt_tokens=prompt_tokens,
                                            cached_tokens=cached, completion_tokens=completion)
                    if choice.get("finish_reason"):
                        finish = (str(choice["finish_reason"]), choice.get("stop_reason"))
            except (ValueError, TypeError, AttributeError) as exc:
                if isinstance(exc, CompletionStreamError):
                    raise
                raise CompletionStreamError(f"unreadable chunk from the worker: {data[:200]!r}") from None
    if finish is None:
        raise httpx.RemoteProtocolError("the worker ended the stream before the reply finished")
    reason, stop_reason = finish
    if reason not in ("stop", "length", "abort"):
        reason = "stop"
    yield RequestOutput(request_id, "", [], finished=True, finish_reason=reason,
                        stop_reason=stop_reason if isinstance(stop_reason, (str, int)) else None,
                        prompt_tokens=prompt_tokens, cached_tokens=cached, completion_tokens=completion)
