"""The KV lease (agentrt/core/leases.py): the TTL every case gets from the one policy, and that each lease is
released when its holder is done with it.

The policy is tested alone (``LeasePolicy``) and through the real app (``assemble_app``) over an engine
client double that records every submission's ``lease_ttl_s`` and every lease call, so each surface
(session turns, stored and unstored Responses, Anthropic ``cache_control``, affinity-keyed chat) is
checked for the TTL it asks the engine for and for the releases that follow."""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest
from agentrt_test_helpers import OneReply
from engine.types import EngineStats, RequestOutput

from agentrt.config import ServerConfig
from agentrt.core.leases import LeasePolicy, PausePlan
from agentrt.server import assemble_app

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CONFIG = dict(pin_ttl_s=30.0, pin_ttl_tool_s=90.0, max_pin_ttl_s=600.0)


def policy(**config) -> LeasePolicy:
    idle = types.SimpleNamespace(pages_total=100, pages_used=0, pages_evictable=0, waiting_tokens=0, page_size=16)
    return LeasePolicy(ServerConfig(**{**CONFIG, **config}), stats=lambda: idle)


def hint(remember: bool = True):
    from engine.client import SessionHint
    return SessionHint("aff_1", remember=remember)


# ------------------------------------------------------------ the policy alone


def test_each_acquisition_gets_its_cases_ttl():
    p = policy()
    assert p.turn_ttl(None) == 30.0 and p.turn_ttl(7.0) == 7.0   # a session's own TTL, else the server's
    assert p.affinity_ttl(None, hint()) == 30.0                  # a keyed conversation's latest turn
    assert p.affinity_ttl(300.0, hint()) is None                 # asked for its own lease: not a turn to follow
    assert p.affinity_ttl(None, hint(remember=False)) is None    # a session turn's hint: the session holds it
    assert p.affinity_ttl(None, None) is None
    assert policy(affinity_turns=False).affinity_ttl(None, hint()) is None
    assert p.cache_control_ttl([]) is None                       # no breakpoint, no lease
    assert p.cache_control_ttl([None]) == p.cache_control_ttl(["5m"]) == 30.0
    assert p.cache_control_ttl(["5m", "1h"]) == 600.0            # an hour, within max_pin_ttl_s
    assert policy(max_pin_ttl_s=7200.0).cache_control_ttl(["1h"]) == 3600.0


def test_the_pause_after_a_turn_follows_the_one_rule():
    fixed = policy(pin_ttl_policy="fixed")
    assert fixed.after_turn("s", tool_call=False, expected_pause_s=None) is None   # no pause ahead: as acquired
    assert fixed.after_turn("s", tool_call=True, expected_pause_s=None) == PausePlan(90.0)
    # a session's own pin_ttl_s is kept as asked, tool call or not
    assert fixed.after_turn("s", tool_call=True, expected_pause_s=None, own_ttl=True) is None
    cost = policy()
    assert cost.after_turn("s", tool_call=True, expected_pause_s=None) == PausePlan(90.0)  # nothing measured yet
    assert cost.after_turn("s", tool_call=False, expected_pause_s=4.0) == PausePlan(5.0)   # pinned through (+25%)
    assert cost.after_turn("s", tool_call=False, expected_pause_s=3600.0).demote          # past max_pin_ttl_s


def test_the_policy_refuses_a_session_ttl_past_the_maximum_and_a_hint_it_would_ignore():
    p = policy()
    p.check_session_ttl(None)
    p.check_session_ttl(600.0)
    with pytest.raises(ValueError, match="exceeds the server's maximum of 600"):
        p.check_session_ttl(601.0)
    p.check_pause_hint("sess_1", None, 5.0)
    p.check_pause_hint("sess_1", 10.0, None)
    with pytest.raises(ValueError, match="its own pin_ttl_s"):
        p.check_pause_hint("sess_1", 10.0, 5.0)


# ------------------------------------------------------------ every surface through the app


class _Engine:
    """An engine client that answers each request at once with the next of ``replies`` ("ok" once they
    run out; None: the request fails), recording each submission's lease TTL and every lease call."""

    max_model_len = 2048

    def __init__(self, *replies: str | None) -> None:
        self.replies = list(replies)
        self.submitted: list[tuple[str, float | None]] = []   # (request id, lease_ttl_s)
        self.calls: list[tuple] = []                          # ("extend", id, ttl), ("release", id)...

    def constraint(self, options):
        return None

    def submit(self, prompt_token_ids, params, request_id, *, constraint=None, cache_salt="", lease_ttl_s=None,
               session=None, trace=None, key=None):
        self.submitted.append((request_id, lease_ttl_s))
        reply = self.replies.pop(0) if self.replies else "ok"
        if reply is None:
            stream = OneReply(request_id)
            stream.outputs = [RequestOutput(request_id, "", [], finished=True, finish_reason="error", error="boom")]
            return stream
        return OneReply(request_id, reply)

    def extend_lease(self, lease_id, ttl_s, worker=None):
        self.calls.append(("extend", lease_id, ttl_s))

    def release_lease(self, lease_id, worker=None):
        self.calls.append(("release", lease_id))

    def demote_lease(self, lease_id, worker=None):
        self.calls.append(("demote", lease_id))

    def prefetch_lease(self, lease_id, worker=None):
        self.calls.append(("prefetch", lease_id))

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, pages_total=64, pages_used=0, pages_free=64, pages_cached=0,
                           pages_pinned=0, num_pins=0, prompt_tokens_total=0, cached_tokens_total=0,
                           generation_tokens_total=0, num_preemptions=0, page_size=16)

    async def cache_snapshot(self):
        return []

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        pass

    def ids(self) -> list[str]:
        return [rid for rid, _ in self.submitted]

    def ttls(self) -> list[float | None]:
        return [ttl for _, ttl in self.submitted]


@pytest.fixture(scope="module")
def model():
    from router.model_info import load_router_model
    return load_router_model(None)


def run(engine: _Engine, model, steps, **config) -> list[httpx.Response]:
    """Send each ``(method, path, body)`` to a fresh app over ``engine``; ``{sid}`` in a path is the latest
    created session's id, ``{rid}`` the latest response's id."""
    app = assemble_app(ServerConfig(**{**CONFIG, **config}), engine, model)

    async def send() -> list[httpx.Response]:
        out, sid, rid = [], "", ""
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for method, path, body in steps:
                if isinstance(body, dict) and body.get("previous_response_id") == "{rid}":
                    body = {**body, "previous_response_id": rid}
                out.append(await http.request(method, path.replace("{sid}", sid), json=body))
                if path == "/v1/sessions" and out[-1].status_code == 201:
                    sid = out[-1].json()["id"]
                if path == "/v1/responses" and out[-1].status_code == 200:
                    rid = out[-1].json()["id"]
        return out

    return asyncio.run(send())


TURN = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 8}


def test_session_turns_lease_for_the_session_ttl_and_each_lease_is_released_by_the_next_turn_and_delete(model):
    engine = _Engine("ok", CALL, "ok")
    responses = run(engine, model, [
        ("POST", "/v1/sessions", {"model": model.model_id, "tools": TOOLS}),
        ("POST", "/v1/sessions/{sid}/turns", TURN), ("POST", "/v1/sessions/{sid}/turns", TURN),
        ("POST", "/v1/sessions/{sid}/turns", TURN), ("DELETE", "/v1/sessions/{sid}", None)],
        pin_ttl_policy="fixed")
    assert [r.status_code for r in responses] == [201, 200, 200, 200, 200], [r.text for r in responses]
    first, second, third = engine.ids()
    assert engine.ttls() == [30.0, 30.0, 30.0]
    # the tool call's turn is held for pin_ttl_tool_s; each turn releases the last, delete the third
    assert engine.calls == [("release", first), ("extend", second, 90.0), ("release", second), ("release", third)]


def test_a_session_with_its_own_ttl_keeps_it_through_a_tool_call(model):
    engine = _Engine(CALL)
    responses = run(engine, model, [
        ("POST", "/v1/sessions", {"model": model.model_id, "tools": TOOLS, "pin_ttl_s": 200.0}),
        ("POST", "/v1/sessions/{sid}/turns", TURN), ("GET", "/v1/sessions/{sid}", None),
        ("POST", "/v1/sessions", {"model": model.model_id, "pin_ttl_s": 601.0})],
        pin_ttl_policy="fixed")
    assert [r.status_code for r in responses] == [201, 200, 200, 400]
    assert engine.ttls() == [200.0] and engine.calls == []
    pin = responses[2].json()["pin"]
    assert pin["id"] == engine.ids()[0] and pin["active"]
    assert responses[3].json()["error"]["param"] == "pin_ttl_s"


def test_a_failed_turn_releases_its_lease_and_leaves_the_last_ones(model):
    engine = _Engine("ok", None)
    responses = run(engine, model, [
        ("POST", "/v1/sessions", {"model": model.model_id}),
        ("POST", "/v1/sessions/{sid}/turns", TURN), ("POST", "/v1/sessions/{sid}/turns", TURN)])
    assert [r.status_code for r in responses] == [201, 200, 500]
    first, failed = engine.ids()
    # the failed turn released the first turn's lease when it started (it held the prefix), then its own
    assert engine.calls == [("release", first), ("release", failed)]


def test_stored_responses_are_session_turns_and_unstored_ones_lease_only_by_affinity(model):
    engine = _Engine()
    ask = {"model": model.model_id, "input": "Hello", "max_output_tokens": 4}
    responses = run(engine, model, [
        ("POST", "/v1/responses", ask), ("POST", "/v1/responses", {**ask, "previous_response_id": "{rid}"}),
        ("POST", "/v1/responses", {**ask, "store": False}),
        ("POST", "/v1/responses", {**ask, "store": False, "prompt_cache_key": "conv-1"}),
        ("POST", "/v1/responses", {**ask, "store": False, "prompt_cache_key": "conv-1"})])
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    stored, continued, unstored, keyed, keyed_again = engine.ids()
    assert engine.ttls() == [30.0, 30.0, None, 30.0, 30.0]
    # the continuation releases the response it continues; the keyed conversation's second call its first
    assert engine.calls == [("release", stored), ("release", keyed)]


def test_anthropic_cache_control_leases_for_its_ttl_and_nothing_releases_it(model):
    engine = _Engine()
    base = {"model": model.model_id, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

    def marked(ttl: str | None) -> dict:
        control = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
        return {**base, "system": [{"type": "text", "text": "You are terse.", "cache_control": control}]}

    responses = run(engine, model, [("POST", "/v1/messages", body) for body in
                                    (base, marked(None), marked("5m"), marked("1h"), marked("1h"))])
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    assert engine.ttls() == [None, 30.0, 30.0, 600.0, 600.0]
    assert engine.calls == []


def test_affinity_keyed_chat_follows_its_conversation_and_a_tool_call_holds_it(model):
    engine = _Engine(CALL, "ok")
    chat = {"model": model.model_id, "max_tokens": 8, "tools": TOOLS, "prompt_cache_key": "conv-1",
            "messages": TURN["messages"]}
    responses = run(engine, model, [("POST", "/v1/chat/completions", chat)] * 2 +
                    [("POST", "/v1/chat/completions", {**chat, "prompt_cache_key": None})], pin_ttl_policy="fixed")
    assert [r.status_code for r in responses] == [200] * 3
    first, second, unkeyed = engine.ids()
    assert engine.ttls() == [30.0, 30.0, None]
    assert engine.calls == [("extend", first, 90.0), ("release", first)]
