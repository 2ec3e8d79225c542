"""Offline generation over the engine's public API: ``generate`` runs prompts together to completion
(tests, benchmarks, offline use), their text through an output processor each
(engine/tokenizer.py), as a server's streams have it."""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

from engine.constraints import TokenConstraint
from engine.tokenizer import OutputProcessor
from engine.types import EngineOverloaded, GenerationResult, RequestOutput, SamplingParams


class EngineAPI(Protocol):
    """The part of ``engine.engine.LLMEngine``'s public API that offline generation uses."""
    tokenizer: Any

    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, constraint: TokenConstraint | None = None) -> str: ...
    def step(self) -> list[RequestOutput]: ...
    def stop_request(self, request_id: str, stop: str) -> None: ...
    def has_request(self, request_id: str) -> bool: ...


def generate(engine: EngineAPI, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
             constraints: list[TokenConstraint | None] | None = None) -> list[GenerationResult]:
    """Run ``prompts`` together to completion. When the waiting queue is full (``EngineOverloaded``) it
    runs steps until the next prompt is admitted."""
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    results: dict[str, GenerationResult] = {}
    processors: dict[str, OutputProcessor] = {}
    start = time.monotonic()
    done = 0
    for i, prompt in enumerate(prompts):
        while True:
            try:
                rid = engine.add_request(prompt, plist[i], constraint=constraints[i] if constraints else None)
                break
            except EngineOverloaded:  # something is queued, so a step makes room
                done += _absorb(engine, engine.step(), results, processors, start)
        processors[rid] = OutputProcessor(engine.tokenizer, plist[i], engine.tokenizer.eos_token_ids)
        results[rid] = GenerationResult(rid, [], "", None, len(prompt), 0,
                                        [] if plist[i].logprobs is not None else None)
    while done < len(results):
        done += _absorb(engine, engine.step(), results, processors, start)
    while any(engine.has_request(rid) for rid in results):   # the engine's side of the stop strings found
        engine.step()
    return list(results.values())


def _absorb(engine: EngineAPI, outputs: list[RequestOutput], results: dict[str, GenerationResult],
            processors: dict[str, OutputProcessor], start: float) -> int:
    """Add a step's outputs to the results; how many requests finished."""
    finished = 0
    for raw in outputs:
        r = results.get(raw.request_id)
        out = processors[raw.request_id].process(raw) if r is not None else None
        if out is None:
            continue
        if out.finished and not raw.finished:   # a stop string: the engine finishes it next step
            engine.stop_request(out.request_id, processors[out.request_id].stopped)
        if r.ttft_s is None and out.token_ids:
            r.ttft_s = time.monotonic() - start
        r.token_ids.extend(out.token_ids)
        r.text += out.text
        if out.logprobs is not None and r.logprobs is not None:
            r.logprobs.extend(out.logprobs)
        if out.finished:
            r.finish_reason, r.cached_tokens, r.error = out.finish_reason, out.cached_tokens, out.error
            r.cached_tokens_by_tier, r.stop_reason = out.cached_tokens_by_tier, out.stop_reason
            finished += 1
    return finished
