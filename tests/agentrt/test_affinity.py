"""Affinity keys (``agentrt/core/affinity.py``): which conversation a sessionless request belongs to, in
what order the body field and the headers count, and the tenant-scoped routing hint built from it."""

from __future__ import annotations

import asyncio

import pydantic
import pytest
from agentrt_test_helpers import OneReply
from starlette.datastructures import Headers

from agentrt.core.affinity import AFFINITY_HEADERS, affinity_hint, affinity_key
from agentrt.protocol import ChatCompletionRequest, CompletionRequest
from agentrt.core.tenants import Tenant

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
    """An engine client that records each request's session hint, pin TTL and the pin calls made, and
    finishes each request at once with ``reply`` (empty: no output at all)."""

    max_model_len = 2048

    def __init__(self, reply: str = "") -> None:
        self.hints: list = []
        self.pin_ttls: list = []
        self.request_ids: list[str] = []
        self.unpins: list[str] = []
        self.extended: list[tuple[str, float]] = []
        self.reply = reply

    def constraint(self, options):
        return None

    def submit(self, prompt_token_ids, params, request_id, *, constraint=None, cache_salt="", lease_ttl_s=None,
               session=None, trace=None, key=None):
        self.hints.append(session)
        self.pin_ttls.append(lease_ttl_s)
        self.request_ids.append(request_id)
        return OneReply(request_id, self.reply)

    def release_lease(self, pin_id, worker=None):
        self.unpins.append(pin_id)

    def extend_lease(self, pin_id, ttl_s, worker=None):
        self.extended.append((pin_id, ttl_s))


def _openai_service(engine, **config):
    from agentrt.config import ServerConfig
    from agentrt.core.generation import Generator
    from agentrt.metrics import Metrics
    from agentrt.api.openai import OpenAIService
    from router.model_info import load_router_model

    model = load_router_model(None)
    return OpenAIService(Generator(engine, model, ServerConfig(**config), Metrics())), model.model_id


def test_chat_and_completions_submit_the_tenants_hint():
    engine = _RecordingEngine()
    svc, model_id = _openai_service(engine)
    alice = Tenant("alice")
    chat = ChatCompletionRequest(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    completion = CompletionRequest(model=model_id, prompt="hi", max_tokens=2)

    async def body():
        for start, req in ((svc.start_chat, chat), (svc.start_completion, completion)):
            for key in ("conv-1", None):
                generation = await start(req, alice, key)
                await generation.close()

    asyncio.run(body())
    hint = affinity_hint(alice, "conv-1")
    assert engine.hints == [hint, None, hint, None]


def _chat(model_id: str, text: str = "hi", tools: list | None = None) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model_id, messages=[{"role": "user", "content": text}], max_tokens=4,
                                 tools=tools)


def test_a_keyed_request_is_pinned_until_its_conversations_next_request():
    """An affinity-keyed request is submitted with the server's pin TTL (so the engine pins it and holds
    its next step for the agent, engine/coalesce.py); the same conversation's next request releases that
    pin, other conversations' and other tenants' requests do not, and an unkeyed request is not pinned."""
    engine = _RecordingEngine()
    svc, model_id = _openai_service(engine, pin_ttl_s=25.0)
    alice, bob = Tenant("alice"), Tenant("bob")

    async def body():
        for tenant, key in ((alice, "conv-1"), (alice, "conv-2"), (bob, "conv-1"), (alice, None),
                            (alice, "conv-1"), (alice, "conv-1")):
            generation = await svc.start_chat(_chat(model_id), tenant, key)
            await generation.close()

    asyncio.run(body())
    ids = engine.request_ids
    assert engine.pin_ttls == [25.0, 25.0, 25.0, None, 25.0, 25.0]
    # alice's conv-1: its third request released its second's pin, which had released its first's
    assert engine.unpins == [ids[0], ids[4]]
    assert svc.gen.leases.conversations() == 3   # alice conv-1 and conv-2, bob conv-1


def test_affinity_turns_off_pins_nothing_and_a_request_with_its_own_pin_keeps_it():
    engine = _RecordingEngine()
    svc, model_id = _openai_service(engine, affinity_turns=False)

    async def body(start):
        for _ in range(2):
            generation = await start()
            await generation.close()

    asyncio.run(body(lambda: svc.start_chat(_chat(model_id), Tenant("alice"), "conv-1")))
    assert engine.pin_ttls == [None, None] and engine.unpins == []

    # a request that asks for its own pin (an Anthropic cache_control breakpoint) is not a turn to release
    engine = _RecordingEngine()
    svc, model_id = _openai_service(engine)
    prompt = svc.gen.chat_prompt([{"role": "user", "content": "hi"}], None)
    from engine.types import SamplingParams
    hint = affinity_hint(Tenant("alice"), "conv-1")
    asyncio.run(body(lambda: svc.gen.start(prompt, SamplingParams(max_tokens=2), lease_ttl_s=300.0, session=hint)))
    assert engine.pin_ttls == [300.0, 300.0] and engine.unpins == []


def test_a_keyed_reply_that_calls_a_tool_keeps_its_pin_for_the_tool_ttl():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for key, reply, extended in (("conv-1", call, True), ("conv-1", "It is sunny.", False), (None, call, False)):
        engine = _RecordingEngine(reply)
        svc, model_id = _openai_service(engine, pin_ttl_tool_s=90.0)

        async def body():
            req = _chat(model_id, "Weather in Paris?", tools)
            return await svc.chat(req, await svc.start_chat(req, Tenant("alice"), key))

        answer = asyncio.run(body())
        assert answer["choices"][0]["finish_reason"] == ("tool_calls" if reply == call else "stop")
        assert engine.extended == ([(engine.request_ids[0], 90.0)] if extended else []), (key, reply)
