"""Process-level tests: real ``agentrt worker`` and ``agentrt router`` processes over a real Redis.

One cluster per module (two workers, two router replicas, one Redis with AOF so it can be
restarted); the tests run in file order and the destructive ones (Redis restart, SIGKILL)
come last. Each checks a promise of docs/routing.md: registration and heartbeat expiry,
KV events reaching every replica's index, a session staying on its worker through either
replica, idempotent turns across replicas, a Responses API chain as one session through both
replicas, tenant limits shared by replicas (two more routers with a tenants file, started by that
test), a worker's SGLang ``/generate`` stream, Anthropic's Messages API through a router, malformed
events counted and skipped, serving through a Redis restart, and failover after a worker is
killed mid-session.
"""

from __future__ import annotations

import time

import anthropic
import httpx
import msgpack
import openai
import pytest
import redis

from agentrt.procs import Proc, Procs
from router.config import RouterConfig
from router.redis_store import decode_record
from tests.router import cluster as c

CFG = RouterConfig()
SYSTEM = "You are a careful build engineer. Answer in one short sentence. " * 12


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    with c.redis_group(tmp_path_factory.mktemp("cluster"), appendonly=True) as (group, server):
        procs = {name: c.worker(group, server.url, name) for name in ("w0", "w1")}
        procs["w0"].wait_ready()
        procs["w1"].wait_ready()
        procs |= {name: c.router(group, server.url, name) for name in ("r0", "r1")}
        procs["r0"].wait_ready()
        procs["r1"].wait_ready()
        yield Cluster(server, procs, group)


class Cluster:
    def __init__(self, server: Proc, procs: dict[str, Proc], group: Procs) -> None:
        self.server, self.procs, self.group, self.tmp = server, procs, group, group.dir
        self.http = httpx.Client(timeout=120.0)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.server.url)

    def url(self, name: str) -> str:
        return self.procs[name].url

    def state(self, router: str) -> dict:
        return self.http.get(self.url(router) + "/router/state").json()

    def session(self, router: str = "r0") -> str:
        resp = self.http.post(self.url(router) + "/v1/sessions", json={"system": SYSTEM})
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]

    def turn(self, router: str, sid: str, text: str, **extra) -> dict:
        resp = self.http.post(self.url(router) + f"/v1/sessions/{sid}/turns",
                              json={"messages": [{"role": "user", "content": text}], **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def last_worker(self, sid: str) -> str:
        return decode_record(self.redis().get(CFG.session_key(sid)), CFG.session_max_bytes).last_worker


def test_workers_register_with_heartbeat(cl):
    r = cl.redis()
    assert {m.decode() for m in r.smembers(CFG.workers_set_key)} == {"w0", "w1"}
    for wid in ("w0", "w1"):
        record = {k.decode(): v.decode() for k, v in r.hgetall(CFG.worker_key(wid)).items()}
        assert record["url"] == cl.url(wid)
        assert record["model"] == "SmolLM2-135M-Instruct"
        assert int(record["capacity"]) >= 1 and int(record["kv_pages"]) == 8192 // 16
        assert 0 < r.pttl(CFG.heartbeat_key(wid)) <= 3000
        load = msgpack.unpackb(r.get(CFG.load_key(wid)))
        assert set(load) >= {"running", "waiting", "pages_used", "pages_free"}
    for router in ("r0", "r1"):
        assert [w["id"] for w in cl.state(router)["workers"]] == ["w0", "w1"]


def test_kv_events_reach_every_router_index(cl):
    resp = cl.http.post(cl.url("r0") + "/v1/chat/completions", json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 4,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which river is longest?"}]})
    assert resp.status_code == 200, resp.text
    snapshot = {wid: cl.redis().scard(CFG.snapshot_key(wid)) for wid in ("w0", "w1")}
    holder = max(snapshot, key=snapshot.get)
    assert snapshot[holder] >= resp.json()["usage"]["prompt_tokens"] // 16
    for router in ("r0", "r1"):  # both replicas learn it from the stream, not from routing it
        c.wait_for(lambda: {w["id"]: w["indexed_blocks"] for w in cl.state(router)["workers"]}[holder]
                   == cl.redis().scard(CFG.snapshot_key(holder)), what=f"{router}'s index of {holder}")
    # The worker serves the same snapshot over HTTP.
    over_http = cl.http.get(cl.url(holder) + "/internal/kv_snapshot").json()
    assert len(over_http["hashes"]) == cl.redis().scard(CFG.snapshot_key(holder))


def test_multi_turn_session_stays_on_one_worker(cl):
    sid = cl.session("r0")
    workers, usage = [], []
    for t in range(4):
        turn = cl.turn("r0", sid, f"Step {t}: the build failed on file {t}.py; what next?")
        workers.append(cl.last_worker(sid))
        usage.append(turn["usage"])
    assert len(set(workers)) == 1, workers
    for before, now in zip(usage, usage[1:]):  # every later turn reuses the whole previous prompt's KV
        assert now["cached_tokens"] >= before["prompt_tokens"] // 16 * 16, usage


def test_two_router_replicas_route_a_session_to_the_same_worker(cl):
    sid = cl.session("r1")
    first = cl.turn("r0", sid, "Open the log of the failing job.", turn_id="t-0")
    worker = cl.last_worker(sid)
    previous = first["usage"]
    for t in range(1, 5):
        turn = cl.turn("r0" if t % 2 == 0 else "r1", sid, f"Now check step {t}.", turn_id=f"t-{t}")
        assert cl.last_worker(sid) == worker
        assert turn["usage"]["cached_tokens"] >= previous["prompt_tokens"] // 16 * 16
        previous = turn["usage"]
    # Contract 4 across replicas: replaying turn t-0 on the other replica appends nothing.
    replay = cl.turn("r1", sid, "Open the log of the failing job.", turn_id="t-0")
    assert replay["replayed"] is True and replay["message"] == first["message"]
    session = cl.http.get(cl.url("r1") + f"/v1/sessions/{sid}").json()
    assert session["turns"] == 5 and len(session["messages"]) == 10


def test_a_turn_on_a_session_is_exclusive_across_replicas(cl):
    sid = cl.session("r0")
    r = cl.redis()
    # Another replica's turn holds the session's lock: neither replica starts a second turn.
    assert r.set(CFG.turn_lock_key(sid), "a-turn-elsewhere", nx=True, px=30_000)
    for router in ("r0", "r1"):
        resp = cl.http.post(cl.url(router) + f"/v1/sessions/{sid}/turns",
                            json={"messages": [{"role": "user", "content": "Busy?"}]})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "turn_in_progress", resp.text
    r.delete(CFG.turn_lock_key(sid))
    assert cl.turn("r1", sid, "Free now?")["index"] == 1
    assert not r.exists(CFG.turn_lock_key(sid))  # released when the turn ended


def test_any_replica_releases_a_pin_another_made(cl):
    resp = cl.http.post(cl.url("r0") + "/v1/sessions", json={"system": SYSTEM, "pin_ttl_s": 300})
    sid = resp.json()["id"]
    cl.turn("r0", sid, "Pin this prefix.")
    first = cl.http.get(cl.url("r0") + f"/v1/sessions/{sid}").json()["pin"]["id"]
    worker = cl.url(cl.last_worker(sid))

    def pinned(pin_id: str) -> bool:
        return cl.http.get(worker + f"/internal/lease/{pin_id}").json()["held"]

    c.wait_for(lambda: pinned(first), what="the first turn's pin")
    # The next turn runs through the other replica, which never saw the first pin: it releases it
    # on the session's worker by pin id.
    cl.turn("r1", sid, "Next step.")
    second = cl.http.get(cl.url("r1") + f"/v1/sessions/{sid}").json()["pin"]["id"]
    c.wait_for(lambda: not pinned(first), what="r1 to release r0's pin")
    c.wait_for(lambda: pinned(second), what="the second turn's pin")
    # Deleting the session through r0 releases r1's pin.
    record = decode_record(cl.redis().get(CFG.session_key(sid)), CFG.session_max_bytes)
    assert cl.http.delete(cl.url("r0") + f"/v1/sessions/{sid}").status_code in (200, 204)
    try:
        c.wait_for(lambda: not pinned(second), what="r0 to release r1's pin on delete")
    except AssertionError as exc:   # say what r0 had to go on
        turn = record.last_turn
        raise AssertionError(f"{exc}; the record r0 deleted: last_worker {record.last_worker!r} ({worker}), last "
                             f"turn's pin {turn.pin_id!r} (second {second!r}) expiring in "
                             f"{turn.pin_expires_at - time.time():.0f} s; r0's log:\n"
                             f"{cl.procs['r0'].log()[-3000:]}") from None


def test_a_responses_chain_is_one_session_across_replicas(cl):
    """The Responses API behind routers: a previous_response_id chain continued through either replica
    is one session in Redis, on one worker, reusing its cache; any replica reads and deletes a response."""
    clients = {name: openai.OpenAI(base_url=cl.url(name) + "/v1", api_key="unused", max_retries=0, timeout=120)
               for name in ("r0", "r1")}
    ask = dict(model="SmolLM2-135M-Instruct", instructions=SYSTEM, max_output_tokens=4, temperature=0)
    previous, ids, workers = None, [], []
    for t in range(4):
        client = clients["r0" if t % 2 == 0 else "r1"]
        r = client.responses.create(input=f"Step {t}: what next?", previous_response_id=previous and previous.id,
                                    **ask)
        sid = "sess_" + r.id[5:37]
        workers.append(cl.last_worker(sid))
        if previous is not None:
            before = previous.usage.input_tokens + previous.usage.output_tokens
            assert r.usage.input_tokens_details.cached_tokens >= 0.9 * before, (r.usage, previous.usage)
        previous = r
        ids.append(r.id)
    assert len({"sess_" + i[5:37] for i in ids}) == 1 and len(set(workers)) == 1, (ids, workers)
    record = decode_record(cl.redis().get(CFG.session_key("sess_" + ids[0][5:37])), CFG.session_max_bytes)
    assert [t.turn_id for t in record.turns] == ids and all(t.response for t in record.turns)
    streamed = list(clients["r1"].responses.create(input="Done?", previous_response_id=ids[0], stream=True, **ask))
    fork = streamed[-1].response  # a second child of the first response: a fork of the session
    assert "sess_" + fork.id[5:37] != "sess_" + ids[0][5:37]
    assert clients["r0"].responses.retrieve(fork.id).output_text == fork.output_text
    assert clients["r1"].responses.retrieve(ids[2]).to_dict() == clients["r0"].responses.retrieve(ids[2]).to_dict()
    clients["r0"].responses.delete(ids[3])
    with pytest.raises(openai.NotFoundError):
        clients["r1"].responses.retrieve(ids[3])
    for client in clients.values():
        client.close()


def test_concurrent_sessions_sharing_a_prompt_meet_on_one_worker(cl):
    """Two sessions with one new agent prompt start at once on different replicas: the second is
    routed while the first is still in flight (tentative entries in Redis), onto the same worker."""
    import threading

    # long enough (~3.3k tokens) that the cached prefix outweighs the load term of one queued request
    # while the match is only tentative (tentative_load_weight 0.5 x 4096 tokens, router/policies/agentrt.py
    # rule 4); a shorter prompt may rightly go to the idle worker (a burst spreads)
    system = "You triage flaky integration tests for a payments service. " * 280
    sids = []
    for router in ("r0", "r1"):
        resp = cl.http.post(cl.url(router) + "/v1/sessions", json={"system": system})
        sids.append(resp.json()["id"])
    before = {r: cl.state(r)["tentative"]["routes"] for r in ("r0", "r1")}
    recorded = cl.state("r0")["tentative"]["recorded"]
    results = {}

    def run(i: int, router: str) -> None:
        results[i] = cl.turn(router, sids[i], "The checkout test failed again; what first?", max_tokens=48)

    t = threading.Thread(target=run, args=(0, "r0"))
    t.start()
    c.wait_for(lambda: cl.state("r0")["tentative"]["recorded"] > recorded, interval_s=0.005,
               what="r0 to dispatch the first session's turn")
    run(1, "r1")
    t.join()
    assert cl.last_worker(sids[0]) == cl.last_worker(sids[1])
    after = {rt: cl.state(rt)["tentative"]["routes"] for rt in ("r0", "r1")}
    assert after["r1"] > before["r1"] or results[1]["usage"]["cached_tokens"] > 0, (before, after, results)


def test_status_command_reads_the_cluster(cl):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agentrt_cli", "status", "--redis", cl.server.url, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=c.ROOT)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert [w["id"] for w in status["workers"]] == ["w0", "w1"] and all(w["alive"] for w in status["workers"])
    assert status["sessions"] >= 2 and 0 < status["hit_rate"] < 1
    assert sum(w["cached_blocks"] for w in status["workers"]) > 0


def test_a_worker_streams_sglang_generate_as_server_sent_events(cl):
    """What sglang-router forwards from a worker's ``/generate``: the text so far in each event, the
    request's figures in the last one, then ``[DONE]``."""
    import json

    body = {"text": "Count: 1, 2, 3,", "sampling_params": {"max_new_tokens": 6, "temperature": 0}, "stream": True,
            "rid": "gen-sse-test"}
    with cl.http.stream("POST", cl.url("w0") + "/generate", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    events = [json.loads(line[6:]) for line in lines[:-1]]
    texts = [e["text"] for e in events]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:])) and texts[-1]
    assert all(e["meta_info"]["id"] == "gen-sse-test" for e in events)
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] in ("stop", "length") and 1 <= final["completion_tokens"] <= 6


def test_sglang_generate_honours_or_refuses_each_field(cl):
    """``/generate``'s sampling parameters agentrt implements change the reply (top_k, stop_token_ids,
    ignore_eos); the ones it does not, and SGLang's other fields, pass only at their neutral values, and an
    unknown one is refused by name."""
    url = cl.url("w0") + "/generate"

    def gen(prompt: str, **sp):
        resp = cl.http.post(url, json={"text": prompt, "sampling_params": {"temperature": 0, **sp}})
        assert resp.status_code == 200, resp.text
        return resp.json()

    for extra, param in (({"sampling_params": {"max_new_tokens": 4, "min_p": 0.1}}, "sampling_params.min_p"),
                         ({"sampling_params": {"max_new_token": 4}}, "sampling_params.max_new_token"),
                         ({"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
                         ({"return_logprob": True}, "return_logprob"), ({"lora_path": "a"}, "lora_path"),
                         ({"sampling_params": {"top_k": "a"}}, "sampling_params.top_k"),      # a wrong type:
                         ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature")):  # 400, not 500
        resp = cl.http.post(url, json={"text": "Hi", **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    neutral = cl.http.post(url, json={"text": "Count: 1, 2, 3,", "return_logprob": False, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "min_p": 0, "n": 1, "repetition_penalty": 1.0, "top_k": -1}})
    assert neutral.status_code == 200, neutral.text
    ids = gen("Count: 1, 2, 3,", max_new_tokens=6)["output_ids"]
    assert neutral.json()["output_ids"] == ids[:4]
    stopped = gen("Count: 1, 2, 3,", max_new_tokens=6, stop_token_ids=[ids[2]])
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop" and len(stopped["output_ids"]) <= 3
    assert stopped["output_ids"] == ids[:len(stopped["output_ids"])]
    yes = "<|im_start|>user\nReply with the single word: yes.<|im_end|>\n<|im_start|>assistant\nYes."
    short = gen(yes, max_new_tokens=12)
    assert short["meta_info"]["finish_reason"]["type"] == "stop" and short["meta_info"]["completion_tokens"] < 12
    assert gen(yes, max_new_tokens=12, ignore_eos=True)["meta_info"]["completion_tokens"] == 12
    story = "Once upon a time, in a"
    greedy = gen(story, max_new_tokens=8)["output_ids"]
    # temperature 2 with top_k 1 is greedy; without the top_k it samples away (seeded, so the same every run)
    assert gen(story, max_new_tokens=8, temperature=2.0, top_k=1, sampling_seed=7)["output_ids"] == greedy
    assert gen(story, max_new_tokens=8, temperature=2.0, sampling_seed=7)["output_ids"] != greedy


def test_the_anthropic_messages_api_through_a_router(cl):
    """A router serves ``/v1/messages`` with the same app: the stop string that ended a reply comes
    back from the worker (``stop_sequence``), streams parse in the official SDK, and ``count_tokens``
    is the prompt the router submits."""
    client = anthropic.Anthropic(base_url=cl.url("r0"), api_key="unused", max_retries=0, timeout=120)
    request = {"model": "SmolLM2-135M-Instruct",
               "messages": [{"role": "user", "content": "Count from 1 to 50, separated by commas."}]}
    stopped = client.messages.create(max_tokens=16, stop_sequences=["3"], extra_body={"temperature": 0}, **request)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "3"
    with client.messages.stream(max_tokens=4, extra_body={"temperature": 0}, **request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 4
    assert client.messages.count_tokens(**request).input_tokens == \
        final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_malformed_events_are_counted_and_skipped(cl):
    before = {r: cl.state(r)["events"]["malformed"] for r in ("r0", "r1")}
    r = cl.redis()
    r.xadd(CFG.events_stream_key, {"e": b"\xc1 not msgpack"})
    r.xadd(CFG.events_stream_key, {"e": msgpack.packb({"worker": "w0", "seq": "one", "kind": "stored"})})
    r.xadd(CFG.events_stream_key, {"x": b"no e field"})
    for router in ("r0", "r1"):
        c.wait_for(lambda: cl.state(router)["events"]["malformed"] == before[router] + 3,
                   what=f"{router} to count 3 malformed events")
    sid = cl.session("r0")  # and the routers still route and index
    cl.turn("r0", sid, "Still there?")
    cl.turn("r0", sid, "Good.")


def test_tenant_limits_hold_across_router_replicas(cl):
    """Two more replicas with a tenants file, on the same Redis and workers: a tenant's token budget,
    concurrent request and session spent through one replica are spent for the other."""
    import json

    from agentrt.core.tenants import hash_key

    spec = {"tenants": {
        "metered": {"key_sha256": [hash_key("key-metered")], "tokens_per_minute": 60},
        "single": {"key_sha256": [hash_key("key-single")], "max_concurrent_requests": 1, "max_sessions": 1}}}
    path = cl.tmp / "tenants.json"
    path.write_text(json.dumps(spec))
    ra = c.router(cl.group, cl.server.url, "r2", "--tenants-file", str(path))
    rb = c.router(cl.group, cl.server.url, "r3", "--tenants-file", str(path))
    metered, single = {"Authorization": "Bearer key-metered"}, {"Authorization": "Bearer key-single"}

    def chat(router: Proc, headers: dict, **extra) -> httpx.Response:
        return cl.http.post(router.url + "/v1/chat/completions", headers=headers, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 8, **extra,
            "messages": [{"role": "user", "content": "List three colours of the rainbow, one per line."}]})

    try:
        ra.wait_ready()
        rb.wait_ready()
        c.wait_for(lambda: all(len(cl.http.get(r.url + "/router/state").json()["workers"]) == 2 for r in (ra, rb)),
                   what="r2 and r3 to see both workers")
        # Tokens per minute: the first request (an empty window admits it) spends the budget for both.
        first = chat(ra, metered)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] > 30  # so used + the next reservation > 60
        second = chat(rb, metered)
        assert second.status_code == 429 and second.json()["error"]["code"] == "tenant_rate_limited", second.text
        assert "tokens per minute" in second.json()["error"]["message"]
        assert 1 <= int(second.headers["retry-after"]) <= 60

        # Concurrency 1: a stream held open through r2 takes the tenant's one slot (admitted before the
        # response headers), so r3 refuses the next request until it ends.
        with cl.http.stream("POST", ra.url + "/v1/chat/completions", headers=single, json={
                "model": "SmolLM2-135M-Instruct", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": "Count slowly."}]}) as held:
            assert held.status_code == 200
            busy = chat(rb, single)
            assert busy.status_code == 429 and "concurrent requests" in busy.json()["error"]["message"], busy.text
            assert busy.headers["retry-after"] == "1"
            assert cl.http.get(ra.url + "/router/state").json()["tenant_limits"]["leases_held"] == 1
        c.wait_for(lambda: chat(rb, single).status_code == 200, timeout_s=60, interval_s=0.5,
                   what="the slot to come back once the stream ended")

        # Sessions: the tenant's one session, created through r2, counts on r3 too.
        sid = cl.http.post(ra.url + "/v1/sessions", headers=single, json={}).json()["id"]
        again = cl.http.post(rb.url + "/v1/sessions", headers=single, json={})
        assert again.status_code == 429 and again.json()["error"]["code"] == "too_many_sessions", again.text
        assert cl.http.delete(rb.url + f"/v1/sessions/{sid}", headers=single).status_code == 200
        sid = cl.http.post(rb.url + "/v1/sessions", headers=single, json={}).json()["id"]
        assert cl.http.delete(ra.url + f"/v1/sessions/{sid}", headers=single).status_code == 200

        # Redis down: a limited tenant's request fails closed with 503 and Retry-After, the router lives on.
        cl.server.stop()
        try:
            down = chat(rb, single)
            assert down.status_code == 503 and down.json()["error"]["code"] == "store_unavailable", down.text
            assert "tenant limits" in down.json()["error"]["message"] and int(down.headers["retry-after"]) >= 1
        finally:
            cl.server.start()
        c.wait_for(lambda: chat(rb, single).status_code == 200, timeout_s=30, interval_s=0.5,
                   what="r3 to admit again after Redis came back")
    finally:
        ra.stop()
        rb.stop()


def test_routers_keep_serving_through_a_redis_restart(cl):
    sid = cl.session("r0")
    cl.turn("r0", sid, "Remember the number 7.")
    gaps_before = cl.state("r0")["events"]["gaps"]
    cl.server.stop()
    try:  # Redis is down: sessionless requests still route on the last known workers
        resp = cl.http.post(cl.url("r1") + "/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert resp.status_code == 200, resp.text
    finally:
        cl.server.start()
    # Back: the session (persisted) continues, and new KV events reach the index again.
    turn = cl.turn("r1", sid, "What was the number?")
    assert turn["index"] == 3
    c.wait_for(lambda: all(len(cl.state(r)["workers"]) == 2 for r in ("r0", "r1")), what="both workers live")
    applied = cl.state("r0")["events"]["applied"]
    # long and unlike anything before, so its prompt fills new cache blocks whatever is cached
    cl.turn("r0", cl.session("r0"), "A new session after the restart: " + " ".join(
        f"item-{i} zebra quartz {i * 7}" for i in range(12)))
    c.wait_for(lambda: cl.state("r0")["events"]["applied"] > applied, what="events after the restart")
    # Workers kept the events they made while Redis was down and wrote them once it was back: the
    # routers saw contiguous seqs (no gap, no resync from a snapshot that would miss those blocks).
    assert cl.state("r0")["events"]["gaps"] == gaps_before, cl.state("r0")["events"]
    for wid in ("w0", "w1"):
        c.wait_for(lambda: {w["id"]: w["indexed_blocks"] for w in cl.state("r0")["workers"]}[wid]
                   == cl.redis().scard(CFG.snapshot_key(wid)), what=f"r0's index of {wid} to match its snapshot")


def test_sigkill_worker_mid_session_fails_over_without_losing_turns(cl):
    sid = cl.session("r0")
    for t in range(2):
        cl.turn("r0", sid, f"Turn {t} before the crash.")
    victim = cl.last_worker(sid)
    survivor = ({"w0", "w1"} - {victim}).pop()
    cl.procs[victim].kill()
    # At once (the heartbeat has not expired yet): the router finds the connection dead and retries.
    for t in range(2, 6):
        turn = cl.turn("r0" if t % 2 == 0 else "r1", sid, f"Turn {t} after the crash.", turn_id=f"k-{t}")
        assert turn["index"] == 2 * t + 1
        assert cl.last_worker(sid) == survivor
    session = cl.http.get(cl.url("r0") + f"/v1/sessions/{sid}").json()
    assert session["turns"] == 6 and len(session["messages"]) == 12
    assert [m["content"] for m in session["messages"][0::2]] == (
        [f"Turn {t} before the crash." for t in range(2)] + [f"Turn {t} after the crash." for t in range(2, 6)])
    assert cl.state("r0")["failovers"] + cl.state("r1")["failovers"] >= 1
    # The replica that failed over deleted the victim's heartbeat; the other drops it at its next refresh
    # (every 0.5 s): it may not have run yet if that replica's turns all went to the survivor.
    assert not cl.redis().exists(CFG.heartbeat_key(victim))
    for router in ("r0", "r1"):
        c.wait_for(lambda: [w["id"] for w in cl.state(router)["workers"]] == [survivor], timeout_s=10,
                   what=f"{router} to list only the survivor {survivor}")


def test_heartbeat_expiry_and_a_returning_worker_drops_stale_entries(cl):
    alive = [w for w in ("w0", "w1") if cl.procs[w].alive()]
    dead = ({"w0", "w1"} - set(alive)).pop()
    # The dead worker's blocks are still in its Redis snapshot; when it comes back under the same id,
    # its opening `cleared` event must drop them from every index.
    cl.procs[dead] = c.worker(cl.group, cl.server.url, dead).wait_ready()
    for router in ("r0", "r1"):
        c.wait_for(lambda: {w["id"]: w["indexed_blocks"] for w in cl.state(router)["workers"]}.get(dead) == 0,
                   what=f"{router} to see {dead} back with an empty cache")
    # A worker killed with no request in flight is found dead by heartbeat expiry alone (TTL 3 s).
    cl.procs[alive[0]].kill()
    r = cl.redis()
    c.wait_for(lambda: not r.exists(CFG.heartbeat_key(alive[0])), timeout_s=6, what="heartbeat expiry")
    for router in ("r0", "r1"):
        c.wait_for(lambda: [w["id"] for w in cl.state(router)["workers"]] == [dead], what=f"{router} to drop it")
    sid = cl.session("r1")
    cl.turn("r1", sid, "Anyone home?")
    assert cl.last_worker(sid) == dead
