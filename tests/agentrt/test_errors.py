"""Every error case returns an OpenAI-shaped error body with the right status."""

from __future__ import annotations

import httpx
import openai
import pytest
from agentrt_test_helpers import MODEL

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def http(agentrt_server):
    with httpx.Client(base_url=agentrt_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(agentrt_server):
    return openai.OpenAI(base_url=agentrt_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_json_is_400(http):
    response = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(response, 400)["message"]


def test_wrong_types_are_400_naming_the_field(http, oai):
    error = error_of(http.post(CHAT, json={"model": MODEL, "messages": "hello"}), 400)
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    error = error_of(http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "temperature": "hot"}), 400)
    assert error["param"] == "temperature"
    error = error_of(http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]}), 400)
    assert error["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert err.value.body["param"] == "n"


def test_prompt_longer_than_context_names_both_numbers(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}],
                                    max_tokens=4)
    message = err.value.body["message"]
    assert "8192" in message and "context window" in message
    prompt_tokens = int(message.split("has ")[1].split(" tokens")[0])
    assert prompt_tokens > 8192


def test_max_tokens_that_cannot_fit_is_400(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9000)
    assert "max_tokens (9000)" in err.value.body["message"]


def test_unknown_model_is_404(oai, http):
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    error_of(http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 404)


def test_unknown_route_is_404_in_error_shape(http):
    error_of(http.get("/v1/nothing-here"), 404)
