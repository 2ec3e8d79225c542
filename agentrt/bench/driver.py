"""One model call over HTTP, timed at the client: TTFT, per-request TPOT, end-to-end, usage.

Two ways to send a turn:

* :class:`ChatDriver`: ``POST /v1/chat/completions`` with ``stream: true`` and
  ``stream_options.include_usage``; the caller re-sends the whole history each turn, as
  agent frameworks do. Works against any OpenAI-compatible server (ours, a router,
  llama.cpp, sglang-router).
* :class:`SessionDriver`: agentrt's session API (``/v1/sessions``), where the server keeps
  the history and pins the session's KV between turns.

TTFT is from sending the request to the first streamed content; TPOT is
``(end - first) / (completion_tokens - 1)``. A server that reports no usage while streaming
(llama-cpp-python) gets its completion tokens counted by the tokenizer and no prompt or
cached figures (``None``), never a guess.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
from httpx_sse import aconnect_sse


class CallFailed(Exception):
    """A call that did not produce a reply (HTTP error, broken stream, error event)."""


@dataclass
class CallResult:
    ttft_s: float
    e2e_s: float
    reply: str
    completion_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(http: httpx.AsyncClient, target: str) -> str:
    """The first model ``GET /v1/models`` lists (what to put in ``model`` when the user gave none)."""
    try:
        resp = await http.get(target + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise CallFailed(f"{target}/v1/models: cannot read the served model ({exc}); pass --model") from None


@dataclass
class StreamedChat:
    """One streamed chat completion as the client saw it (``perf_counter`` times)."""

    start: float
    first: float | None  # the first text delta (None: no text came)
    end: float
    text: str
    usage: dict | None  # the last ``usage`` the stream carried
    timings: dict | None  # llama.cpp's ``timings``, where the server sends them


async def stream_chat_completion(http: httpx.AsyncClient, url: str, body: dict) -> StreamedChat:
    """POST ``body`` to ``url`` (a ``/v1/chat/completions`` endpoint) and read its server-sent events;
    ``CallFailed`` for an HTTP error, an error event, or a broken stream."""
    start = time.perf_counter()
    first, parts, usage, timings = None, [], None, None
    try:
        async with aconnect_sse(http, "POST", url, json=body) as source:
            resp = source.response
            if resp.status_code != 200:
                raise CallFailed(f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}")
            async for event in source.aiter_sse():
                if not event.data:
                    continue
                if event.data == "[DONE]":
                    break
                chunk = event.json()
                if "error" in chunk:
                    raise CallFailed(f"error event: {chunk['error']}")
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        first = first if first is not None else time.perf_counter()
                        parts.append(text)
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        raise CallFailed(f"{type(exc).__name__}: {exc}") from None
    return StreamedChat(start, first, time.perf_counter(), "".join(parts), usage, timings)


class ChatDriver:
    def __init__(self, http: httpx.AsyncClient, target: str, model: str, tokenizer, temperature: float = 0.0) -> None:
        self.http, self.url, self.model = http, target + "/v1/chat/completions", model
        self.tokenizer, self.temperature = tokenizer, temperature

    async def call(self, messages: list[dict], max_tokens: int) -> CallResult:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}}
        r = await stream_chat_completion(self.http, self.url, body)
        first = r.first if r.first is not None else r.end
        if r.usage is None:
            return CallResult(first - r.start, r.end - r.start, r.text, len(self.tokenizer.encode(r.text)), None, None)
        cached = (r.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return CallResult(first - r.start, r.end - r.start, r.text, int(r.usage["completion_tokens"]),
                          int(r.usage["prompt_tokens"]), int(cached) if cached is not None else None)


class SessionDriver:
    """agentrt's session API through ``agentrt.AsyncClient``; one instance per benchmark session."""

    def __init__(self, client, system: str | None, model: str, temperature: float = 0.0,
                 pin_ttl_s: float | None = None) -> None:
        self.client, self.system, self.model = client, system, model
        self.temperature, self.pin_ttl_s = temperature, pin_ttl_s
        self.session = None

    async def open(self) -> None:
        from agentrt.client import AgentRTError

        try:
            self.session = await self.client.sessions.create(
                system=self.system, model=self.model, sampling={"temperature": self.temperature},
                metadata={"benchmark": "agentrt-bench"}, pin_ttl_s=self.pin_ttl_s)
        except AgentRTError as exc:
            raise CallFailed(f"cannot open a session: {exc}") from None

    async def call(self, text: str, max_tokens: int) -> CallResult:
        from agentrt.client import AgentRTError

        if self.session is None:
            await self.open()
        start = time.perf_counter()
        first = None
        try:
            stream = await self.session.send({"role": "user", "content": text}, stream=True, max_tokens=max_tokens)
            async for delta in stream:
                if first is None and (delta.content or delta.tool_call):
                    first = time.perf_counter()
        except AgentRTError as exc:
            raise CallFailed(str(exc)) from None
        end = time.perf_counter()
        if stream.reply is None:
            raise CallFailed("the turn stream ended without a recorded turn")
        u = stream.reply.usage
        first = first if first is not None else end
        return CallResult(first - start, end - start, stream.reply.content or "", u.completion_tokens,
                          u.prompt_tokens, u.cached_tokens)

    async def close(self) -> None:
        from agentrt.client import AgentRTError

        if self.session is not None:
            try:
                await self.session.close()
            except AgentRTError:
                pass  # the run's figures do not depend on deleting the session
            self.session = None
