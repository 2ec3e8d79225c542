"""vLLM's ``/tokenize`` and ``/detokenize`` on the real server (the default model's template)."""

from __future__ import annotations

import httpx
import pytest
from agentrt_test_helpers import MODEL, WEATHER_TOOL
from transformers import PreTrainedTokenizerFast

from engine.loader import load_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def http(agentrt_server):
    with httpx.Client(base_url=agentrt_server.url, timeout=60) as client:
        yield client


def test_tokenize_messages_gives_transformers_ids_and_detokenize_round_trips(http):
    tok = load_tokenizer(None)[0]
    reference = PreTrainedTokenizerFast(tokenizer_object=tok.hf, bos_token="<|im_start|>", eos_token="<|im_end|>")
    for add_generation_prompt in (True, False):
        got = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
                                           "add_generation_prompt": add_generation_prompt}).json()
        want = reference.apply_chat_template([{"role": "user", "content": "Hi there"}], chat_template=tok.chat_template,
                                             add_generation_prompt=add_generation_prompt, tokenize=True,
                                             return_dict=False)
        assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 8192
        assert http.post("/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == \
            reference.decode(want, skip_special_tokens=False)
    # with tools: the ids of the prompt a chat completion submits (the Hermes preamble for this template)
    body = http.post("/tokenize", json={"messages": MESSAGES, "tools": [WEATHER_TOOL],
                                        "return_token_strs": True}).json()
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "<tools>" in text and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert text.endswith("<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert len(body["token_strs"]) == body["count"] and body["token_strs"][0] == "<|im_start|>"
    prompt = http.post("/tokenize", json={"prompt": text}).json()
    assert prompt["tokens"] == body["tokens"]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
    ({"messages": [{"role": "user", "content": "b"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
])
def test_tokenize_refuses_ambiguous_or_wrong_requests(http, body, param):
    r = http.post("/tokenize", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param


def test_detokenize_refuses_ids_outside_the_vocabulary(http):
    r = http.post("/detokenize", json={"tokens": [1, 49152]})
    assert r.status_code == 400 and "49152" in r.json()["error"]["message"]
