"""KV-pressure admission over HTTP: a server running one request at a time, with at most 60
tokens of prompts queued behind it. Past that a request gets 429 with ``Retry-After`` and a
message naming the limit; what was admitted finishes, and a later request succeeds."""

from __future__ import annotations

import json

import httpx
import pytest
from agentrt_test_helpers import MODEL, metric, wait_for

LIMIT = 60
POOL = 2032  # tokens of KV (127 pages of 16; one more page is reserved)


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_agentrt_server):
    server = start_agentrt_server(tmp_path_factory.mktemp("backpressure"), "--kv-cache-tokens", str(POOL + 16),
                                  "--max-num-seqs", "1", "--max-waiting-tokens", str(LIMIT), "--retry-after-s", "2")
    yield server
    server.stop()


def completion_text(lines) -> tuple[str, str | None]:
    """The text and finish reason of an SSE completion stream, read to ``[DONE]``."""
    text, reason = [], None
    for line in lines:
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            reason = choice["finish_reason"] or reason
    return "".join(text), reason


def test_queued_tokens_past_the_limit_get_429_and_nothing_is_lost(server):
    assert metric(server.url, "agentrt_engine_waiting_tokens_limit") == LIMIT
    running = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 120, "ignore_eos": True,
               "temperature": 0, "stream": True}
    queued = {"model": MODEL, "prompt": list(range(1000, 1040)), "max_tokens": 4, "ignore_eos": True,
              "temperature": 0, "stream": True}
    refused = {"model": MODEL, "prompt": list(range(2000, 2030)), "max_tokens": 4, "ignore_eos": True,
               "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=running) as first:
            assert first.status_code == 200
            first_lines = first.iter_lines()
            assert next(first_lines).startswith("data: ")  # a token: it holds the only running slot
            with http.stream("POST", "/v1/completions", json=queued) as second:
                assert second.status_code == 200  # admitted: 40 tokens wait behind the first request
                assert metric(server.url, "agentrt_engine_waiting_tokens") == 40
                third = http.post("/v1/completions", json=refused)
                assert third.status_code == 429
                assert third.headers["retry-after"] == "2"
                error = third.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "server_overloaded")
                assert ("40 tokens of queued requests are waiting for KV cache and this request's prompt adds "
                        "30, over the limit of 60 waiting tokens") in error["message"]
                assert metric(server.url, "agentrt_engine_waiting_tokens") == 40  # the refusal added nothing
                first_text, first_reason = completion_text(first_lines)
                second_text, second_reason = completion_text(second.iter_lines())
    assert first_reason == "length" and first_text
    assert second_reason == "length" and second_text
    assert wait_for(lambda: metric(server.url, "agentrt_engine_waiting_tokens") == 0)
    later = httpx.post(server.url + "/v1/completions", json=refused, timeout=120)
    assert later.status_code == 200
    body = later.json()
    assert body["usage"]["prompt_tokens"] == 30 and body["choices"][0]["finish_reason"] == "length"


def test_a_prompt_larger_than_the_kv_pool_is_400(server):
    too_long = {"model": MODEL, "prompt": [5] * (POOL + 1), "max_tokens": 1}
    response = httpx.post(server.url + "/v1/completions", json=too_long, timeout=120)
    assert response.status_code == 400
    assert (f"the prompt has {POOL + 1} tokens but the KV cache holds only {POOL} tokens"
            in response.json()["error"]["message"])
    assert metric(server.url, "agentrt_engine_waiting_tokens") == 0
