"""Hypothesis fuzz of the two decoders that read bytes from Redis: KV events (contract 2) and
session records (contract 3). Whatever the bytes, only the decoder's own error escapes, and
the consumers count what they reject."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import asdict
from types import SimpleNamespace

import msgpack
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.config import ServerConfig
from agentrt.core.errors import APIError
from agentrt.core.turns import SessionManager
from agentrt.core.store import SessionDecodeError, SessionRecord, TurnRecord
from agentrt.core.tenants import Tenant
from router.config import RouterConfig
from router.event_consumer import KVEventConsumer
from router.events import EventDecodeError, KVEvent, decode_event, encode_event
from router.index import PrefixIndex
from router.redis_store import RedisSessionStore, decode_record, encode_record

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_BYTES = 1 << 16

# Any msgpack-representable value, nested (ext types excluded: msgpack cannot pack them from Python).
scalars = st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=True) \
    | st.text(max_size=20) | st.binary(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=8) | st.integers(-9, 9), inner, max_size=5), max_leaves=30)


def packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def good_event() -> dict:
    return {"worker": "w1", "seq": 3, "kind": "stored", "hashes": [1, 2, (1 << 64) - 1], "parent": 7, "ts": 1}


def good_record() -> dict:
    turn = TurnRecord(turn_id="t1", index=1, message={"role": "assistant", "content": "hi"}, finish_reason="stop",
                      prompt_tokens=5, completion_tokens=1, cached_tokens=0, created_at=1.0, pin_id="req-1",
                      pin_expires_at=2.0, raw_text="hi")
    record = SessionRecord(id="sess_1", model="m", system="s", tools=[{"type": "function"}],
                           sampling={"temperature": 0}, metadata={"k": "v"},
                           messages=[{"role": "user", "content": "q"}, turn.message], turns=[turn])
    return msgpack.unpackb(encode_record(record), raw=False)


def decode_session(data: bytes) -> SessionRecord:
    return decode_record(data, MAX_BYTES)


# ------------------------------------------------------------ KV events


@FUZZ
@given(st.binary(max_size=512))
def test_event_decoder_on_arbitrary_bytes(data):
    try:
        event = decode_event(data)
    except EventDecodeError:
        return
    assert isinstance(event, KVEvent) and encode_event(event)  # anything accepted is a valid event


@pytest.mark.slow
@FUZZ
@given(values)
def test_event_decoder_on_arbitrary_msgpack(value):
    try:
        decode_event(packed(value))
    except EventDecodeError:
        pass


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(sorted(good_event())), values)
def test_event_decoder_on_one_bad_field(name, value):
    obj = {**good_event(), name: value}
    try:
        event = decode_event(packed(obj))
    except EventDecodeError:
        return
    assert getattr(event, name) == (tuple(value) if name == "hashes" else value)


def test_event_decoder_limits():
    assert decode_event(packed(good_event())) == KVEvent("w1", 3, "stored", (1, 2, (1 << 64) - 1), 7, 1)
    with pytest.raises(EventDecodeError, match="exceeds"):
        decode_event(packed({**good_event(), "hashes": list(range(1000))}), max_bytes=100)
    with pytest.raises(EventDecodeError, match="not a msgpack event"):
        decode_event(packed({**good_event(), "hashes": list(range(100))}), max_hashes=10)
    with pytest.raises(EventDecodeError):
        decode_event(msgpack.packb(msgpack.ExtType(1, b"x")))
    with pytest.raises(EventDecodeError):
        decode_event(b"\x80\x04\x95" + b"pickle")  # a pickle header is just bad msgpack here


def test_consumer_counts_undecodable_events():
    consumer = KVEventConsumer(None, RouterConfig(), PrefixIndex())  # _handle never reaches Redis for bad events
    bad = [None, b"", b"\xc1", packed([1, 2]), packed({**good_event(), "kind": "bogus"}),
           packed({**good_event(), "hashes": [-1]})]

    async def run():
        for payload in bad:
            await consumer._handle(payload)

    asyncio.run(run())
    assert consumer.stats.malformed == len(bad)


# ------------------------------------------------------------ session records


@FUZZ
@given(st.binary(max_size=512))
def test_session_decoder_on_arbitrary_bytes(data):
    try:
        decode_session(data)
    except SessionDecodeError:
        pass


@pytest.mark.slow
@FUZZ
@given(values)
def test_session_decoder_on_arbitrary_msgpack(value):
    try:
        decode_session(packed(value))
    except SessionDecodeError:
        pass


@pytest.mark.slow
@FUZZ
@given(st.data())
def test_session_decoder_on_one_bad_field(data):
    obj = good_record()
    path = data.draw(st.sampled_from(
        [(k,) for k in obj] + [("sampling", "temperature"), ("metadata", "k"), ("tools", 0)]
        + [("turns", 0, k) for k in obj["turns"][0]] + [("messages", 0), ("turns", 0)]))
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(values)
    try:
        record = decode_session(packed(obj))
    except SessionDecodeError:
        return
    assert record.id and isinstance(record.messages, list) and all(isinstance(m, dict) for m in record.messages)
    assert all(isinstance(t.index, int) and isinstance(t.turn_id, str) for t in record.turns)


def test_session_record_round_trip_and_limits():
    good = good_record()
    record = decode_session(packed(good))
    assert record.id == "sess_1" and record.turns[0].turn_id == "t1" and record.tenant == "default"
    assert asdict(record.turns[0])["raw_text"] == "hi" and record.turns[0].response is None
    # A version-2 record (before turns carried a response) still reads, without responses.
    old = copy.deepcopy(good)
    old["v"] = 2
    for turn in old["turns"]:
        del turn["response"]
    assert decode_session(packed(old)) == record
    with pytest.raises(SessionDecodeError):
        decode_session(packed({**good_record(), "v": 1}))
    with pytest.raises(SessionDecodeError, match="exceeds"):
        decode_record(packed(good_record()), 10)
    with pytest.raises(SessionDecodeError):
        decode_session(packed({**good_record(), "id": ""}))
    with pytest.raises(SessionDecodeError):
        decode_session(packed({**good_record(), "messages": [b"raw bytes"]}))


def test_corrupt_records_are_counted_not_served(redis_url):
    async def body():
        client = aioredis.Redis.from_url(redis_url)
        config = RouterConfig(redis_url=redis_url)
        store = RedisSessionStore(client, config)
        good = await store.create(SessionRecord(id="sess_ok", model="m"))
        for sid, raw in (("sess_bad1", b"\xc1garbage"), ("sess_bad2", packed({**good_record(), "turns": [1]}))):
            await client.set(config.session_key(sid), raw)
            await client.zadd(config.sessions_set_key, {sid: 1})
        listed = [r.id for r in await store.list()]
        assert listed == [good.id] and store.bad_records == 2
        with pytest.raises(SessionDecodeError, match="sess_bad1"):
            await store.get("sess_bad1")
        assert store.bad_records == 3
        # get needs nothing of a generator but the lease book the manager keeps a reference to
        manager = SessionManager(store, SimpleNamespace(leases=None), ServerConfig())
        with pytest.raises(APIError) as err:
            await manager.get("sess_bad1", Tenant("default"))
        assert err.value.status == 500 and err.value.code == "session_record_corrupt"
        assert "sess_bad1" in err.value.message and store.bad_records == 4
        await client.aclose()

    asyncio.run(body())


@pytest.mark.parametrize("change, why", [
    (lambda r: r.update(idle_ttl_s=True), r"got `bool` - at `\$.idle_ttl_s`"),
    (lambda r: r["turns"][0].update(index=1.0), r"Expected `int`, got `float` - at `\$.turns\[0\].index`"),
    (lambda r: r.update(extra=1), r"unknown field `extra`"),
    (lambda r: r["turns"][0].update(extra=1), r"unknown field `extra` - at `\$.turns\[0\]`"),
    (lambda r: r.pop("tenant"), r"missing required field `tenant`"),
    (lambda r: r["turns"][0].pop("response"), r"missing required field `response` - at `\$.turns\[0\]`"),
    (lambda r: r.update(v=4), r"Invalid value 4 - at `\$.v`"),
    (lambda r: r.pop("v"), r"missing required field `v`"),
    (lambda r: r.update(id="x" * 257), r"length <= 256 - at `\$.id`"),
    (lambda r: r["turns"][0].update(cached_tokens_by_tier={"host": "3"}), r"cached_tokens_by_tier"),
    (lambda r: r.update(tools=[["not a map"]]), r"Expected `object`, got `array` - at `\$.tools\[0\]`"),
])
def test_session_decoder_names_what_is_wrong(change, why):
    """Strict where a looser decoder would guess: a bool is no number, a float no int; no extra or missing
    field (only a version-2 turn may lack ``response``); the error says where and what was expected."""
    record = good_record()
    change(record)
    with pytest.raises(SessionDecodeError, match=why):
        decode_session(packed(record))


def test_session_wire_structs_have_the_records_fields():
    """A field added to ``SessionRecord``/``TurnRecord`` is written by ``encode_record``: the decoder's structs
    must name it too, or every record written after the change is refused."""
    from dataclasses import fields

    from router.redis_store import _Record, _Turn
    assert set(_Record.__struct_fields__) == {f.name for f in fields(SessionRecord)}
    assert set(_Turn.__struct_fields__) == {f.name for f in fields(TurnRecord)}
