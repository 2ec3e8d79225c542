"""Affinity keys (``agentrt/affinity.py``): which conversation a sessionless request belongs to, in
what order the body field and the headers count, and the tenant-scoped routing hint built from it."""

from __future__ import annotations

import pydantic
import pytest
from starlette.datastructures import Headers

from agentrt.affinity import AFFINITY_HEADERS, affinity_hint, affinity_key
from agentrt.protocol import ChatCompletionRequest, CompletionRequest
from agentrt.tenants import Tenant

ALL = {"x-session-affinity": "aff", "x-claude-code-session-id": "claude", "session-id": "dash",
       "session_id": "underscore"}


def test_the_body_key_comes_first_then_the_headers_in_order():
    assert AFFINITY_HEADERS == ("x-session-affinity", "x-claude-code-session-id", "session-id", "session_id")
    assert affinity_key(ALL, "conv-1") == "conv-1"
    expected = ["aff", "claude", "dash", "underscore"]
    for i, name in enumerate(AFFINITY_HEADERS):  # drop the headers before each one: it wins next
        headers = {k: v for k, v in ALL.items() if k not in AFFINITY_HEADERS[:i]}
        assert affinity_key(headers) == expected[i], name
        assert affinity_key(headers, None) == expected[i]


def test_no_key_anywhere_is_none():
    assert affinity_key({}) is None
    assert affinity_key({"authorization": "Bearer k", "x-request-id": "r-1"}, None) is None


def test_blank_values_do_not_count_and_values_are_stripped():
    assert affinity_key({"session-id": "dash"}, "   ") == "dash"
    assert affinity_key({"x-session-affinity": " \t", "session_id": "  u  "}, "") == "u"
    assert affinity_key({}, "  conv  ") == "conv"
    assert affinity_key({"x-session-affinity": ""}, "") is None


def test_header_names_match_whatever_their_case():
    assert affinity_key({"X-Claude-Code-Session-Id": "c-1"}) == "c-1"
    assert affinity_key({"Session-ID": "d", "X-SESSION-AFFINITY": "a"}) == "a"
    # Starlette's headers as a route sees them, and raw pairs where a header comes twice (the first counts)
    starlette = Headers(raw=[(b"x-claude-code-session-id", b"c-2"), (b"session_id", b"u")])
    assert affinity_key(starlette) == "c-2"
    assert affinity_key([("Session-Id", "first"), ("session-id", "second")]) == "first"


def test_the_hint_is_scoped_by_tenant_and_hides_the_key():
    alice, bob = Tenant("alice"), Tenant("bob")
    one = affinity_hint(alice, "conv-1")
    assert one == affinity_hint(alice, "conv-1")  # the same conversation, request after request
    assert one.remember and one.last_worker is None
    assert one.session_id.startswith("aff_") and len(one.session_id) == 4 + 32
    assert "conv-1" not in one.session_id and "alice" not in one.session_id
    assert affinity_hint(bob, "conv-1").session_id != one.session_id  # two tenants never share affinity
    assert affinity_hint(alice, "conv-2").session_id != one.session_id
    # the tenant's name and the key cannot run into each other
    assert affinity_hint(Tenant("a:b"), "c").session_id != affinity_hint(Tenant("a"), "b:c").session_id
    assert affinity_hint(alice, None) is None
    assert affinity_hint(None, "conv-1").session_id != one.session_id


def test_prompt_cache_key_is_a_string_field_of_chat_and_completions():
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(model="m", messages=messages, prompt_cache_key="k").prompt_cache_key == "k"
    assert CompletionRequest(model="m", prompt="hi", prompt_cache_key="k").prompt_cache_key == "k"
    assert ChatCompletionRequest(model="m", messages=messages).prompt_cache_key is None
    for bad in (7, ["k"], {"k": 1}):
        with pytest.raises(pydantic.ValidationError) as err:
            ChatCompletionRequest(model="m", messages=messages, prompt_cache_key=bad)
        assert err.value.errors()[0]["loc"] == ("prompt_cache_key",)


class _RecordingEngine:
    """An engine client that records each request's session hint and finishes it at once."""

    max_model_len = 2048

    def __init__(self) -> None:
        self.hints: list = []

    def constraint(self, options):
        return None

    def submit(self, prompt_token_ids, params, request_id, *, constraint=None, cache_salt="", pin_ttl_s=None,
               session=None):
        self.hints.append(session)
        return _Closed()


class _Closed:
    async def placed(self):
        return None

    async def aclose(self):
        return None


def test_chat_and_completions_submit_the_tenants_hint():
    import asyncio

    from agentrt.config import ServerConfig
    from agentrt.generation import Generator
    from agentrt.metrics import Metrics
    from agentrt.service import OpenAIService
    from router.model_info import load_router_model

    model = load_router_model(None)
    engine = _RecordingEngine()
    svc = OpenAIService(Generator(engine, model, ServerConfig(), Metrics()))
    alice = Tenant("alice")
    chat = ChatCompletionRequest(model=model.model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    completion = CompletionRequest(model=model.model_id, prompt="hi", max_tokens=2)

    async def body():
        for start, req in ((svc.start_chat, chat), (svc.start_completion, completion)):
            for key in ("conv-1", None):
                generation = await start(req, alice, key)
                await generation.close()

    asyncio.run(body())
    hint = affinity_hint(alice, "conv-1")
    assert engine.hints == [hint, None, hint, None]
