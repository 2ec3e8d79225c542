"""Budget-aware closing through the live server: the 400, the stop_reason mark, the metric."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from agentrt_test_helpers import MODEL, metric, wait_for
from engine.grammar import constraint_for_request
from engine.loader import load_tokenizer

ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}, "sources": {
    "type": "array", "items": {"type": "string"}}}, "required": ["answer", "sources"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "final_answer", "parameters": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
    "additionalProperties": False}}}]
LONG_ASK = [{"role": "user", "content": "Explain in great detail, with many sources, how bread is made."}]


@pytest.fixture(scope="module")
def shortest():
    """The shortest valid reply of each request below, as the server's closer finds it."""
    tok = load_tokenizer(None)[0]
    return {"json": len(constraint_for_request(tok, response_format=ANSWER_FORMAT).closing_plan()),
            "tool": len(constraint_for_request(tok, tools=TOOLS, tool_choice="required").closing_plan())}


@pytest.fixture(scope="module")
def client(agentrt_server):
    return openai.OpenAI(base_url=agentrt_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_max_tokens_below_the_shortest_valid_reply_is_a_400(client, shortest):
    n = shortest["json"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=LONG_ASK, response_format=ANSWER_FORMAT,
                                       max_tokens=n - 1)
    assert info.value.status_code == 400 and info.value.param == "max_tokens"
    assert f"max_tokens is {n - 1} but the shortest valid reply to this request's json_schema is {n} tokens" \
        in info.value.message
    with pytest.raises(openai.BadRequestError, match=f"is {shortest['tool']} tokens"):
        client.chat.completions.create(model=MODEL, messages=LONG_ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=shortest["tool"] - 1)
    # tool_choice auto has no minimum: free text is a valid reply
    reply = client.chat.completions.create(model=MODEL, messages=LONG_ASK, tools=TOOLS, max_tokens=1)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_reply_closed_under_budget_pressure_parses_and_is_marked(agentrt_server, client, shortest):
    before = metric(agentrt_server.url, "agentrt_requests_closed_by_budget_total")
    reply = client.chat.completions.create(model=MODEL, messages=LONG_ASK, response_format=ANSWER_FORMAT,
                                           max_tokens=shortest["json"] + 3, temperature=1.0, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == "max_tokens_closed"
    assert reply.usage.completion_tokens <= shortest["json"] + 3
    jsonschema.validate(json.loads(choice.message.content), ANSWER)

    chunks = list(client.chat.completions.create(model=MODEL, messages=LONG_ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=shortest["tool"] + 3, temperature=1.0, seed=2,
                                                 stream=True))
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == "tool_calls" and last.model_extra["stop_reason"] == "max_tokens_closed"
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []))
    assert json.loads(args).keys() == {"answer"}
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    # counted when the generation closes, which may be just after the last chunk went out
    assert wait_for(lambda: metric(agentrt_server.url, "agentrt_requests_closed_by_budget_total") == before + 2, 10)


def test_a_reply_with_room_to_spare_carries_no_mark(agentrt_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    choice = httpx.post(agentrt_server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    assert "stop_reason" not in choice
