"""Tenants against a real server: hashed keys, sessions isolated across tenants on every endpoint,
prefix caches isolated unless both tenants opted in, per-tenant session and token limits."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest
from agentrt_test_helpers import MODEL

from agentrt.core.tenants import Tenant, TenantLimits, TenantRegistry, hash_key, load_tenants

TENANTS = {  # name -> (key, settings)
    "alpha": ("key-alpha", {"share_cache": False}),
    "beta": ("key-beta", {"share_cache": False}),
    "gamma": ("key-gamma", {"share_cache": False}),
    "shared1": ("key-shared1", {"share_cache": True}),
    "shared2": ("key-shared2", {"share_cache": True}),
    "capped": ("key-capped", {"max_sessions": 2, "tokens_per_minute": 400}),
}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TENANTS[tenant][0]}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_agentrt_server):
    tmp = tmp_path_factory.mktemp("tenants")
    spec = {"tenants": {name: {"key_sha256": [hash_key(key)], **settings}
                        for name, (key, settings) in TENANTS.items()}}
    path = tmp / "tenants.json"
    path.write_text(json.dumps(spec))
    assert "key-alpha" not in path.read_text()  # only digests are stored
    running = start_agentrt_server(tmp, "--tenants-file", str(path), "--kv-cache-tokens", "8192")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def create(http, tenant: str) -> str:
    r = http.post("/v1/sessions", json={"system": "Be terse.", "sampling": {"temperature": 0, "max_tokens": 4}},
                  headers=auth(tenant))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_keys_authenticate_their_tenant(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 401
    assert http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    # The digest itself is not a key.
    bad = {"Authorization": f"Bearer {hash_key('key-alpha')}"}
    assert http.post("/v1/chat/completions", json=body, headers=bad).status_code == 401
    assert http.post("/v1/chat/completions", json=body, headers=auth("alpha")).status_code == 200


def test_every_session_endpoint_is_404_across_tenants(http):
    sid = create(http, "alpha")
    turn = http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "turn_id": "t1"}, headers=auth("alpha"))
    assert turn.status_code == 200, turn.text
    other = auth("beta")
    attempts = [
        http.get(f"/v1/sessions/{sid}", headers=other),
        http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "x"}]}, headers=other),
        http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "x"}],
                                                     "turn_id": "t1"}, headers=other),  # replay of a real turn id
        http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "x"}],
                                                     "stream": True}, headers=other),
        http.post(f"/v1/sessions/{sid}/fork", json={}, headers=other),
        http.delete(f"/v1/sessions/{sid}", headers=other),
    ]
    for r in attempts:
        assert r.status_code == 404, (r.request.method, r.request.url, r.status_code, r.text)
        assert r.json()["error"]["code"] == "session_not_found"
    # The same message as for an id that never existed: nothing reveals that the session exists.
    missing = http.get("/v1/sessions/sess_" + uuid.uuid4().hex, headers=other).json()["error"]["message"]
    assert attempts[0].json()["error"]["message"] == missing.replace(missing.split("'")[1], sid)
    assert sid not in [s["id"] for s in http.get("/v1/sessions", headers=other).json()["data"]]
    # The owner still has it, untouched: one turn, two messages.
    mine = http.get(f"/v1/sessions/{sid}", headers=auth("alpha")).json()
    assert mine["turns"] == 1 and len(mine["messages"]) == 2
    assert sid in [s["id"] for s in http.get("/v1/sessions", headers=auth("alpha")).json()["data"]]
    fork = http.post(f"/v1/sessions/{sid}/fork", json={}, headers=auth("alpha"))
    assert fork.status_code == 201 and fork.json()["turns"] == 1
    assert http.delete(f"/v1/sessions/{fork.json()['id']}", headers=auth("alpha")).status_code == 200
    assert http.delete(f"/v1/sessions/{sid}", headers=auth("alpha")).status_code == 200


def test_responses_are_404_across_tenants(server):
    """A stored response belongs to its tenant: retrieve, input_items, delete and continuing it are 404 for
    any other, exactly as for a response that never existed; the owner keeps it untouched."""
    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.url + "/v1", api_key=TENANTS[tenant][0], max_retries=0, timeout=120)

    with client("alpha") as alpha, client("beta") as beta:
        mine = alpha.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        for call in (lambda: beta.responses.retrieve(mine.id), lambda: beta.responses.input_items.list(mine.id),
                     lambda: beta.responses.delete(mine.id),
                     lambda: beta.responses.create(model=MODEL, input="x", previous_response_id=mine.id),
                     lambda: beta.responses.create(model=MODEL, input="x", previous_response_id=mine.id,
                                                   store=False)):
            with pytest.raises(openai.NotFoundError) as exc:
                call()
            assert exc.value.body["code"] == "response_not_found"
            assert mine.id in exc.value.body["message"]
        assert alpha.responses.retrieve(mine.id).to_dict() == mine.to_dict()
        child = alpha.responses.create(model=MODEL, input="x", previous_response_id=mine.id, max_output_tokens=2)
        assert child.previous_response_id == mine.id
        alpha.responses.delete(child.id)
        alpha.responses.delete(mine.id)


def cached_tokens(http, tenant: str, prompt: str) -> tuple[int, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body, headers=auth(tenant))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def long_prompt() -> str:
    words = " ".join(f"item{i} {uuid.uuid4().hex[:6]}" for i in range(40))
    return f"Summarise this inventory list please: {words}"


def test_prefix_cache_is_shared_only_between_tenants_that_opted_in(http):
    prompt = long_prompt()
    first, total = cached_tokens(http, "alpha", prompt)
    again, _ = cached_tokens(http, "alpha", prompt)
    assert total > 64 and again >= total - 16 > first  # the same tenant reuses its own cache
    # gamma has never sent anything: with its own salt, nothing of alpha's prompt is cached for it.
    assert cached_tokens(http, "gamma", prompt)[0] == 0

    shared_prompt = long_prompt()
    cached_tokens(http, "shared1", shared_prompt)
    hit, total = cached_tokens(http, "shared2", shared_prompt)
    assert hit >= total - 16  # both opted in: shared2 reuses shared1's blocks
    assert cached_tokens(http, "beta", shared_prompt)[0] == 0  # beta did not opt in: isolated from both


def test_session_limit_per_tenant(http):
    ids = [create(http, "capped"), create(http, "capped")]
    r = http.post("/v1/sessions", json={}, headers=auth("capped"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
    assert int(r.headers["retry-after"]) >= 1
    create(http, "beta")  # other tenants are not affected
    assert http.delete(f"/v1/sessions/{ids[0]}", headers=auth("capped")).status_code == 200
    ids[0] = create(http, "capped")
    for sid in ids:
        http.delete(f"/v1/sessions/{sid}", headers=auth("capped"))


def test_tokens_per_minute_per_tenant(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 8}
    statuses, last = [], None
    for _ in range(20):
        last = http.post("/v1/chat/completions", json=body, headers=auth("capped"))
        statuses.append(last.status_code)
        if last.status_code == 429:
            break
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert last.json()["error"]["code"] == "tenant_rate_limited"
    assert 1 <= int(last.headers["retry-after"]) <= 60
    used = sum(1 for s in statuses if s == 200)
    assert 2 <= used <= 400 // 20  # each request is at least 20 tokens; the window holds 400
    assert http.post("/v1/chat/completions", json=body, headers=auth("beta")).status_code == 200


# ------------------------------------------------------------ the pieces, without a server


def test_tenant_limits_concurrency_and_window():
    async def main():
        limits = TenantLimits()
        t = Tenant("t", max_concurrent_requests=2, tokens_per_minute=100)
        a, _ = await limits.admit(t, 30, now=0.0)
        b, _ = await limits.admit(t, 30, now=1.0)
        refused, wait = await limits.admit(t, 1, now=2.0)
        assert a is not None and b is not None and refused is None and wait == 1.0  # concurrency
        await limits.release(t, a, 10)  # used 10 of its 30
        c, _ = await limits.admit(t, 50, now=3.0)  # 10 + 30 + 50 = 90 <= 100
        assert c is not None
        await limits.release(t, b, 30)
        await limits.release(t, c, 50)
        refused, wait = await limits.admit(t, 20, now=4.0)  # 90 + 20 > 100: wait until a's 10 tokens leave at t=60
        assert refused is None and wait == pytest.approx(56.0)
        later, _ = await limits.admit(t, 20, now=60.5)
        assert later is not None and await limits.in_flight("t") == 1

    asyncio.run(main())


def test_registry_and_file_errors(tmp_path):
    reg = TenantRegistry.from_config(None, ("k1",))
    assert reg.authenticate("k1").name == "default" and reg.authenticate("k2") is None
    assert reg.authenticate("k1").cache_salt == ""
    assert TenantRegistry.from_config(None, ()).authenticate(None).name == "default"
    toml = tmp_path / "t.toml"
    toml.write_text(f'[tenants.acme]\nkey_sha256 = ["{hash_key("s3cret")}"]\ntokens_per_minute = 5\n')
    acme = TenantRegistry(load_tenants(toml)).authenticate("s3cret")
    assert acme.name == "acme" and acme.tokens_per_minute == 5 and acme.cache_salt == "tenant:acme"
    cases = {"{": "not valid JSON", '{"tenants": {}}': "non-empty 'tenants'",
             '{"tenants": {"a": {"key_sha256": ["xyz"]}}}': "64 lower-case hex",
             '{"tenants": {"a": {"key_sha256": []}}}': "non-empty key_sha256",
             '{"tenants": {"a": {"key_sha256": ["%s"], "max_sessions": 0}}}' % hash_key("k"): "max_sessions",
             '{"tenants": {"a": {"key_sha256": ["%s"], "bogus": 1}}}' % hash_key("k"): "unknown settings"}
    for text, message in cases.items():
        path = tmp_path / "bad.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_tenants(path)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({"tenants": {"a": {"key_sha256": [hash_key("k")]},
                                           "b": {"key_sha256": [hash_key("k")]}}}))
    with pytest.raises(ValueError, match="both"):
        TenantRegistry(load_tenants(dup))


def test_in_memory_store_checks_the_tenant_limit_when_it_creates():
    from agentrt.core.store import InMemorySessionStore, SessionRecord, TenantSessionLimitReached

    async def main():
        store = InMemorySessionStore()
        await store.create(SessionRecord(id="a1", model="m", tenant="a"), max_tenant_sessions=1)
        await store.create(SessionRecord(id="b1", model="m", tenant="b"), max_tenant_sessions=1)
        with pytest.raises(TenantSessionLimitReached, match="tenant 'a' holds its maximum of 1 sessions"):
            await store.create(SessionRecord(id="a2", model="m", tenant="a"), max_tenant_sessions=1)
        await store.create(SessionRecord(id="a3", model="m", tenant="a"))  # no limit given: none applies
        await store.delete("a1")
        await store.delete("a3")
        await store.create(SessionRecord(id="a2", model="m", tenant="a"), max_tenant_sessions=1)

    asyncio.run(main())
