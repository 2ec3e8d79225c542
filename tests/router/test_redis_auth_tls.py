"""Redis URLs with a password and with TLS (``rediss://``) work for the session store and the
KV-event publisher: a real ``redis-server`` with ``requirepass`` and a TLS port, a
self-signed CA made here with ``openssl``."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
import redis
from redis.exceptions import AuthenticationError

from agentrt.procs import Procs, free_port
from agentrt.core.store import SessionRecord
from router.config import RouterConfig
from router.core import redis_client
from router.events import KVEventPublisher, decode_event
from router.redis_store import RedisSessionStore

PASSWORD = "s3cret-pass"


def make_certs(d) -> dict[str, str]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=agentrt-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "san.ext", "-out", "server.pem")
    return {name: str(d / name) for name in ("ca.pem", "server.pem", "server.key")}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not on PATH; this test makes its own certificates with it")
    d = tmp_path_factory.mktemp("redis-tls")
    certs = make_certs(d)
    tls_port = free_port()
    procs = Procs(d)
    server = procs.redis(appendonly=False, password=PASSWORD, args=[
        "--tls-port", str(tls_port), "--tls-cert-file", certs["server.pem"], "--tls-key-file", certs["server.key"],
        "--tls-ca-cert-file", certs["ca.pem"], "--tls-auth-clients", "no"])
    yield {"plain": server.url,
           "tls": f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0?ssl_cert_reqs=required&ssl_ca_certs={certs['ca.pem']}",
           "wrong": f"redis://:wrong@127.0.0.1:{server.port}/0"}
    procs.stop()


async def roundtrip(url: str, sid: str) -> str:
    client = redis_client(url)
    try:
        store = RedisSessionStore(client, RouterConfig(redis_url=url))
        created = await store.create(SessionRecord(id=sid, model="m", tenant="acme"))
        got = await store.get(created.id)
        return got.tenant
    finally:
        await client.aclose()


@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_session_store_over_password_and_tls_urls(secured, kind):
    assert asyncio.run(roundtrip(secured[kind], "sess_" + kind)) == "acme"


@pytest.mark.parametrize("kind", ["plain", "tls"])
def test_event_publisher_over_password_and_tls_urls(secured, kind):
    config = RouterConfig(redis_url=secured[kind], deployment=f"d{kind}")
    publisher = KVEventPublisher(config, "w-" + kind)
    publisher.start()
    publisher.publish("stored", [1, 2, 3], None)
    publisher.flush()
    publisher.close()
    client = redis.Redis.from_url(secured[kind])
    entries = client.xrange(config.events_stream_key)
    client.close()
    events = [decode_event(fields[b"e"]) for _, fields in entries]
    assert [(e.kind, e.hashes) for e in events] == [("cleared", ()), ("stored", (1, 2, 3))]


def test_wrong_password_is_refused(secured):
    with pytest.raises(AuthenticationError):
        redis.Redis.from_url(secured["wrong"]).ping()
