"""KV that moves, on a real cluster (a real redis-server, two real workers, a router): a turn sent to a
worker with a ``kv_source`` pulls the prefix's pages from the holder and replies with exactly the
holder's greedy float32 tokens, counting the pulled blocks as cached. A page changed in transit, a
holder of another model and a stream cut mid-transfer (what a killed holder looks like on the wire)
all end in the same correct reply, the blocks after the failure recomputed, and a log line. Through
the router: a turn sent away from its holder (busy) is told to pull, and does.

The failures are made by a small proxy in front of the holder that passes its stream on changed.
"""

from __future__ import annotations

import functools
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec
import pytest

from engine.loader import load_tokenizer
from engine.types import SamplingParams
from router.kv_wire import MAGIC, StreamHeader, records
from router.worker_api import sampling_to_wire
from tests.router import cluster as c

MODEL = "SmolLM2-135M-Instruct"
P = 16
PROMPT_TOKENS = 600                 # 37 full blocks before the last token: two pull chunks (32 + 5)
BLOCKS = (PROMPT_TOKENS - 1) // P
CORRUPT_AT, CUT_AT = 34, 20


@functools.cache
def tokenizer():
    return load_tokenizer(None)[0]


def ids(seed: int) -> list[int]:
    """An agent's log of ``PROMPT_TOKENS`` tokens, its own from the first block (real text: greedy replies to
    random token ids sit on near-ties that any rounding difference flips)."""
    lines = [f"Session {seed}: the build agent reads the log of job {seed * 7 + 3} and reports each step."]
    lines += [f"Step {i}: test_{(i * seed) % 37}_checkout ran in {i % 9}.{seed % 7} s and "
              f"{'passed' if (i + seed) % 4 else 'failed with a timeout'}." for i in range(60)]
    out = tokenizer().encode(" ".join(lines))
    assert len(out) >= PROMPT_TOKENS
    return out[:PROMPT_TOKENS]


class Tamper(BaseHTTPRequestHandler):
    """Forwards a KV pull to the holder and passes its stream on as the server's ``mode`` says: ``corrupt``
    (one payload byte of record ``CORRUPT_AT`` flipped), ``mismatch`` (the header names another model),
    ``cut`` (the connection closed inside record ``CUT_AT``)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        resp = httpx.post(self.server.upstream + self.path, content=body,
                          headers={"content-type": "application/json"}, timeout=60)
        data = bytearray(resp.content)
        mode, end = self.server.mode, len(data)
        pages = [off for off, kind, _, _ in records(bytes(data)) if kind == 1] if resp.status_code == 200 else []
        if mode == "corrupt":
            data[pages[CORRUPT_AT] + 1000] ^= 0x40
        elif mode == "mismatch":
            n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
            head = msgspec.json.decode(bytes(data[len(MAGIC) + 4:len(MAGIC) + 4 + n]), type=StreamHeader)
            other = msgspec.json.encode(msgspec.structs.replace(
                head, layout=msgspec.structs.replace(head.layout, model_fingerprint="feedfacefeedface")))
            data = bytearray(MAGIC + len(other).to_bytes(4, "little") + other) + data[len(MAGIC) + 4 + n:]
            end = len(data)
        elif mode == "cut":
            end = pages[CUT_AT] + 5000
        self.send_response(resp.status_code)
        self.send_header("content-type", resp.headers.get("content-type", "application/octet-stream"))
        self.send_header("content-length", str(len(data)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(bytes(data[:end]))
        self.wfile.flush()
        self.close_connection = True
        if end < len(data):
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    group = c.procs(tmp_path_factory.mktemp("kv-moves"))
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Tamper)
    proxy.mode = "pass"
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        redis_server = group.redis(appendonly=False)
        # float32 pages on any host (auto is bfloat16 where the CPU has native bf16): the byte counts and the
        # layout mismatch below are float32's
        wa = c.worker(group, redis_server.url, "wa", "--dtype", "float32")
        wb = c.worker(group, redis_server.url, "wb", "--dtype", "float32")
        wa.wait_ready()
        wb.wait_ready()
        proxy.upstream = wa.url
        # least_load: a turn goes to the idler worker whatever it holds, so a busy holder sends it away
        router = c.router(group, redis_server.url, "r0", "--policy", "least_load")
        router.wait_ready()
        yield {"wa": wa, "wb": wb, "r0": router, "proxy": proxy,
               "proxy_url": f"http://127.0.0.1:{proxy.server_address[1]}", "http": httpx.Client(timeout=120.0)}
    finally:
        proxy.shutdown()
        proxy.server_close()
        group.stop()


def generate(cl, worker: str, prompt: list[int], kv_source: str | None = None, request_id: str = "") -> dict:
    """One request straight to a worker's ``/internal/generate``: its token ids and cached tokens."""
    body = {"request_id": request_id or f"r{random.random()}", "prompt_token_ids": prompt,
            "sampling": sampling_to_wire(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))}
    if kv_source is not None:
        body["kv_source"] = {"url": kv_source}
    resp = cl["http"].post(cl[worker].url + "/internal/generate", json=body)
    assert resp.status_code == 200, resp.text
    lines = [msgspec.json.decode(line) for line in resp.text.splitlines() if line]
    assert lines[-1]["finished"] and lines[-1]["error"] is None, lines[-1]
    return {"tokens": [t for line in lines for t in line["token_ids"]], "cached": lines[-1]["cached_tokens"]}


def kv_stats(cl, worker: str) -> dict:
    return cl["http"].get(cl[worker].url + "/internal/kv/stats").json()


def moved(cl, seed: int, mode: str) -> tuple[dict, dict]:
    """The holder's reply to a prompt, then the target's, pulling through the proxy in ``mode``."""
    prompt = ids(seed)
    ref = generate(cl, "wa", prompt)
    assert ref["cached"] == 0
    cl["proxy"].mode = mode
    return ref, generate(cl, "wb", prompt, kv_source=cl["proxy_url"])


def test_a_moved_turn_gives_the_holders_tokens(cl):
    before = kv_stats(cl, "wb")
    ref, got = moved(cl, 1, "pass")
    assert got["tokens"] == ref["tokens"] and len(got["tokens"]) == 8
    assert got["cached"] == BLOCKS * P                         # every pulled block was a cache hit
    after, served = kv_stats(cl, "wb"), kv_stats(cl, "wa")
    assert after["pulled_blocks"] - before["pulled_blocks"] == BLOCKS
    assert after["pull_failures"] == before["pull_failures"]
    # float32 pages of the default model: 46,080 bytes a token, plus a record header per page
    assert after["pulled_bytes"] - before["pulled_bytes"] > BLOCKS * 46080 * P and after["bytes_per_s"] > 0
    assert served["served_blocks"] >= BLOCKS


def test_a_corrupted_page_is_recomputed_from_there(cl):
    ref, got = moved(cl, 2, "corrupt")
    assert got["tokens"] == ref["tokens"]
    assert got["cached"] == CORRUPT_AT * P                     # the pages before it were kept
    assert f"block {CORRUPT_AT}: checksum mismatch" in cl["wb"].log()


def test_a_holder_of_another_model_is_refused_and_all_is_recomputed(cl):
    ref, got = moved(cl, 3, "mismatch")
    assert got["tokens"] == ref["tokens"] and got["cached"] == 0
    assert "the holder's KV layout differs: model_fingerprint 'feedfacefeedface'" in cl["wb"].log()


def test_the_holder_refuses_a_puller_of_another_layout(cl):
    prompt = ids(4)[:64]
    generate(cl, "wa", prompt)
    layout = {"model_fingerprint": "0" * 16, "page_dtype": "bfloat16", "page_shape": [2, 30, 3, 16, 64],
              "page_size": 16, "num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "layout": "HSD"}
    resp = cl["http"].post(cl["wa"].url + "/internal/kv/blocks",
                           json={"token_ids": prompt, "start": 0, "hashes": [1], "layout": layout})
    assert resp.status_code == 409
    message = resp.json()["error"]["message"]
    assert "page_dtype 'bfloat16' vs 'float32'" in message and "model_fingerprint '0000000000000000'" in message


def test_a_stream_cut_mid_transfer_keeps_what_came_and_recomputes_the_rest(cl):
    ref, got = moved(cl, 5, "cut")
    assert got["tokens"] == ref["tokens"]
    assert got["cached"] == CUT_AT * P
    assert "KV pull from" in cl["wb"].log() and "RemoteProtocolError" in cl["wb"].log()


def test_a_holder_that_is_gone_costs_a_recompute_only(cl):
    prompt = ids(6)
    ref = generate(cl, "wa", prompt)
    got = generate(cl, "wb", prompt, kv_source="http://127.0.0.1:9")   # nothing listens there
    assert got["tokens"] == ref["tokens"] and got["cached"] == 0
    assert "ConnectError" in cl["wb"].log()


def test_the_router_tells_a_turn_sent_away_from_its_holder_to_pull(cl):
    http, r0 = cl["http"], cl["r0"].url
    state = lambda: http.get(r0 + "/router/state").json()  # noqa: E731
    prompt = ids(7)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    indexed = lambda wid: next(w for w in state()["workers"] if w["id"] == wid)["indexed_blocks"]  # noqa: E731
    before_blocks = {wid: indexed(wid) for wid in ("wa", "wb")}
    first = http.post(r0 + "/v1/completions", json=body)
    assert first.status_code == 200, first.text
    holder = first.headers["x-agentrt-worker"]
    other = "wb" if holder == "wa" else "wa"
    c.wait_for(lambda: indexed(holder) >= before_blocks[holder] + BLOCKS,
               what="the router to index the holder's blocks of this prompt")
    # the holder gets busy (a long reply of its own): least_load sends the next turn to the other worker
    long_body = {"request_id": "blocker", "prompt_token_ids": ids(8)[:64],
                 "sampling": sampling_to_wire(SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))}
    done = threading.Event()

    def block() -> None:   # reads the blocker's stream until the test is done, then leaves: the worker aborts it
        with httpx.stream("POST", cl[holder].url + "/internal/generate", json=long_body, timeout=300) as stream:
            for _ in stream.iter_lines():
                if done.is_set():
                    return

    blocker = threading.Thread(target=block, daemon=True)
    blocker.start()
    try:
        turn_goes_to_the_other_worker_and_pulls(cl, http, state, body, first, holder, other)
    finally:
        done.set()
        blocker.join(30)
    # its client gone, the blocker is aborted at once (else the holder's drain at teardown waits its full timeout)
    c.wait_for(lambda: http.get(cl[holder].url + "/internal/status").json()["load"]["in_flight"] == 0,
               what="the holder to abort the blocker its client left")


def turn_goes_to_the_other_worker_and_pulls(cl, http, state, body, first, holder, other) -> None:
    """With the holder busy, the same prompt again goes to the other worker, which pulls the holder's blocks."""
    r0 = cl["r0"].url
    # busy as the router prices it: a report taken during the first turn still says running 1, and the router
    # takes that turn off it once the turn has ended (RouterCore._queue), so wait for the blocker's own report
    busy = lambda load: load and load["running"] + load["waiting"] - load["ended_since_report"] > 0  # noqa: E731
    c.wait_for(lambda: busy(next(w for w in state()["workers"] if w["id"] == holder)["load"]),
               what="the holder to report its running request")
    before = state()["kv_moves"]
    second = http.post(r0 + "/v1/completions", json=body)
    assert second.status_code == 200, second.text
    assert second.headers["x-agentrt-worker"] == other
    a, b = first.json(), second.json()
    assert b["choices"][0]["token_ids"] == a["choices"][0]["token_ids"]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == BLOCKS * P
    after = state()["kv_moves"]
    assert after["pull"] == before["pull"] + 1 and after["pulled_tokens"] - before["pulled_tokens"] == BLOCKS * P
    assert after["est_pull_s"] > before["est_pull_s"] and after["est_recompute_s"] > before["est_recompute_s"]
    assert kv_stats(cl, other)["pulled_blocks"] >= BLOCKS
