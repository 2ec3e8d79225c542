"""Request fields of OpenAI's API and vLLM's extensions on a real server: the ones agentrt does not
implement are accepted at their neutral values and refused otherwise, unknown ones are refused as
OpenAI refuses them, and the vLLM fields it does implement (``stop_token_ids``, ``skip_special_tokens``,
``cache_salt``, chat's ``reasoning_effort``) change the reply as they say. The official ``openai`` client
sends them as a framework would (``extra_body``)."""

from __future__ import annotations

import httpx
import openai
import pytest
from agentrt_test_helpers import MODEL

from agentrt.core.errors import APIError
from agentrt.core.generation import chat_switches
from agentrt.core.request_fields import CHAT, COMPLETIONS, check_extra_fields
from engine.tokenizer import Tokenizer, render_chat_prompt
from tests.llamacpp_templates import templates_dir

USER = [{"role": "user", "content": "Name one colour."}]
# SmolLM2's chat format written out
CHAT_PROMPT = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def oai(agentrt_server):
    return openai.OpenAI(base_url=agentrt_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(agentrt_server):
    with httpx.Client(base_url=agentrt_server.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("name, value", [
    ("logit_bias", {"42": 5}), ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3),
    ("guided_json", {"type": "object"}), ("functions", [{"name": "f", "parameters": {}}]),
    ("modalities", ["text", "audio"]), ("store", True), ("service_tier", "flex"), ("skip_special_tokens", False),
    ("chat_template", "{{ messages }}"), ("include_stop_str_in_output", True)])
def test_a_field_not_implemented_is_refused_unless_neutral(oai, name, value):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={name: value})
    assert err.value.body["param"] == name
    assert err.value.body["message"].startswith(f"{name} is not supported by this server (only ")


def test_neutral_values_of_those_fields_are_accepted(oai):
    neutral = {"logit_bias": {}, "min_p": 0, "repetition_penalty": 1.0, "min_tokens": 0, "store": False,
               "service_tier": "auto", "modalities": ["text"], "metadata": {"run": "7"}, "guided_json": None,
               "skip_special_tokens": True, "safety_identifier": "user-1"}
    # both after a first request has cached the prompt (a prefill from scratch and one over cached pages may
    # round apart, and flip a greedy near-tie)
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
    reply = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0, extra_body=neutral)
    plain = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].message.content


def test_an_unknown_field_is_refused_by_name(http):
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Hi"})):
        r = http.post(path, json={"model": MODEL, "max_token": 4, **body})   # max_tokens misspelt
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_token" and "Unrecognized request argument supplied: max_token" in error["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def _completion(oai, **extra):
    return oai.completions.create(model=MODEL, prompt=CHAT_PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True, **extra})


def test_stop_token_ids_end_the_reply(oai, http):
    free = _completion(oai)
    ids = free.choices[0].model_extra["token_ids"]
    assert len(ids) == 8 and free.choices[0].finish_reason == "length"
    stopped = _completion(oai, stop_token_ids=[ids[2]])
    got = stopped.choices[0].model_extra["token_ids"]
    assert stopped.choices[0].finish_reason == "stop" and got == ids[:len(got)] and len(got) <= 3
    assert ids[2] in got or len(got) < 3
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [10**9]})
    assert r.status_code == 400 and "stop_token_ids must be in [0, " in r.json()["error"]["message"], r.text


def test_skip_special_tokens_false_keeps_them_in_the_text(oai):
    # a short greedy reply that ends at <|im_end|> (a special token); ignore_eos then writes it and goes on
    for ask, start in (("Reply with the single word: yes.", "Yes."), ("Say yes.", ""),
                       ("What is 2 + 2? Answer with a number.", "")):
        prompt = f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n{start}"
        first = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0]
        if first.finish_reason == "stop":
            break
    else:
        pytest.fail(f"no prompt's reply ended within 24 tokens (the last: {first.text!r})")

    def run(**extra):
        return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=28, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True, **extra}).choices[0]

    kept, skipped = run(skip_special_tokens=False), run()
    n = len(first.model_extra["token_ids"]) + 1       # the reply and its <|im_end|>, then what follows it
    assert kept.model_extra["token_ids"][:n] == skipped.model_extra["token_ids"][:n]
    assert "<|im_end|>" in kept.text and "<|im_end|>" not in skipped.text
    assert kept.text.startswith(first.text + "<|im_end|>") and skipped.text.startswith(first.text)


def test_cache_salt_keeps_cached_blocks_to_requests_of_the_same_salt(http):
    prompt = "A long shared preamble for the salt test. " * 20 + "Now say hi."

    def cached(**extra) -> int:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="alpha")                  # fills the cache under alpha
    assert cached(cache_salt="alpha") >= 128    # the same salt reads it
    assert cached(cache_salt="beta") == 0       # another salt does not
    assert cached() == 0                        # nor a request without one


def test_reasoning_effort_is_the_templates_switch(oai):
    # SmolLM2's template has none: only 'none' is accepted
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="high")
    assert err.value.body["param"] == "reasoning_effort" and "no reasoning effort" in err.value.body["message"]
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={"reasoning_effort": "none"})


def _template_and_tokenizer(filename: str) -> tuple[str, Tokenizer]:
    from engine.loader import load_tokenizer
    template = (templates_dir() / filename).read_text()
    base = load_tokenizer(None)[0]
    return template, Tokenizer(hf=base.hf, chat_template=template, bos_token_id=base.bos_token_id,
                               eos_token_ids=base.eos_token_ids)


def test_reasoning_effort_none_turns_an_on_off_switch_off():
    """Qwen3's template switches reasoning on or off (enable_thinking): 'none' is the off position,
    rendered as the template renders it off (an empty think block); an effort level has no meaning there."""
    template, tok = _template_and_tokenizer("Qwen-Qwen3-0.6B.jinja")
    kwargs = chat_switches(None, "none", template)
    assert kwargs == {"enable_thinking": False}
    assert render_chat_prompt(tok, USER, template_kwargs=kwargs) == \
        render_chat_prompt(tok, USER, template_kwargs={"enable_thinking": False})
    assert render_chat_prompt(tok, USER, template_kwargs=kwargs) != render_chat_prompt(tok, USER)
    with pytest.raises(APIError, match="on or off"):
        chat_switches(None, "high", template)
    with pytest.raises(APIError, match="differ"):
        chat_switches({"enable_thinking": True}, "none", template)


def test_reasoning_effort_renders_into_a_template_that_has_the_switch():
    template, tok = _template_and_tokenizer("openai-gpt-oss-120b.jinja")
    kwargs = chat_switches(None, "high", template)
    assert kwargs == {"reasoning_effort": "high"}
    assert "Reasoning: high" in render_chat_prompt(tok, USER, template_kwargs=kwargs)
    assert "Reasoning: high" not in render_chat_prompt(tok, USER, template_kwargs=chat_switches(None, None, template))
    assert chat_switches({"reasoning_effort": "low"}, "low", template) == {"reasoning_effort": "low"}
    with pytest.raises(APIError, match="differ"):
        chat_switches({"reasoning_effort": "low"}, "high", template)
    with pytest.raises(APIError, match="must be minimal, low, medium or high"):
        chat_switches(None, "extreme", template)
    with pytest.raises(APIError, match="always reasons"):      # not the template's default in its place
        chat_switches(None, "none", template)


def test_the_tables_refuse_what_they_list_and_nothing_neutral():
    for table in (CHAT, COMPLETIONS):
        for name, (neutral, _, _) in table.items():
            for value in neutral:
                check_extra_fields({name: value}, table)          # neutral: accepted
        with pytest.raises(APIError, match="only 1"):
            check_extra_fields({"repetition_penalty": True}, table)   # true is not the number 1
    with pytest.raises(APIError, match="Unrecognized"):
        check_extra_fields({"audio": None}, COMPLETIONS)              # a chat-only field


def test_responses_check_the_fields_they_do_not_declare(http):
    base = {"model": MODEL, "input": "Name one colour.", "max_output_tokens": 2}
    r = http.post("/v1/responses", json={**base, "max_output_token": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_token", r.text
    assert "Unrecognized request argument supplied" in r.json()["error"]["message"]
    for name, value in (("min_p", 0.2), ("prompt_cache_retention", "24h")):
        r = http.post("/v1/responses", json={**base, name: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    r = http.post("/v1/responses", json={**base, "min_p": 0, "prompt_cache_retention": "in_memory", "store": False})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"], r.text


def test_the_session_api_refuses_a_field_it_does_not_declare(http):
    for path, body in (("/v1/sessions", {"sytem": "Be brief."}),
                       ("/v1/sessions", {"sampling": {"temprature": 0.5}})):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("Unrecognized request argument supplied: ")
    sid = http.post("/v1/sessions", json={"system": "Be brief."}).json()["id"]
    turn = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = http.post(f"/v1/sessions/{sid}/turns", json={**turn, "max_token": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token", r.text
    # a message part keeps ignoring what it does not know: clients send back the messages they were given
    r = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "Hi", "refusal": None}],
                                                     "max_tokens": 2})
    assert r.status_code == 200, r.text
    http.delete(f"/v1/sessions/{sid}")


def test_top_logprobs_without_logprobs_is_refused(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, top_logprobs=3)
    assert err.value.body["param"] == "top_logprobs"
    reply = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, logprobs=True, top_logprobs=3)
    assert [len(t.top_logprobs) for t in reply.choices[0].logprobs.content] == [3, 3]


def test_tokenize_and_detokenize_check_their_fields(http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hi", "add_special_token": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_token", r.text
    r = http.post("/tokenize", json={"model": MODEL, "messages": USER, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
    ok = http.post("/tokenize", json={"model": MODEL, "messages": USER, "continue_final_message": False})
    assert ok.status_code == 200 and ok.json()["count"] > 0, ok.text
    r = http.post("/detokenize", json={"model": MODEL, "tokens": [1, 2], "skip_special": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special", r.text
