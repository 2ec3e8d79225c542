"""The OpenAI-compatible endpoints as a service class: requests in, response bodies or chunks out.

``OpenAIService`` knows nothing of HTTP; ``routes`` puts it behind its endpoints (``agentrt/api/http.py``
wraps the chunks as server-sent events). Chunk shapes follow OpenAI exactly: a first chunk with the assistant role, then
content or tool-call deltas (a tool call's first delta carries ``index``, ``id`` and
``name``, the next its ``arguments``), a chunk with ``finish_reason``, an optional usage
chunk with ``choices: []``, and the ``[DONE]`` sentinel added by the route.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request, Response

from engine.client import StructuredOutput
from engine.types import CLOSED_BY_BUDGET

from agentrt.api.http import ERRORS, Auth, reply
from agentrt.core.affinity import affinity_hint, affinity_key
from agentrt.core.errors import bad_request
from agentrt.core.generation import (Generation, Generator, Result, chat_switches, message_dicts, request_cache_salt,
                                     template_kwargs, tool_call_dicts)
from agentrt.core.request_fields import CHAT, COMPLETIONS, TOKENIZE, check_extra_fields
from agentrt.core.tenants import Tenant
from agentrt.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelList, TokenizeRequest


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def closed_mark(result: Result) -> dict[str, Any]:
    """The non-standard ``stop_reason`` a chat choice carries when its constrained output was closed
    early to fit ``max_tokens`` (vLLM's choices carry ``stop_reason`` too); nothing otherwise."""
    return {"stop_reason": CLOSED_BY_BUDGET} if result.closed_by_budget else {}


class OpenAIService:
    def __init__(self, generator: Generator) -> None:
        self.gen = generator
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.gen.model_name, "object": "model", "created": self.created,
                                             "owned_by": "agentrt", "max_model_len": self.gen.max_model_len}]}

    # ------------------------------------------------------------ chat

    async def start_chat(self, req: ChatCompletionRequest, tenant: Tenant | None = None,
                         affinity: str | None = None) -> Generation:
        """Validate and submit; errors (400/404/429) are raised here, before any byte is streamed.
        ``affinity``: the conversation's affinity key (``agentrt.core.affinity.affinity_key``), routed as
        the tenant's session hint."""
        started = time.monotonic()
        self.gen.check_model(req.model)
        check_extra_fields(req.model_extra, CHAT)
        if req.n != 1:
            raise bad_request("only n=1 is supported", param="n")
        if req.top_logprobs and not req.logprobs:   # as OpenAI and vLLM: not dropped without logprobs
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        kwargs = chat_switches(req.chat_template_kwargs, req.reasoning_effort, self.gen.tokenizer.chat_template)
        messages = message_dicts(req.messages)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if req.tool_choice is not None and not tools and req.tool_choice != "none":
            raise bad_request("tool_choice is set but no tools were given", param="tool_choice")
        options = StructuredOutput(req.response_format, tools, req.tool_choice, req.parallel_tool_calls)
        return await self.gen.start_chat(messages, req.model_dump(), options,
                                         logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                         started_at=started, session=affinity_hint(tenant, affinity),
                                         tenant=tenant, template_kwargs=kwargs,
                                         cache_salt=request_cache_salt(tenant, req.cache_salt))

    async def chat(self, req: ChatCompletionRequest, generation: Generation) -> dict[str, Any]:
        result = await generation.collect()
        message: dict[str, Any] = {"role": "assistant", "content": result.content}
        if result.reasoning is not None:
            message["reasoning_content"] = result.reasoning
        if result.tool_calls:
            message["tool_calls"] = tool_call_dicts(result.tool_calls)
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": result.finish_reason,
                                  "logprobs": None, **closed_mark(result)}
        if result.logprobs is not None:
            choice["logprobs"] = {"content": self._chat_logprobs(result.logprobs)}
        return {"id": "chatcmpl-" + generation.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.gen.model_name, "choices": [choice],
                "usage": usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}

    async def chat_chunks(self, req: ChatCompletionRequest, generation: Generation) -> AsyncIterator[dict]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": "chatcmpl-" + generation.request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.gen.model_name}

        def chunk(delta: dict, finish: str | None = None, logprobs: Any = None) -> dict:
            c = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                c["usage"] = None
            return c

        yield chunk({"role": "assistant", "content": ""})
        n_calls = 0
        async for d in generation.deltas():
            logprobs = {"content": self._chat_logprobs(d.logprobs)} if d.logprobs else None
            if d.reasoning:
                yield chunk({"reasoning_content": d.reasoning})
            if d.content or logprobs:
                yield chunk({"content": d.content}, logprobs=logprobs)
            for call in d.tool_calls:
                yield chunk({"tool_calls": [{"index": n_calls, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": n_calls, "function": {"arguments": call.arguments}}]})
                n_calls += 1
        result = generation.result
        last = chunk({}, finish=result.finish_reason)
        last["choices"][0].update(closed_mark(result))
        yield last
        if include_usage:
            yield {**base, "choices": [],
                   "usage": usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}

    def _chat_logprobs(self, logprobs: list) -> list[dict[str, Any]]:
        out = []
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            out.append({"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": (t := self._token_text(i)), "logprob": v,
                                          "bytes": list(t.encode())} for i, v in lp.top]})
        return out

    def _token_text(self, token_id: int) -> str:
        return self.gen.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ tokenize (vLLM's extension)

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """The token ids of a prompt, or of messages rendered as a chat request renders them."""
        self.gen.check_model(req.model)
        check_extra_fields(req.model_extra, TOKENIZE)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        tok = self.gen.tokenizer
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = self.gen.chat_text(message_dicts(req.messages), tools, template_kwargs(req.chat_template_kwargs),
                                      add_generation_prompt=req.add_generation_prompt)
            ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.gen.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.gen.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.gen.tokenizer.vocab_size]
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary (0..{self.gen.tokenizer.vocab_size - 1})",
                              param="tokens")
        return {"prompt": self.gen.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    # ------------------------------------------------------------ completions

    async def start_completion(self, req: CompletionRequest, tenant: Tenant | None = None,
                               affinity: str | None = None) -> Generation:
        """As :meth:`start_chat`, for a completion."""
        started = time.monotonic()
        self.gen.check_model(req.model)
        check_extra_fields(req.model_extra, COMPLETIONS)
        if req.n != 1:
            raise bad_request("only n=1 is supported", param="n")
        if req.echo or req.suffix:
            raise bad_request("echo and suffix are not supported", param="echo" if req.echo else "suffix")
        prompt = self._prompt_ids(req.prompt)
        params = self.gen.sampling_params(req.model_dump(), len(prompt), logprobs=req.logprobs)
        params.skip_special_tokens = req.skip_special_tokens
        return await self.gen.start(prompt, params, started_at=started, session=affinity_hint(tenant, affinity),
                                    tenant=tenant, cache_salt=request_cache_salt(tenant, req.cache_salt))

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.gen.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)  # their range is checked with the rest of the request, at submission
        else:
            raise bad_request("prompt must be a string or a list of token ids (one prompt per request)",
                              param="prompt")
        if not ids:
            raise bad_request("prompt is empty", param="prompt")
        return ids

    async def completion(self, req: CompletionRequest, generation: Generation) -> dict[str, Any]:
        result = await generation.collect()
        return {"id": "cmpl-" + generation.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.gen.model_name,
                "choices": [{"index": 0, "text": result.text, "finish_reason": result.finish_reason,
                             "logprobs": self._completion_logprobs(result.logprobs),
                             **({"token_ids": result.token_ids} if req.return_token_ids else {})}],
                "usage": usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}

    async def completion_chunks(self, req: CompletionRequest, generation: Generation) -> AsyncIterator[dict]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": "cmpl-" + generation.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.gen.model_name}
        sent = 0  # token ids already in a chunk (return_token_ids): each chunk carries the new ones

        def new_ids() -> dict[str, list[int]]:
            nonlocal sent
            if not req.return_token_ids:
                return {}
            ids = generation.token_ids[sent:]
            sent += len(ids)
            return {"token_ids": ids}

        async for d in generation.deltas():
            yield {**base, "choices": [{"index": 0, "text": d.content, "finish_reason": None,
                                        "logprobs": self._completion_logprobs(d.logprobs), **new_ids()}]}
        result: Result = generation.result
        yield {**base, "choices": [{"index": 0, "text": "", "finish_reason": result.finish_reason, "logprobs": None,
                                    **new_ids()}]}
        if include_usage:
            yield {**base, "choices": [],
                   "usage": usage_dict(result.prompt_tokens, result.completion_tokens, result.cached_tokens)}

    def _completion_logprobs(self, logprobs: list | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in logprobs]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{self._token_text(i): v for i, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


def routes(svc: OpenAIService, auth: Auth, retry_after_s: int) -> APIRouter:
    """OpenAI's Chat Completions and Completions, ``/v1/models``, and vLLM's ``/tokenize`` and
    ``/detokenize``, over ``svc``; ``auth``: the API-key check."""
    api = APIRouter(responses=ERRORS)

    @api.get("/v1/models", response_model=ModelList, dependencies=[Depends(auth)])
    async def models() -> dict:
        return svc.models()

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response,
                               tenant: Tenant = Depends(auth)) -> Any:
        generation = await svc.start_chat(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
        return await reply(request, response, generation, body.stream, lambda: svc.chat_chunks(body, generation),
                           lambda: svc.chat(body, generation), retry_after_s)

    @api.post("/tokenize", dependencies=[Depends(auth)])
    async def tokenize(body: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: token ids of a prompt, or of messages through the chat template."""
        return svc.tokenize(body)

    @api.post("/detokenize", dependencies=[Depends(auth)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        return svc.detokenize(body)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, response: Response,
                          tenant: Tenant = Depends(auth)) -> Any:
        generation = await svc.start_completion(body, tenant, affinity_key(request.headers, body.prompt_cache_key))
        return await reply(request, response, generation, body.stream,
                           lambda: svc.completion_chunks(body, generation), lambda: svc.completion(body, generation),
                           retry_after_s)

    return api
