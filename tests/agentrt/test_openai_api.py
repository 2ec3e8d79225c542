"""The OpenAI-compatible endpoints, driven by the official openai package against the real server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from agentrt_test_helpers import MODEL, WEATHER_TOOL, metric


@pytest.fixture(scope="module")
def oai(agentrt_server):
    return openai.OpenAI(base_url=agentrt_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_health(oai, agentrt_server):
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert httpx.get(agentrt_server.url + "/health").json() == {"status": "ok", "model": MODEL}


def test_chat_then_second_turn_reuses_the_cache(oai):
    messages = [{"role": "system", "content": "You are a geography tutor. Answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = first.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens >= 1
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens

    messages += [{"role": "assistant", "content": choice.message.content},
                 {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
    second = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_chunks_and_usage(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({c.id for c in chunks}) == 1
    assert text.strip()


def test_truncation_reports_length_and_stop_strings_are_cut(oai):
    long = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 50."}],
                                       max_tokens=3, temperature=0)
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 3
    stopped = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 50."}],
                                          max_tokens=16, temperature=0, stop=["3"])
    assert "3" not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


def test_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=40, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London")

    messages += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                        max_tokens=16, temperature=0)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_tool_call_deltas(oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in London?"}], tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0,
        stream=True)
    deltas, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        deltas += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments)["city"] in ("Paris", "London")


def test_completions_endpoint_and_logprobs(oai):
    done = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=2)
    choice = done.choices[0]
    assert choice.text and done.usage.completion_tokens == len(choice.logprobs.tokens)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == choice.text

    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 2


def test_metrics_exposition(oai, agentrt_server):
    text = httpx.get(agentrt_server.url + "/metrics").text
    for name in ("agentrt_http_requests_total", "agentrt_time_to_first_token_seconds_bucket",
                 "agentrt_time_per_output_token_seconds_bucket", "agentrt_engine_running", "agentrt_engine_waiting",
                 "agentrt_kv_pages_used", "agentrt_prefix_cache_hit_tokens_total"):
        assert name in text, name
    assert metric(agentrt_server.url, "agentrt_time_to_first_token_seconds_count") > 0
    assert metric(agentrt_server.url, "agentrt_kv_pages_capacity") > 0


def test_affinity_keys_are_taken_and_one_process_names_no_worker(oai, agentrt_server):
    """``prompt_cache_key`` and the session headers route a conversation behind a router; one process
    takes them and has nothing to route, so its responses carry no ``x-agentrt-worker``."""
    messages = [{"role": "user", "content": "Say hello."}]
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, prompt_cache_key="conv-1",
        extra_headers={"X-Claude-Code-Session-Id": "s-1", "session_id": "s-2"})
    assert raw.parse().usage.completion_tokens >= 1 and "x-agentrt-worker" not in raw.headers
    streamed = oai.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
        extra_headers={"x-session-affinity": "conv-2"})
    assert "x-agentrt-worker" not in streamed.headers
    assert [c for c in streamed.parse() if c.choices and c.choices[0].finish_reason]
    completion = oai.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2,
                                                          extra_body={"prompt_cache_key": "conv-3"})
    assert completion.parse().usage.completion_tokens >= 1 and "x-agentrt-worker" not in completion.headers
    bad = httpx.post(agentrt_server.url + "/v1/chat/completions", timeout=60,
                     json={"model": MODEL, "messages": messages, "prompt_cache_key": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key", bad.text
