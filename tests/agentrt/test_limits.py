"""A second server with API keys and tight limits: 401, 413, 429, disconnects, pin expiry, shutdown."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from agentrt_test_helpers import MODEL, metric, wait_for

import agentrt

KEY = "test-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict(tmp_path_factory, start_agentrt_server):
    server = start_agentrt_server(tmp_path_factory.mktemp("strict"), "--api-key", KEY, "--api-key", "test-key-2",
                          "--max-body-bytes", "8192", "--max-concurrent-requests", "1",
                          "--sweep-interval-s", "0.2", "--shutdown-timeout-s", "20")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(strict):
    with agentrt.Client(strict.url, api_key=KEY, timeout=120) as c:
        yield c


def pins(strict) -> float:
    return metric(strict.url, "agentrt_kv_pins")


def test_api_keys(strict):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.post(strict.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    ok = httpx.post(strict.url + "/v1/chat/completions", json=body,
                    headers={"Authorization": "Bearer test-key-2"}, timeout=60)
    assert ok.status_code == 200
    assert httpx.get(strict.url + "/health").status_code == 200  # probes need no key
    with pytest.raises(agentrt.AuthenticationError):
        agentrt.Client(strict.url).sessions.create()


def test_body_over_limit_is_413(strict):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000}]}
    response = httpx.post(strict.url + "/v1/chat/completions", json=big, headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    chunked = httpx.post(strict.url + "/v1/chat/completions", headers={**AUTH, "content-type": "application/json"},
                         content=iter([json.dumps(big).encode()[i:i + 1000] for i in range(0, 11_000, 1000)]))
    assert chunked.status_code == 413


def test_admission_limit_is_429_and_disconnect_frees_the_request(strict):
    long_body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=strict.url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()  # keep it: a dropped iterator closes the connection
            next(lines)
            second = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert second.status_code == 429
            assert int(second.headers["retry-after"]) >= 1
            assert second.json()["error"]["type"] == "rate_limit_error"
    # the client hung up mid-stream: the engine request is aborted and the slot is free again
    assert wait_for(lambda: metric(strict.url, "agentrt_engine_running") == 0
                    and metric(strict.url, "agentrt_requests_in_flight") == 0)
    after = httpx.post(strict.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert after.status_code == 200


def test_pin_lasts_its_ttl_then_expires(strict, client):
    assert wait_for(lambda: pins(strict) == 0)
    session = client.sessions.create(pin_ttl_s=4, sampling={"temperature": 0, "max_tokens": 4})
    session.send("Hello.")
    info = session.refresh()
    assert info.pin is not None and info.pin["active"]
    assert pins(strict) == 1
    assert wait_for(lambda: pins(strict) == 0, timeout_s=60)
    assert not session.refresh().pin["active"]
    session.close()


def test_next_turn_replaces_the_pin_and_delete_releases_it(strict, client):
    assert wait_for(lambda: pins(strict) == 0)
    session = client.sessions.create(pin_ttl_s=300, sampling={"temperature": 0, "max_tokens": 4})
    session.send("Hello.")
    session.send("Hello again.")
    assert pins(strict) == 1
    fork = session.fork()
    fork.send("A third hello.")
    assert wait_for(lambda: pins(strict) == 2)
    session.close()
    fork.close()
    assert wait_for(lambda: pins(strict) == 0)


def test_idle_session_expires(strict, client):
    session = client.sessions.create(idle_ttl_s=0.5)

    def gone() -> bool:
        try:
            session.refresh()
            return False
        except agentrt.NotFoundError:
            return True

    assert wait_for(gone, timeout_s=30)
    assert all(s.id != session.id for s in client.sessions.list())


def test_graceful_shutdown_finishes_the_stream_in_flight(strict):
    """Runs last in this module: SIGTERM while a stream is running; the stream ends cleanly."""
    lines: list[str] = []
    started = threading.Event()

    def consume() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", strict.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(120)
    # uvicorn re-raises SIGTERM after its graceful shutdown, so a clean exit reads as -SIGTERM
    assert strict.stop(timeout_s=60) in (0, -signal.SIGTERM)
    reader.join(60)
    assert [x for x in lines if x][-1] == "data: [DONE]"
    finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines if x.startswith("data: {")]
    assert finish[-1] in ("stop", "length")
