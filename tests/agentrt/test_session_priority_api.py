"""Session scheduling over HTTP: what the engine is told about each request (its session, tenant and
weight, and whether the session already ran a turn), 429 with ``Retry-After`` for a new session while
a started session's later turn goes through, the ``priority`` field (integers only, 400 otherwise), and
the session completion metric.

The app is the real one (``assemble_app``) over an engine client that records each submission and, while
``overloaded``, refuses what an overloaded engine under ``--scheduling-policy session`` refuses first: a
request that does not continue a started session (the engine's own rule is tested in
tests/engine/test_session_priority.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from agentrt_test_helpers import OneReply
from engine.types import EngineOverloaded, EngineStats

from agentrt.config import ServerConfig
from agentrt.server import assemble_app
from agentrt.core.tenants import Tenant, load_tenants


class _Engine:
    """An engine client that finishes each request at once with "ok", recording what it was given."""

    max_model_len = 2048

    def __init__(self) -> None:
        self.keys: list = []
        self.params: list = []
        self.overloaded = False
        self.pins: list = []   # (what, pin id, ttl or None): extend_pin, demote, prefetch calls in order

    def constraint(self, options):
        return None

    def submit(self, prompt_token_ids, params, request_id, *, constraint=None, cache_salt="", lease_ttl_s=None,
               session=None, trace=None, key=None):
        self.keys.append(key)
        self.params.append(params)
        if self.overloaded and not key.continuing:
            raise EngineOverloaded("3 requests are waiting (limit 2 for a new session)", retry_after_s=6.5)
        return OneReply(request_id)

    def extend_lease(self, pin_id, ttl_s, worker=None):
        self.pins.append(("extend", pin_id, ttl_s))

    def demote_lease(self, pin_id, worker=None):
        self.pins.append(("demote", pin_id, None))

    def prefetch_lease(self, pin_id, worker=None):
        self.pins.append(("prefetch", pin_id, None))

    def release_lease(self, pin_id, worker=None):
        pass

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, pages_total=64, pages_used=0, pages_free=64, pages_cached=0,
                           pages_pinned=0, num_pins=0, prompt_tokens_total=0, cached_tokens_total=0,
                           generation_tokens_total=0, num_preemptions=0, page_size=16,
                           waiting_by_priority={"normal/new": 2, "high/started": 1})

    async def cache_snapshot(self):
        return []

    async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    from router.model_info import load_router_model
    return load_router_model(None)


def call(engine: _Engine, model, requests: list[tuple[str, str, dict]], **config) -> list[httpx.Response]:
    """Send ``(method, path, body)`` in order to a fresh app over ``engine`` (``config``: ServerConfig
    fields); a path may name the id of the session the latest session creation made as ``{sid}``."""
    app = assemble_app(ServerConfig(**config), engine, model)

    async def run() -> list[httpx.Response]:
        out: list[httpx.Response] = []
        sid = None
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            for method, path, body in requests:
                path = path.replace("{sid}", sid or "")
                out.append(await http.request(method, path, json=body))
                if path == "/v1/sessions" and out[-1].status_code == 201:
                    sid = out[-1].json()["id"]
        return out

    return asyncio.run(run())


TURN = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_later_turn_goes_through_where_a_new_session_gets_429_with_retry_after(model):
    engine = _Engine()
    app = assemble_app(ServerConfig(), engine, model)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            started = (await http.post("/v1/sessions", json={"model": model.model_id})).json()["id"]
            fresh = (await http.post("/v1/sessions", json={"model": model.model_id})).json()["id"]
            first = await http.post(f"/v1/sessions/{started}/turns", json=TURN)
            engine.overloaded = True
            later = await http.post(f"/v1/sessions/{started}/turns", json=TURN)
            refused = await http.post(f"/v1/sessions/{fresh}/turns", json=TURN)
            chat = await http.post("/v1/chat/completions", json={"model": model.model_id, "max_tokens": 4,
                                                                 "messages": TURN["messages"]})
            completion = await http.post("/v1/completions", json={"model": model.model_id, "prompt": "hi",
                                                                  "max_tokens": 4})
            messages = await http.post("/v1/messages", json={"model": model.model_id, "max_tokens": 4,
                                                             "messages": TURN["messages"]})
            return started, first, later, refused, chat, completion, messages

    started, first, later, refused, chat, completion, messages = asyncio.run(run())
    assert first.status_code == 200 and later.status_code == 200, (first.text, later.text)
    first_key, later_key = engine.keys[0], engine.keys[1]
    assert (first_key.session, first_key.tenant, first_key.weight, first_key.continuing) == \
        (started, "default", 1.0, False)
    assert (later_key.session, later_key.continuing) == (started, True)
    for response in (refused, chat, completion, messages):   # each is the first turn of its session
        assert response.status_code == 429, response.text
        assert response.headers["retry-after"] == "7"   # the engine's 6.5 s, rounded up (over --retry-after-s 1)
    assert refused.json()["error"]["code"] == "server_overloaded"
    assert "limit 2 for a new session" in refused.json()["error"]["message"]
    assert messages.json()["error"]["type"] == "rate_limit_error"   # Anthropic's shape on its path


def test_a_conversation_named_by_its_affinity_key_continues_from_its_second_request(model):
    engine = _Engine()
    body = {"model": model.model_id, "max_tokens": 4, "messages": TURN["messages"], "prompt_cache_key": "conv-7"}
    responses = call(engine, model, [("POST", "/v1/chat/completions", body)] * 2)
    assert [r.status_code for r in responses] == [200, 200]
    assert [k.continuing for k in engine.keys] == [False, True]
    assert engine.keys[0].session == engine.keys[1].session != ""


@pytest.mark.parametrize("bad", [1.5, "1", True, None])
def test_priority_must_be_an_integer_on_every_surface(model, bad):
    chat = {"model": model.model_id, "max_tokens": 4, "messages": TURN["messages"], "priority": bad}
    completion = {"model": model.model_id, "prompt": "hi", "max_tokens": 4, "priority": bad}
    create = {"model": model.model_id, "sampling": {"priority": bad}}
    engine = _Engine()
    responses = call(engine, model, [("POST", "/v1/chat/completions", chat), ("POST", "/v1/completions", completion),
                                     ("POST", "/v1/sessions", create), ("POST", "/v1/sessions", {}),
                                     ("POST", "/v1/sessions/{sid}/turns", {**TURN, "priority": bad})])
    if bad is None:   # not given: the default, 0
        assert [r.status_code for r in responses] == [200, 200, 201, 201, 200]
        assert [p.priority for p in engine.params] == [0, 0, 0]
        return
    assert responses[3].status_code == 201
    for r in responses[:3] + responses[4:]:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "priority" in (error["param"] or "") and "integer" in error["message"], error
    assert engine.params == []


def test_an_integer_priority_reaches_the_engine_from_a_turn_or_the_session_defaults(model):
    engine = _Engine()
    create = {"model": model.model_id, "sampling": {"priority": 4}}
    chat = {"model": model.model_id, "max_tokens": 4, "messages": TURN["messages"], "priority": -2}
    responses = call(engine, model, [("POST", "/v1/sessions", create), ("POST", "/v1/sessions/{sid}/turns", TURN),
                                     ("POST", "/v1/sessions/{sid}/turns", {**TURN, "priority": -3}),
                                     ("POST", "/v1/chat/completions", chat),
                                     ("POST", "/v1/sessions", {**create, "sampling": {"priority": 2**31}})])
    assert [r.status_code for r in responses] == [201, 200, 200, 200, 400]
    assert [p.priority for p in engine.params] == [4, -3, -2]
    assert "priority must be an integer" in responses[-1].json()["error"]["message"]


def test_session_completion_and_queue_by_priority_are_exported(model):
    engine = _Engine()
    responses = call(engine, model, [("POST", "/v1/sessions", {"model": model.model_id}),
                                     ("POST", "/v1/sessions/{sid}/turns", TURN),
                                     ("DELETE", "/v1/sessions/{sid}", None), ("GET", "/metrics", None)])
    assert [r.status_code for r in responses] == [201, 200, 200, 200]
    text = responses[-1].text
    assert "agentrt_session_completion_seconds_count 1.0" in text
    assert 'agentrt_engine_waiting_by_priority{priority="normal",session="new"} 2.0' in text
    assert 'agentrt_engine_waiting_by_priority{priority="high",session="started"} 1.0' in text
    assert 'agentrt_engine_waiting_by_priority{priority="low",session="new"} 0.0' in text


def test_turns_within_the_latency_slo_and_goodput_are_exported(model):
    """Each ended generation counts as met or missed against slo_ttft_s / slo_tpot_s; a session that
    ends (here: deleted) counts as met when every turn was, with the share of its turns in the SLO; the
    dashboard's last minute says the same. The same traffic under an SLO nobody can meet: all missed."""
    session = [("POST", "/v1/sessions", {"model": model.model_id}), ("POST", "/v1/sessions/{sid}/turns", TURN),
               ("POST", "/v1/sessions/{sid}/turns", TURN), ("DELETE", "/v1/sessions/{sid}", None),
               ("POST", "/v1/chat/completions", {"model": model.model_id, "max_tokens": 4,
                                                 "messages": TURN["messages"]}),
               ("POST", "/v1/sessions", {"model": model.model_id}), ("GET", "/metrics", None),
               ("GET", "/dashboard/status", None)]
    for config, outcome, other in (({}, "met", "missed"), ({"slo_ttft_s": 1e-9}, "missed", "met")):
        responses = call(_Engine(), model, session, **config)
        assert [r.status_code for r in responses] == [201, 200, 200, 200, 200, 201, 200, 200]
        text = responses[-2].text
        assert f'agentrt_requests_slo_total{{outcome="{outcome}"}} 3.0' in text  # two turns and the chat call
        assert f'agentrt_requests_slo_total{{outcome="{other}"}}' not in text
        assert f'agentrt_sessions_ended_total{{slo="{outcome}"}} 1.0' in text  # the session still open: not yet
        assert "agentrt_session_turns_in_slo_ratio_count 1.0" in text
        assert f"agentrt_session_turns_in_slo_ratio_sum {1.0 if outcome == 'met' else 0.0}" in text
        slo = responses[-1].json()["slo"]
        assert (slo["ttft_s"], slo["tpot_s"]) == (config.get("slo_ttft_s", 2.0), 0.25)
        last = slo["last_minute"]
        assert (last["requests"], last["requests_in_slo"], last["sessions_ended"]) == \
            (3, 3 if outcome == "met" else 0, 1)
        assert last["sessions_in_slo"] == (1 if outcome == "met" else 0)
        assert last["goodput_sessions_per_min"] == last["sessions_in_slo"]  # per minute over the last minute
        assert last["requests_in_slo_ratio"] == (1.0 if outcome == "met" else 0.0)


@pytest.mark.slow
def test_an_announced_long_pause_demotes_the_turns_kv_and_reads_it_back_before_the_pause_ends(model):
    """``expected_pause_s`` past what max_pin_ttl_s can pin through: the turn's pin is demoted (to the KV
    tiers) when the turn is recorded and read back by the sweep once the pause is near its end (2 s
    pause, lead half of it: after 1 s), never before; a short announced pause is pinned through."""
    import time

    engine = _Engine()
    app = assemble_app(ServerConfig(max_pin_ttl_s=1.0, pin_ttl_s=1.0, pin_ttl_tool_s=1.0), engine, model)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            sid = (await http.post("/v1/sessions", json={"model": model.model_id})).json()["id"]
            bad = await http.post(f"/v1/sessions/{sid}/turns", json={**TURN, "expected_pause_s": -1})
            assert bad.status_code == 400 and "expected_pause_s" in bad.text
            pinned = (await http.post("/v1/sessions", json={"model": model.model_id, "pin_ttl_s": 1.0})).json()["id"]
            both = await http.post(f"/v1/sessions/{pinned}/turns", json={**TURN, "expected_pause_s": 2.0})
            assert both.status_code == 400 and "its own pin_ttl_s" in both.json()["error"]["message"]
            assert engine.pins == []   # refused before anything ran
            await http.post(f"/v1/sessions/{sid}/turns", json={**TURN, "expected_pause_s": 2.0})
            (what, pin, _), = engine.pins
            assert what == "demote"
            ended = time.time()
            await app.state.services.sessions.sweep()
            assert len(engine.pins) == 1   # not due yet
            await asyncio.sleep(max(0.0, ended + 1.05 - time.time()))
            await app.state.services.sessions.sweep()
            assert engine.pins[1:] == [("prefetch", pin, None)]
            await app.state.services.sessions.sweep()
            assert len(engine.pins) == 2   # read back once
            await http.post(f"/v1/sessions/{sid}/turns", json={**TURN, "expected_pause_s": 0.5})
            assert engine.pins[2][0] == "extend" and engine.pins[2][2] == 1.0   # 0.5 s (+25%), at least 1 s
            return (await http.get("/metrics")).text

    text = asyncio.run(run())
    assert "agentrt_session_kv_demotions_total 1.0" in text and "agentrt_session_kv_prefetches_total 1.0" in text


def test_a_tenants_weight_is_read_from_the_tenants_file_and_sent_with_its_requests(tmp_path, model):
    from agentrt.core.generation import Generator
    from agentrt.metrics import Metrics

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"big": {"key_sha256": ["a" * 64], "weight": 3},
                                            "small": {"key_sha256": ["b" * 64]}}}))
    tenants = {t.name: t for t in load_tenants(path)}
    assert (tenants["big"].weight, tenants["small"].weight) == (3, 1.0)
    gen = Generator(_Engine(), model, ServerConfig(), Metrics())
    assert gen.scheduling_key(None, tenants["big"]).weight == 3
    assert gen.scheduling_key(None, None).tenant == ""
    for bad in (0, -1, "2", True):
        with pytest.raises(ValueError, match="weight must be a number > 0"):
            Tenant("t", weight=bad)


def test_the_concurrency_limit_keeps_its_reserve_for_started_sessions(model):
    """``--concurrency-reserve 0.5`` of 4: a request that starts no session gets 429 at 2 in flight, a later
    turn of a started session only at 4; with no reserve (the default) every request gets 4."""
    from engine.client import SessionHint
    from engine.types import SamplingParams

    from agentrt.core.errors import APIError
    from agentrt.core.generation import Generator
    from agentrt.metrics import Metrics

    later = SessionHint("sess-1", continuing=True)

    async def admitted(reserve: float, sessions: list) -> list[int | str]:
        gen = Generator(_Engine(), model, ServerConfig(max_concurrent_requests=4, concurrency_reserve=reserve),
                        Metrics())
        out = []
        for session in sessions:
            try:
                await gen.start([1, 2, 3], SamplingParams(max_tokens=2), session=session)   # held in flight
                out.append(gen.in_flight)
            except APIError as exc:
                assert exc.status == 429 and exc.headers["Retry-After"] == "1"
                out.append(exc.message)
        return out

    got = asyncio.run(admitted(0.5, [None, None, None, later, later, later]))
    assert got[:2] == [1, 2] and got[3:5] == [3, 4]
    assert got[2] == ("the server is at its limit of 2 concurrent requests for a new session (50% of them are "
                      "kept for later turns of started sessions); retry later")
    assert got[5] == "the server is at its limit of 4 concurrent requests; retry later"
    assert asyncio.run(admitted(0.0, [None] * 5)) == [1, 2, 3, 4, "the server is at its limit of 4 concurrent "
                                                                      "requests; retry later"]
    with pytest.raises(ValueError):
        ServerConfig(concurrency_reserve=1.0)
