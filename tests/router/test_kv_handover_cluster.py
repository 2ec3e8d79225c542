"""A draining worker hands its pinned sessions' KV over (router/kv_moves.py ``KVMoves.hand_over``), on a real
cluster (a real redis-server, three real workers, a router): a conversation pinned on one worker, that
worker drained, and the conversation's next turn runs on another worker with every earlier turn served
from its cache instead of recomputed. Both ways to drain, one after the other: ``POST /internal/drain``
(the worker answers with what it handed over and stays up, drained, until its SIGTERM, which drains
nothing twice), then a SIGTERM alone (a rollout or scale-in)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.router import cluster as c

MODEL = "SmolLM2-135M-Instruct"
P = 16
SYSTEM = "You are a build agent. You read logs, run tests and report what failed and why, briefly. " * 6
WORKERS = ("wa", "wb", "wc")
FIRST = "The checkout service's integration job failed three times tonight; here is the log. " * 8


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    group = c.procs(tmp_path_factory.mktemp("kv-handover"))
    try:
        redis_server = group.redis(appendonly=False)
        # pins outlive the test's slowest step under a loaded suite (the default 30 s did not, once)
        workers = {wid: c.worker(group, redis_server.url, wid, "--pin-ttl-s", "300") for wid in WORKERS}
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


def blocks_pulled(cl, wid: str) -> int:
    return cl["http"].get(cl[wid].url + "/internal/kv/stats").json()["pulled_blocks"]


def continue_on_the_new_holder(cl, messages: list[dict], reply: dict, prompt_tokens: int, gone: str,
                               question: str) -> tuple[httpx.Response, list[dict]]:
    """The conversation's next turn, once the routers dropped ``gone`` and indexed the handed-over blocks:
    it runs where they went, every full block of the previous prompt from the cache."""
    http, r0 = cl["http"], cl["r0"].url
    state = lambda: http.get(r0 + "/router/state").json()  # noqa: E731
    c.wait_for(lambda: gone not in [w["id"] for w in state()["workers"]], what=f"the router to drop {gone}")
    c.wait_for(lambda: max(w["indexed_blocks"] for w in state()["workers"]) >= prompt_tokens // P,
               what="the router to index the handed-over blocks")
    messages = messages + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                           {"role": "user", "content": question}]
    nxt = chat(cl, messages)
    usage = nxt.json()["usage"]
    # every full block of the previous turn's prompt came from the handed-over KV, none was recomputed
    assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // P * P, usage
    return nxt, messages


def test_a_drained_workers_pinned_session_continues_from_its_kv_elsewhere(cl):
    http = cl["http"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    first = chat(cl, messages)
    holder = first.headers["x-agentrt-worker"]
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 10 * P
    assert all(blocks_pulled(cl, w) == 0 for w in WORKERS)

    # 1. POST /internal/drain: it answers once the handover is done, and the worker stays up, drained
    drained = http.post(cl[holder].url + "/internal/drain")
    assert drained.status_code == 200, drained.text
    result = drained.json()
    assert result["worker_id"] == holder and result["requests_left"] == 0
    assert result["handover"] == {"sessions": 1, "handed_over": 1, "blocks": result["handover"]["blocks"]}
    assert result["handover"]["blocks"] >= prompt_tokens // P
    assert cl[holder].alive() and http.get(cl[holder].url + "/health").status_code == 503
    assert http.post(cl[holder].url + "/internal/drain").json() == result     # drains once
    pulled = {w: blocks_pulled(cl, w) for w in WORKERS if w != holder}
    (target,) = [w for w, n in pulled.items() if n > 0]
    assert pulled[target] == result["handover"]["blocks"]
    cl[holder].stop()                                     # the SIGTERM after it: nothing handed over twice
    assert cl[holder].log().count("drain handover: 1 of 1 pinned sessions handed over") == 1

    second, messages = continue_on_the_new_holder(cl, messages, first.json(), prompt_tokens, holder,
                                                  "Which test failed first?")
    assert second.headers["x-agentrt-worker"] == target
    # the router's dashboard shows each worker's moved KV as the worker counts it
    stats = http.get(cl[target].url + "/internal/kv/stats").json()
    board = c.wait_for(lambda: {w["id"]: w for w in http.get(cl["r0"].url + "/dashboard/status").json()["workers"]}
                       .get(target, {}).get("kv_moves"), what="the dashboard to read the target's status")
    assert board["pulled_bytes"] == stats["pulled_bytes"] > 0 and board["pulls"] == stats["pulls"]

    # 2. SIGTERM alone: the second holder drains, hands over to the last worker, and exits
    (last,) = [w for w in WORKERS if w not in (holder, target)]
    before = blocks_pulled(cl, last)
    second_prompt = second.json()["usage"]["prompt_tokens"]
    cl[target].stop()
    handed = re.search(r"drain handover: (\d+) of \1 pinned sessions handed over", cl[target].log())
    assert handed and int(handed[1]) >= 1, cl[target].log()[-2000:]
    assert blocks_pulled(cl, last) - before >= second_prompt // P
    third, _ = continue_on_the_new_holder(cl, messages, second.json(), second_prompt, target,
                                          "And which one should I look at first?")
    assert third.headers["x-agentrt-worker"] == last
