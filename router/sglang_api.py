"""The endpoints SGLang's router (``sglang-router`` on PyPI) expects of a worker.

With these, ``sglang-router`` can front our workers as a peer in benchmarks
(``benchmarks/routing.py --live``). It health-checks ``GET /health``, reads
``/get_server_info`` (or ``/server_info``) and ``/get_model_info`` (or ``/model_info``) at
start, polls ``/get_load`` for its ``power_of_two`` policy (a JSON array of
``{"num_tokens": N}``), posts ``/flush_cache``, and forwards ``/generate`` (SGLang's native
API), ``/v1/chat/completions`` and ``/v1/completions`` (served by agentrt's own routes).
A streamed ``/generate`` sends the text so far in each event, then ``data: [DONE]``; a failure
after the first event arrives as an ``{"error": ...}`` event, as on agentrt's own streams.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from agentrt.core.errors import bad_request
from agentrt.core.request_fields import COMPLETIONS, check_extra_fields
from agentrt.api.http import sse_response
from agentrt.server import services

sglang_routes = APIRouter()


def _server_info(request: Request) -> dict[str, Any]:
    state = request.app.state
    llm, runtime = state.llm, state.worker
    return {"model_path": llm.model_id, "served_model_name": llm.model_id, "tokenizer_path": None,
            "worker_id": runtime.settings.worker_id, "max_model_len": llm.max_model_len,
            "page_size": llm.config.page_size, "max_running_requests": llm.config.max_num_seqs,
            "max_total_num_tokens": llm.config.num_pages * llm.config.page_size, "version": "agentrt"}


@sglang_routes.get("/get_server_info")
@sglang_routes.get("/server_info")
async def server_info(request: Request) -> dict:
    return _server_info(request)


@sglang_routes.get("/get_model_info")
@sglang_routes.get("/model_info")
async def model_info(request: Request) -> dict:
    llm = request.app.state.llm
    return {"model_path": llm.model_id, "tokenizer_path": None, "is_generation": True}


@sglang_routes.get("/get_load")
async def get_load(request: Request) -> list[dict]:
    """SGLang's shape (a list, one entry per data-parallel rank) plus our load fields."""
    s = request.app.state.llm.stats()
    return [{"num_tokens": s.pages_used * s.page_size, "num_reqs": s.running + s.waiting, "running": s.running,
             "waiting": s.waiting, "pages_used": s.pages_used, "pages_free": s.pages_free,
             "pages_total": s.pages_total, "prompt_tokens_total": s.prompt_tokens_total,
             "cached_tokens_total": s.cached_tokens_total, "kv_tiers": s.kv_tiers}]


@sglang_routes.post("/flush_cache")
@sglang_routes.get("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    """Drop every unpinned cached prefix; the evictions reach routers as ``removed`` events."""
    request.app.state.llm.flush_cache()
    return JSONResponse({"flushed": True})


class NativeSampling(BaseModel):
    """SGLang's ``sampling_params``: the ones read here, typed (a wrong type is a 400 naming it); the others
    pass only at their neutral values (``SAMPLING_FIELDS``)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None          # -1: none, as SGLang
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    sampling_seed: StrictInt | None = None
    skip_special_tokens: bool | None = None


class NativeGenerateRequest(BaseModel):
    """SGLang's ``/generate`` body (one prompt): ``text`` or ``input_ids``, ``sampling_params``, ``stream``.
    Its other fields, and sampling parameters agentrt does not implement, pass only at their neutral
    values (``GENERATE_FIELDS``, ``SAMPLING_FIELDS``; agentrt/core/request_fields.py)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    rid: str | None = None


_NONE = ((None,), "null", "")
# SGLang's GenerateReqInput fields agentrt does not implement (one prompt, text out)
GENERATE_FIELDS = {
    **{name: _NONE for name in ("image_data", "audio_data", "video_data", "lora_path", "lora_id", "session_params",
                                "custom_logit_processor", "token_ids_logprob", "bootstrap_host", "bootstrap_port",
                                "bootstrap_room", "data_parallel_rank", "modalities")},
    "return_logprob": ((None, False), "false", ""),
    "logprob_start_len": ((None, -1), "-1", ""),
    "top_logprobs_num": ((None, 0), "0", ""),
    "return_text_in_logprobs": ((None, False), "false", ""),
    "return_hidden_states": ((None, False), "false", ""),
    "log_metrics": ((), "", ""),   # any: whether SGLang logs the request's metrics
}
# SGLang's sampling parameters agentrt does not implement (at their neutral values)
SAMPLING_FIELDS = {
    **{name: COMPLETIONS[name] for name in ("min_p", "repetition_penalty", "spaces_between_special_tokens",
                                            "logit_bias")},   # vLLM's names and neutral values are SGLang's
    "frequency_penalty": ((None, 0, 0.0), "0", ""),
    "presence_penalty": ((None, 0, 0.0), "0", ""),
    "min_new_tokens": ((None, 0), "0", ""),
    "n": ((None, 1), "1", ""),
    "no_stop_trim": ((None, False), "false", ""),
    **{name: ((None,), "null", "; use /v1/chat/completions with response_format or tools")
       for name in ("json_schema", "regex", "ebnf", "structural_tag")},
    "custom_params": _NONE,
    "stream_interval": ((), "", ""),   # any: how often SGLang sends a streamed event
}


def _native_params(gen, sp: NativeSampling, prompt_len: int):
    check_extra_fields(sp.model_extra, SAMPLING_FIELDS, "sampling_params.")
    fields = {"max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
              "top_k": 0 if sp.top_k == -1 else sp.top_k, "stop": sp.stop, "stop_token_ids": sp.stop_token_ids,
              "ignore_eos": sp.ignore_eos, "seed": sp.sampling_seed}
    params = gen.sampling_params(fields, prompt_len)
    params.skip_special_tokens = sp.skip_special_tokens is not False
    return params


def _meta(request_id: str, result) -> dict[str, Any]:
    return {"id": request_id, "finish_reason": {"type": result.finish_reason},
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens}


@sglang_routes.post("/generate")
async def native_generate(body: NativeGenerateRequest, request: Request) -> Any:
    gen = services(request).generator
    check_extra_fields(body.model_extra, GENERATE_FIELDS)
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text and input_ids", param="text")
    ids = gen.tokenizer.encode(body.text) if body.text is not None else list(body.input_ids)
    if not ids:
        raise bad_request("the prompt is empty", param="text")
    rid = body.rid or "gen-" + uuid.uuid4().hex
    generation = await gen.start(ids, _native_params(gen, body.sampling_params, len(ids)), request_id=rid,
                                 started_at=time.monotonic())
    if not body.stream:
        result = await generation.collect()
        return {"text": result.text, "output_ids": result.token_ids, "meta_info": _meta(rid, result)}

    async def chunks() -> AsyncIterator[dict]:
        text: list[str] = []
        async for d in generation.deltas():
            text.append(d.content)
            yield {"text": "".join(text), "meta_info": {"id": rid}}
        yield {"text": "".join(text), "meta_info": _meta(rid, generation.result)}

    return sse_response(chunks(), generation.close, services(request).config.retry_after_s)
