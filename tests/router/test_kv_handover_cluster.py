"""A draining worker hands its pinned sessions' KV over (router/kv_moves.py ``KVMoves.hand_over``), on a real
cluster (a real redis-server, two real workers, a router): a conversation pinned on one worker, that worker
stopped (SIGTERM), and the conversation's next turn runs on the other worker with the whole first turn
served from its cache instead of recomputed."""

from __future__ import annotations

import httpx
import pytest

from tests.router import cluster as c

MODEL = "SmolLM2-135M-Instruct"
P = 16
SYSTEM = "You are a build agent. You read logs, run tests and report what failed and why, briefly. " * 6
FIRST = "The checkout service's integration job failed three times tonight; here is the log. " * 8


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    group = c.procs(tmp_path_factory.mktemp("kv-handover"))
    try:
        redis_server = group.redis(appendonly=False)
        workers = {wid: c.worker(group, redis_server.url, wid) for wid in ("wa", "wb")}
        for w in workers.values():
            w.wait_ready()
        router = c.router(group, redis_server.url, "r0")
        router.wait_ready()
        yield {**workers, "r0": router, "http": httpx.Client(timeout=120.0)}
    finally:
        group.stop()


def chat(cl, messages: list[dict]) -> httpx.Response:
    resp = cl["http"].post(cl["r0"].url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "prompt_cache_key": "agent-1"})
    assert resp.status_code == 200, resp.text
    return resp


def test_a_drained_workers_pinned_session_continues_from_its_kv_elsewhere(cl):
    http, r0 = cl["http"], cl["r0"].url
    state = lambda: http.get(r0 + "/router/state").json()  # noqa: E731
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    first = chat(cl, messages)
    holder = first.headers["x-agentrt-worker"]
    other = "wb" if holder == "wa" else "wa"
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 10 * P
    before = http.get(cl[other].url + "/internal/kv/stats").json()
    assert before["pulled_blocks"] == 0

    cl[holder].stop()                                     # SIGTERM: drain, hand over, exit
    assert "drain handover: 1 of 1 pinned sessions handed over" in cl[holder].log()
    after = http.get(cl[other].url + "/internal/kv/stats").json()
    assert after["pulled_blocks"] >= prompt_tokens // P
    c.wait_for(lambda: [w["id"] for w in state()["workers"]] == [other], what="the router to drop the holder")
    c.wait_for(lambda: state()["workers"][0]["indexed_blocks"] >= prompt_tokens // P,
               what="the router to index the handed-over blocks")

    reply = first.json()["choices"][0]["message"]["content"]
    second = chat(cl, messages + [{"role": "assistant", "content": reply},
                                  {"role": "user", "content": "Which test failed first?"}])
    assert second.headers["x-agentrt-worker"] == other
    usage = second.json()["usage"]
    # every full block of the first turn's prompt came from the handed-over KV, none was recomputed
    assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // P * P, usage
