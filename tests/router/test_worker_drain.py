"""A draining worker (SIGTERM) refuses new work on its public endpoints too, while the requests
in flight finish: 503 ``worker_draining``, OpenAI-shaped, with ``Retry-After``. One real
``agentrt worker`` over a test-owned Redis; the router side (a draining worker's 503 on
``/internal/generate`` sends the request elsewhere) is tests/reliability/test_faults.py."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from agentrt.procs import tls_context
from router.config import RouterConfig
from tests.router import cluster as c

CFG = RouterConfig()


def in_flight(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10, verify=tls_context()).text.splitlines():
        if line.startswith("agentrt_requests_in_flight "):
            return float(line.split()[1])
    raise KeyError("agentrt_requests_in_flight not in /metrics")


def test_draining_worker_refuses_public_generation_and_finishes_in_flight(redis_url, tmp_path):
    group = c.procs(tmp_path)
    worker = c.worker(group, redis_url, "w-pub-drain", "--shutdown-timeout-s", "120", "--retry-after-s", "3")
    r = redis.Redis.from_url(redis_url)
    try:
        worker.wait_ready()
        c.wait_for(lambda: r.sismember(CFG.workers_set_key, "w-pub-drain"), 30, what="the worker to register")
        http = httpx.Client(base_url=worker.url, timeout=120)
        model = http.get("/v1/models").json()["data"][0]["id"]
        session = http.post("/v1/sessions", json={"model": model}).json()["id"]
        long_prompt = "Summarise these build logs: " + " ".join(f"step {i} ok;" for i in range(120))
        body = {"model": model, "messages": [{"role": "user", "content": long_prompt}], "max_tokens": 48,
                "ignore_eos": True, "temperature": 0}

        def timed_post() -> tuple[httpx.Response, float]:
            response = http.post("/v1/chat/completions", json=body)
            return response, time.monotonic()

        with ThreadPoolExecutor(2) as pool:
            running = [pool.submit(timed_post) for _ in range(2)]
            c.wait_for(lambda: in_flight(worker.url) == 2, 30, 0.02, what="two requests in flight")
            worker.process.send_signal(signal.SIGTERM)
            # no fixed bound: beside the suite's other process a worker's event loop can take seconds to get here;
            # that it left at once is the check below (the refusals, after this, came before the replies in flight)
            c.wait_for(lambda: not r.exists(CFG.worker_key("w-pub-drain")), 60, 0.02, what="the worker to unregister")
            refused = {
                "chat": http.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                "completions": http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2}),
                "sglang generate": http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                "session turn": http.post(f"/v1/sessions/{session}/turns",
                                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                "streamed chat": http.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "stream": True}),
            }
            refused_at = time.monotonic()
            health = http.get("/health").status_code
            turns_after = http.get(f"/v1/sessions/{session}").json()["turns"]
            done = [f.result() for f in running]
        for name, response in refused.items():
            assert response.status_code == 503, (name, response.text)
            assert response.headers["retry-after"] == "3", name
            assert response.json() == {"error": {
                "message": "the worker is draining (shutting down); send this request to another worker",
                "type": "server_error", "param": None, "code": "worker_draining"}}, name
        assert health == 503
        assert turns_after == 0  # the refused turn left the session as it was
        # the requests in flight at SIGTERM ran to the end after the refusals
        assert [res.status_code for res, _ in done] == [200, 200]
        assert all(res.json()["choices"][0]["finish_reason"] == "length" for res, _ in done)
        assert all(res.json()["usage"]["completion_tokens"] == 48 for res, _ in done)
        assert min(t for _, t in done) > refused_at
        assert worker.process.wait(60) in (0, -signal.SIGTERM)
        assert not r.sismember(CFG.workers_set_key, "w-pub-drain")
    finally:
        worker.kill()
        r.close()
