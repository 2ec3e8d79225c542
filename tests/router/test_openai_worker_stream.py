"""router/openai_worker.py's ``stream_completion``: a vLLM-style ``/v1/completions`` event stream read
through httpx-sse into ``RequestOutput`` deltas, whatever the byte chunking; a response that is not an
event stream, an unreadable chunk and a stream that ends before its reply finished are errors."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from router.openai_worker import CompletionStreamError, stream_completion

SSE = {"content-type": "text/event-stream; charset=utf-8"}


def event_stream(chunks: list[dict], done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + (": keep-alive\n\n" if chunks else "")
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def response(body: bytes, headers: dict = SSE, cuts: int = 0, seed: int = 0) -> httpx.Response:
    """A 200 whose body arrives in ``cuts + 1`` pieces cut at random bytes (inside lines and UTF-8 runes)."""
    points = sorted(random.Random(seed).sample(range(1, len(body)), min(cuts, len(body) - 1)))
    pieces = [body[a:b] for a, b in zip([0, *points], [*points, len(body)])]

    async def chunks():
        for piece in pieces:
            yield piece

    return httpx.Response(200, headers=headers, content=chunks())


def read(resp: httpx.Response) -> list:
    async def run():
        return [out async for out in stream_completion(resp, "r1", prompt_tokens=5)]
    return asyncio.run(run())


REPLY = [{"choices": [{"index": 0, "text": "Hé", "token_ids": [11, 12]}]},
         {"choices": [{"index": 0, "text": "llo", "token_ids": [13]}]},
         {"choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": 2}]},
         {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                   "prompt_tokens_details": {"cached_tokens": 4}}}]


@pytest.mark.parametrize("seed", range(20))
def test_deltas_and_usage_are_the_same_in_any_chunking(seed):
    outs = read(response(event_stream(REPLY), cuts=seed % 9 * 7, seed=seed))
    assert [(o.text, o.token_ids, o.finished) for o in outs] == [("Hé", [11, 12], False), ("llo", [13], False),
                                                                ("", [], True)]
    last = outs[-1]
    assert (last.finish_reason, last.stop_reason) == ("stop", 2)
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (7, 3, 4)


def test_a_reply_that_is_not_an_event_stream_is_refused():
    with pytest.raises(CompletionStreamError, match="'application/json', not an event stream"):
        read(response(json.dumps({"choices": []}).encode(), headers={"content-type": "application/json"}))


def test_an_error_chunk_and_an_unreadable_chunk_are_errors():
    with pytest.raises(CompletionStreamError, match="the worker failed the request: boom"):
        read(response(event_stream([{"error": "boom"}])))
    with pytest.raises(CompletionStreamError, match="unreadable chunk from the worker: 'not json'"):
        read(response(b"data: not json\n\n"))


def test_a_stream_cut_before_the_reply_finished_is_a_protocol_error():
    with pytest.raises(httpx.RemoteProtocolError, match="before the reply finished"):
        read(response(event_stream(REPLY[:2], done=False)))
