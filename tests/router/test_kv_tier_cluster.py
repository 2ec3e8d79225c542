"""Through a router with two real workers: a prompt whose KV sits only in one worker's disk tier (its
device pool, sized for one prompt, evicted it) is still routed to that worker, which loads it back.
The router's ``/router/state`` shows the blocks by medium."""

from __future__ import annotations

import httpx
import pytest

from tests.router import cluster as c

MODEL = "SmolLM2-135M-Instruct"
FIRST = "List the three slowest tests of the checkout service and the file each one lives in. " * 2
OTHER = "Summarise the flaky network errors seen by the payments integration job this week. " * 2


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiers")
    with c.redis_group(tmp) as (group, redis_server):
        # wa's pool holds one of these prompts at a time (5 usable pages); wb has the usual pool
        wa = c.worker(group, redis_server.url, "wa", "--kv-cache-tokens", "96", "--kv-disk-tokens", "4096",
                      "--kv-disk-path", str(tmp / "wa-tier"))
        wb = c.worker(group, redis_server.url, "wb")
        wa.wait_ready()
        wb.wait_ready()
        # Load weighs nothing here: this test is about the tier blocks' cost and index, and a worker's load
        # report is ~0.5 s behind its queue (a CI run once saw wa report a waiting request at the decision
        # and route to the idle wb: the router now takes the turns it saw end off such a report,
        # tests/router/test_stale_load.py; tests/router/test_policies.py tests the load terms).
        router = c.router(group, redis_server.url, "r0", "--policy-option", "load_weight=0",
                          "--policy-option", "tentative_load_weight=0")
        router.wait_ready()
        yield {"wa": wa, "wb": wb, "r0": router}


def chat(http: httpx.Client, url: str, text: str) -> httpx.Response:
    resp = http.post(url + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": text}]})
    assert resp.status_code == 200, resp.text
    return resp


def test_a_prompt_held_only_in_a_disk_tier_is_routed_to_its_worker(cl):
    http = httpx.Client(timeout=120.0)
    state = lambda: http.get(cl["r0"].url + "/router/state").json()  # noqa: E731
    media = lambda wid: next(w for w in state()["workers"] if w["id"] == wid)["indexed_blocks_by_medium"]  # noqa: E731

    first = chat(http, cl["wa"].url, FIRST).json()          # straight to wa: its device holds the prompt
    blocks = first["usage"]["prompt_tokens"] // 16
    assert blocks >= 3
    chat(http, cl["wa"].url, OTHER)                           # wa's pool needs the room: FIRST goes to disk
    # (both prompts start with the chat template's first page, which stays on the device)
    c.wait_for(lambda: media("wa")["disk"] >= blocks - 1, what="the router to index wa's disk tier")
    seen = media("wa")
    print("router state of wa:", seen)                        # e.g. {'device': 5, 'host': 0, 'disk': 3}
    assert media("wb") == {"device": 0, "host": 0, "disk": 0}

    def ready() -> bool:
        """Both workers live, idle (a short prompt rightly goes to an idle worker: compare workers at equal
        load), and the router's index holding wa's copy of FIRST. A worker whose heartbeat lapsed (a
        starved CI machine; the cluster's TTL is 3 s) is absent from the state until it beats again, and
        its index entries come back from its snapshot: "all idle" over the rest alone would pass."""
        workers = {w["id"]: w for w in state()["workers"]}
        return workers.keys() == {"wa", "wb"} and all(
            w["in_flight"] == 0 and w["load"] and w["load"]["running"] + w["load"]["waiting"] == 0
            for w in workers.values()) and sum(workers["wa"]["indexed_blocks_by_medium"].values()) >= blocks

    before = state()["decisions"].get("prefix", 0)
    for _ in range(2):   # without the tier's blocks both would be fallbacks, and those alternate workers
        c.wait_for(ready, what="both workers live and idle, wa's blocks indexed")
        decided = state()["decisions"]
        resp = chat(http, cl["r0"].url, FIRST)
        assert resp.headers["x-agentrt-worker"] == "wa", (
            f"decisions before {decided}, after {state()['decisions']}; router state {state()['workers']}; "
            f"r0 log: {cl['r0'].log()[-3000:]}")
        usage = resp.json()["usage"]
        # every full block but the last token's (computed for its logits) came from the cache
        assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16, usage
    assert state()["decisions"].get("prefix", 0) >= before + 1
    # every turn done, wa's queue is empty again (a request left in it would be a leak)
    def wa_empty() -> bool:   # (wa may be briefly absent from the state: a lapsed heartbeat, as above)
        load = {w["id"]: w["load"] for w in state()["workers"]}.get("wa")
        return load is not None and load["running"] + load["waiting"] == 0
    c.wait_for(wa_empty, 30, what="wa to report an empty queue after its turns")
    tiers = http.get(cl["wa"].url + "/get_load").json()[0]["kv_tiers"]
    assert tiers["disk"]["hit_tokens"] >= (blocks - 1) * 16 and tiers["disk"]["corrupt"] == 0, tiers
