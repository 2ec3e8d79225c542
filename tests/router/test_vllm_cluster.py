"""A router following one agentrt worker over Redis and one over ZMQ (vLLM's KV-event format) at once.

Real processes: ``redis-server``, an ``agentrt worker`` registered in Redis, an ``agentrt worker
--kv-events zmq://...`` kept out of the router's Redis namespace (its own key prefix) and given to the
router as ``--vllm-worker`` (so the router reaches it only through its OpenAI endpoint, like a vLLM
server), and an ``agentrt router --policy round_robin`` (so two new sessions land on one worker each).
Each session's turn is routed, answered and named by ``x-agentrt-worker``; the router's index then
holds both workers' blocks, the ZMQ one exactly as that worker's own cache has them.
"""

from __future__ import annotations

import httpx
import pytest

from agentrt.procs import free_port
from tests.router import cluster as c

SYSTEM = "You are a careful build engineer. Answer in one short sentence. " * 8


@pytest.mark.timeout(400)
def test_router_follows_a_redis_worker_and_a_zmq_worker_at_once(tmp_path, redis_url):
    group = c.procs(tmp_path)
    http = httpx.Client(timeout=120.0)
    events, replay = free_port(), free_port()
    try:
        native = c.worker(group, redis_url, "native")
        zmqw = c.worker(group, redis_url, "zmqw", "--key-prefix", "zmqonly:", "--kv-events",
                        f"zmq://127.0.0.1:{events}", "--kv-events-replay", f"zmq://127.0.0.1:{replay}")
        native.wait_ready()
        zmqw.wait_ready()
        router = c.router(group, redis_url, "r0", "--policy", "round_robin", "--vllm-worker",
                          f"gpu0={zmqw.url},zmq://127.0.0.1:{events},zmq://127.0.0.1:{replay}").wait_ready()
        state = c.wait_for(lambda: (s := http.get(router.url + "/router/state").json()) and
                           len(s["workers"]) == 2 and s, what="both workers live")
        assert {w["id"] for w in state["workers"]} == {"native", "gpu0"}

        served = {}
        for i in range(2):
            sid = http.post(router.url + "/v1/sessions", json={"system": SYSTEM + f" Session {i}."}).json()["id"]
            resp = http.post(router.url + f"/v1/sessions/{sid}/turns",
                             json={"messages": [{"role": "user", "content": "Which flag builds in release mode?"}]})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["usage"]["completion_tokens"] > 0 and body["usage"]["prompt_tokens"] > 100
            served[resp.headers["x-agentrt-worker"]] = sid
        assert set(served) == {"native", "gpu0"}

        # the ZMQ worker's blocks reach the index exactly: the router's entries are its own cache
        truth = set(http.get(zmqw.url + "/internal/kv_snapshot").json()["hashes"])
        assert truth

        def synced():
            s = http.get(router.url + "/router/state").json()
            by_id = {w["id"]: w for w in s["workers"]}
            return by_id["gpu0"]["indexed_blocks"] == len(truth) and by_id["native"]["indexed_blocks"] > 0 and s

        state = c.wait_for(synced, what="both workers' blocks in the index")
        vllm = state["vllm_workers"][0]
        assert vllm["id"] == "gpu0" and vllm["live"] and vllm["served_model"]
        assert vllm["events_stats"]["malformed"] == 0 and vllm["events_stats"]["lost"] == 0
        assert vllm["mapper"]["orphans"] == 0
        assert state["events"]["applied"] > 0  # the Redis worker's events

        # a second turn of the ZMQ worker's session stays there and reuses its prefix
        sid = served["gpu0"]
        resp = http.post(router.url + f"/v1/sessions/{sid}/turns",
                         json={"messages": [{"role": "user", "content": "And in debug mode?"}]})
        assert resp.status_code == 200 and resp.headers["x-agentrt-worker"] == "gpu0", resp.text
        assert resp.json()["usage"]["cached_tokens"] > 100

        # a structured-output request never goes to the vllm-kind worker
        for _ in range(2):
            resp = http.post(router.url + "/v1/chat/completions", json={
                "model": state["model"], "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 8,
                "response_format": {"type": "json_object"}})
            assert resp.status_code == 200 and resp.headers["x-agentrt-worker"] == "native", resp.text
    finally:
        http.close()
        group.stop()
