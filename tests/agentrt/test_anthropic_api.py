"""Anthropic's Messages API, driven by the official anthropic package against a real server with an API key.

The SDK sends the key as ``x-api-key``. Sampling parameters go in ``extra_body`` (this SDK version
no longer has them as arguments; the API still takes them) so that replies are greedy.
"""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest
from agentrt_test_helpers import MODEL, metric, wait_for

KEY = "anthropic-test-key"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_agentrt_server):
    server = start_agentrt_server(tmp_path_factory.mktemp("anthropic"), "--api-key", KEY,
                                  "--max-body-bytes", "65536")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_tool_choice_any_returns_a_tool_use_block_and_a_tool_result_round_trips(client):
    first = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_")
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    (block,) = [b for b in first.content if b.type == "tool_use"]
    assert block.id.startswith("toolu_") and block.name == "get_weather"
    assert block.input["city"] in ("Paris", "London")
    assert first.usage.output_tokens >= 1 and first.usage.input_tokens >= 1
    assert first.usage.cache_creation_input_tokens == 0

    messages = ASK + [{"role": "assistant", "content": first.content},  # the SDK's blocks, sent back as they came
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                    "content": [{"type": "text", "text": "Sunny, 24 C"}]}]}]
    reply = client.messages.create(model=MODEL, max_tokens=16, messages=messages, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text.strip()
    # the second request's prompt starts with the first's: its cached prefix is read
    assert reply.usage.cache_read_input_tokens > 0


def test_a_named_tool_and_an_error_result(client):
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                                     tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and message.stop_reason == "tool_use"
    messages = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                                          "input": block.input}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "is_error": True,
                                                    "content": "the weather service is down"},
                                                   {"type": "text", "text": "Apologize briefly."}]}]
    reply = client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[WEATHER], extra_body=GREEDY)
    assert reply.content and reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_max_tokens_and_stop_sequences(client):
    count = [{"role": "user", "content": "Count from 1 to 50, separated by commas."}]
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=count, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stopped = client.messages.create(model=MODEL, max_tokens=16, messages=count, stop_sequences=["3"],
                                     extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "3"
    assert "3" not in stopped.content[0].text


def test_streaming_text_through_the_sdk(client):
    with client.messages.stream(model=MODEL, max_tokens=8, system="You are terse.",
                                messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and [b.type for b in final.content] == ["text"] and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    assert final.id.startswith("msg_") and final.usage.input_tokens + final.usage.cache_read_input_tokens > 1

    events = list(client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                         stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + ["content_block_stop"]
    assert events[-2].usage.output_tokens == 4 and events[-2].delta.stop_reason == "max_tokens"


def test_streaming_a_tool_use_through_the_sdk(client):
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    tool_uses = [b for b in final.content if b.type == "tool_use"]
    assert tool_uses and all(b.name == "get_weather" and b.input["city"] in ("Paris", "London") for b in tool_uses)
    assert final.stop_reason in ("tool_use", "max_tokens")  # parallel calls may run until max_tokens
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(final.content)))


def test_the_wire_names_every_event_and_pings(server):
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]  # every data line follows its event line, named by its type
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop" and "data: [DONE]" not in lines


def test_count_tokens_is_the_prompt_and_a_long_system_prompt_is_read_from_the_cache_the_second_time(client):
    # a system prompt no other test sent, so the first call's prompt shares no cached page with earlier requests
    system = f"Session {uuid.uuid4().hex}. You are a meticulous travel assistant. " + \
        "Answer questions about cities, trains and the weather in one short sentence. " * 12
    request = {"model": MODEL, "system": system, "messages": ASK, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**request).input_tokens
    first = client.messages.create(max_tokens=2, extra_body=GREEDY, **request)
    assert counted == first.usage.input_tokens and first.usage.cache_read_input_tokens == 0
    second = client.messages.create(max_tokens=2, extra_body=GREEDY, **request)
    assert second.usage.cache_read_input_tokens > 200
    u = second.usage
    assert counted == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert client.messages.count_tokens(**request).input_tokens == counted


def test_cache_control_pins_the_prefix(client, server):
    pins = metric(server.url, "agentrt_kv_pins")
    system = [{"type": "text", "text": "You are a pinned assistant. " * 20, "cache_control": {"type": "ephemeral"}}]
    client.messages.create(model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi"}],
                           extra_body=GREEDY)
    assert wait_for(lambda: metric(server.url, "agentrt_kv_pins") == pins + 1)


def test_errors_are_anthropic_shaped(client, server):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=ASK)
    assert err.value.status_code == 404 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "not_found_error" and MODEL in err.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=anthropic.omit, messages=ASK)
    assert err.value.body["error"] == {"type": "invalid_request_error", "message": "'max_tokens': Field required"}

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "messages[0].content[0].type" in err.value.message and "'image'" in err.value.message

    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "'thinking'" in err.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.count_tokens(model=MODEL, messages=ASK, tools=[{"type": "web_search_20250305",
                                                                        "name": "web_search"}])
    assert "tools[0].type" in err.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError):  # prefill
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK + [{"role": "assistant", "content": "It"}])

    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * 70_000}])
    assert err.value.status_code == 413 and err.value.body["error"]["type"] == "request_too_large"

    # the OpenAI routes keep OpenAI's shape
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "nope", "messages": ASK},
                          headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_stream_refused_before_it_starts_is_a_plain_error(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        list(client.messages.create(model=MODEL, max_tokens=100_000, messages=ASK, stream=True))
    assert "context window" in err.value.body["error"]["message"]


def test_api_keys_x_api_key_and_bearer(server):
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as err:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert err.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=MODEL, messages=ASK)
    with anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0) as bearer:  # Authorization: Bearer
        assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    missing = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK})
    assert missing.status_code == 401
    assert missing.json() == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": missing.json()["error"]["message"]}}
    models = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY})  # the same keys on every route
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_ignore_eos_runs_the_reply_to_max_tokens(client):
    """The vLLM extension every surface takes (benchmarks/protocols.py sends it on each): without it
    the short reply ends at EOS, with it the reply runs to max_tokens."""
    # the reply's own length first, under a cap it ends well within: the greedy reply's length depends on the path
    # the server picked for this CPU (48 tokens did not hold it on an AVX2-only EPYC, float32 on the GGUF's blocks)
    ask = [{"role": "user", "content": "Reply with the single word: yes."}]
    short = client.messages.create(model=MODEL, max_tokens=256, messages=ask, extra_body=GREEDY)
    assert short.stop_reason == "end_turn" and short.usage.output_tokens < 256
    cap = short.usage.output_tokens + 8
    full = client.messages.create(model=MODEL, max_tokens=cap, messages=ask, extra_body={**GREEDY, "ignore_eos": True,
                                                                                          "seed": 7})
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == cap
