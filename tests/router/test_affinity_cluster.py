"""Affinity without session keys, end to end: real ``agentrt worker`` and ``agentrt router``
processes over a real Redis (one cluster for the module: two workers, two router replicas).

Agent clients that resend their whole history name the conversation instead of opening a
session: OpenAI's ``prompt_cache_key``, or a header such as ``X-Claude-Code-Session-Id``. The
routers keep such a conversation on one worker (the mapping lives in Redis, so the replicas
agree; the turns alternate between them), every response names its worker in
``x-agentrt-worker``, each turn reuses the previous turn's KV, and when the worker is killed the
conversation continues on the other one without an error (the client resends the history). The
destructive test comes last.
"""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import redis

from agentrt.core.affinity import affinity_hint
from agentrt.core.tenants import DEFAULT_TENANT, Tenant
from router.config import RouterConfig
from router.redis_store import decode_record
from tests.router import cluster as c

CFG = RouterConfig()
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are the release assistant of a large monorepo: you read CI logs, name the failing step and "
          "propose the smallest fix. Answer in one short sentence. ") * 16
WORKER = "x-agentrt-worker"


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    group = c.procs(tmp_path_factory.mktemp("affinity"))
    try:
        server = group.redis(appendonly=False)
        procs = {name: c.worker(group, server.url, name) for name in ("w0", "w1")}
        for name in ("w0", "w1"):
            procs[name].wait_ready()
        procs |= {name: c.router(group, server.url, name) for name in ("r0", "r1")}
        for name in ("r0", "r1"):
            procs[name].wait_ready()
        yield Cluster(server.url, procs)
    finally:
        group.stop()


class Cluster:
    def __init__(self, redis_url: str, procs: dict) -> None:
        self.redis_url, self.procs = redis_url, procs
        self.http = httpx.Client(timeout=120.0)
        self.oai = {name: openai.OpenAI(base_url=procs[name].url + "/v1", api_key="unused", max_retries=0,
                                        timeout=120) for name in ("r0", "r1")}

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def state(self, router: str) -> dict:
        return self.http.get(self.procs[router].url + "/router/state").json()


class Conversation:
    """A client that keeps the history itself and resends it every turn, naming the conversation by
    ``prompt_cache_key`` or by headers."""

    def __init__(self, cl: Cluster, topic: str, **naming) -> None:
        self.cl, self.naming, self.topic = cl, naming, topic
        self.messages = [{"role": "system", "content": SYSTEM}]
        self.workers: list[str] = []
        self.usage: list = []

    def turn(self, router: str, stream: bool = False) -> None:
        n = len(self.workers)
        self.messages.append({"role": "user", "content": f"{self.topic}: step {n} failed on file {n}.py; why?"})
        create = self.cl.oai[router].chat.completions.with_raw_response.create
        raw = create(model=MODEL, messages=self.messages, max_tokens=8, temperature=0, stream=stream,
                     **({"stream_options": {"include_usage": True}} if stream else {}), **self.naming)
        if stream:
            chunks = list(raw.parse())
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            usage = chunks[-1].usage
        else:
            reply = raw.parse()
            text, usage = reply.choices[0].message.content, reply.usage
        self.messages.append({"role": "assistant", "content": text})
        self.workers.append(raw.headers[WORKER])
        self.usage.append(usage)

    def assert_reuses_the_previous_turn(self, turn: int) -> None:
        before, now = self.usage[turn - 1], self.usage[turn]
        assert now.prompt_tokens_details.cached_tokens >= 0.9 * (before.prompt_tokens + before.completion_tokens), \
            [(u.prompt_tokens, u.completion_tokens, u.prompt_tokens_details.cached_tokens) for u in self.usage]


def _mapping(cl: Cluster, key: str) -> tuple[str | None, int]:
    """The conversation's worker in Redis and the mapping's TTL in ms (an open server's tenant)."""
    redis_key = CFG.affinity_key(affinity_hint(Tenant(DEFAULT_TENANT), key).session_id)
    r = cl.redis()
    try:
        value = r.get(redis_key)
        return (value.decode() if value is not None else None), r.pttl(redis_key)
    finally:
        r.close()


def test_a_conversation_named_by_prompt_cache_key_stays_on_one_worker(cl):
    key = "conv-" + uuid.uuid4().hex
    conv = Conversation(cl, "The payments build", prompt_cache_key=key)
    for t in range(6):  # alternating replicas; turn 3 streamed
        conv.turn("r0" if t % 2 == 0 else "r1", stream=t == 3)
    assert len(set(conv.workers)) == 1 and conv.workers[0] in ("w0", "w1"), conv.workers
    for t in range(1, 6):
        conv.assert_reuses_the_previous_turn(t)
    worker, ttl_ms = _mapping(cl, key)
    assert worker == conv.workers[0] and CFG.affinity_ttl_s * 1000 - 60_000 < ttl_ms <= CFG.affinity_ttl_s * 1000
    hits = sum(cl.state(r)["affinity"]["hits"] for r in ("r0", "r1"))
    assert hits >= 5


def test_streams_answer_errors_before_their_first_byte_as_json_and_name_their_worker(cl):
    http = cl.http
    url = cl.procs["r0"].url + "/v1/chat/completions"
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    # The worker refuses the grammar: the router has not started the stream, so this is a JSON 400.
    bad = http.post(url, json={**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}})
    assert bad.status_code == 400 and bad.headers["content-type"].startswith("application/json"), bad.text
    assert "not" in bad.json()["error"]["message"]
    # Without any key a request routes by its prefix as before, and still names its worker.
    with http.stream("POST", url, json=body) as ok:
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/event-stream")
        assert ok.headers[WORKER] in ("w0", "w1")
        assert [line for line in ok.iter_lines() if line][-1] == "data: [DONE]"
    # A session turn names the worker its session record says it ran on.
    sid = http.post(cl.procs["r1"].url + "/v1/sessions", json={"system": SYSTEM}).json()["id"]
    turn = http.post(cl.procs["r1"].url + f"/v1/sessions/{sid}/turns",
                     json={"messages": [{"role": "user", "content": "Which step failed?"}], "max_tokens": 4})
    assert turn.status_code == 200, turn.text
    r = cl.redis()
    try:
        assert turn.headers[WORKER] == decode_record(r.get(CFG.session_key(sid)), CFG.session_max_bytes).last_worker
    finally:
        r.close()


def test_finished_requests_leave_nothing_in_flight(cl):
    """A replica counts each request it sent to a worker until the request ends (its load estimate):
    by the time a reply has reached the client, streamed or not, it is no longer counted. (A finished
    reply whose stream its consumer did not close used to stay counted until garbage collection.)"""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}
    for router in ("r0", "r1"):
        url = cl.procs[router].url
        assert cl.http.post(url + "/v1/chat/completions", json=body).status_code == 200
        with cl.http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as streamed:
            assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
        assert cl.http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}
                            ).status_code == 200
        sid = cl.http.post(url + "/v1/sessions", json={"system": "Be brief."}).json()["id"]
        turn = cl.http.post(url + f"/v1/sessions/{sid}/turns",
                            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        assert {w["id"]: w["in_flight"] for w in cl.state(router)["workers"]} == {"w0": 0, "w1": 0}


def test_a_conversation_named_by_a_header_stays_and_moves_when_its_worker_dies(cl):
    session = str(uuid.uuid4())
    conv = Conversation(cl, "The search indexer", extra_headers={"X-Claude-Code-Session-Id": session})
    for t in range(6):
        conv.turn("r1" if t % 2 == 0 else "r0", stream=t == 2)
    victim = conv.workers[0]
    assert conv.workers == [victim] * 6, conv.workers
    for t in range(1, 6):
        conv.assert_reuses_the_previous_turn(t)
    assert _mapping(cl, session)[0] == victim
    moved = sum(cl.state(r)["affinity"]["moved"] for r in ("r0", "r1"))

    survivor = ({"w0", "w1"} - {victim}).pop()
    cl.procs[victim].kill()
    for t in range(6, 9):  # at once: the router finds the connection dead and fails over, no error
        conv.turn("r0" if t % 2 == 0 else "r1")
    assert conv.workers[6:] == [survivor] * 3, conv.workers
    for t in (7, 8):
        conv.assert_reuses_the_previous_turn(t)
    assert _mapping(cl, session)[0] == survivor
    assert sum(cl.state(r)["affinity"]["moved"] for r in ("r0", "r1")) >= moved + 1
    assert sum(cl.state(r)["failovers"] for r in ("r0", "r1")) >= 1
