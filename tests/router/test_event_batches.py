"""The consumer's batch path (``KVEventConsumer.apply_entries``, what ``poll`` uses) against the
per-event reference (``apply_entries_reference``: each entry through ``decode_event`` and ``apply``).

Random streams of stream entries (several workers, shared blocks and tier media, removals of
blocks nobody holds, duplicates, gaps, ``cleared`` restarts, unknown media, every kind of
malformed entry, snapshots that fail) go through both, in random batch sizes, with
``forget_worker`` between batches; the index's every internal map, the seqs, ``stats``, the
snapshot reads, the ``on_blocks`` calls, the errors raised and the warnings logged must be the
same. ``EventReader`` (the batch path's decoder) is checked on hostile bytes against
``decode_event``: what it accepts, ``decode_event`` accepts with the same fields, whatever came before.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import asdict

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import RouterConfig
from router.event_consumer import KVEventConsumer, Snapshot
from router.events import MEDIA, EventDecodeError, EventReader, KVEvent, decode_event, encode_event, ordinary_event
from router.index import PrefixIndex

MAX_BYTES, MAX_HASHES = 700, 8
CFG = RouterConfig(event_max_bytes=MAX_BYTES, event_max_hashes=MAX_HASHES)
WORKERS = ("w0", "w1", "w2", "w3")
POOL = list(range(1, 30)) + [(1 << 64) - 1, (1 << 63) + 5]   # few blocks: shared, removed while unknown, ...
U64 = 1 << 64


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def event_map(worker, seq, kind, hashes, parent=None, ts=0, **extra) -> dict:
    return {"worker": worker, "seq": seq, "kind": kind, "hashes": list(hashes), "parent": parent, "ts": ts,
            **extra}


BAD_FIELDS = [
    ("seq", True), ("seq", -1), ("seq", 1.5), ("seq", "3"), ("seq", None),
    ("kind", "evicted"), ("kind", b"stored"), ("kind", 1), ("kind", ["stored"]), ("kind", {"a": 1}),
    ("hashes", [-1]), ("hashes", [True]), ("hashes", [1.0]), ("hashes", ["1"]), ("hashes", [None]),
    ("hashes", [1, 2, -(1 << 63)]), ("hashes", [1, True]), ("hashes", [[1]]), ("hashes", 5),
    ("hashes", {"1": 2}), ("hashes", list(range(MAX_HASHES + 1))), ("hashes", "abc"),
    ("worker", ""), ("worker", "x" * 257), ("worker", 7), ("worker", None), ("worker", ["w0"]),
    ("parent", -1), ("parent", "p"), ("parent", True), ("parent", 1.0), ("parent", [1]),
    ("ts", -5), ("ts", None), ("ts", True), ("ts", 2.5),
    ("medium", 5), ("medium", ""), ("medium", "m" * 33), ("medium", None), ("medium", ["host"]),
    ("medium", {"a": 1}),
]


def malformed(rng: random.Random, worker: str, seq: int) -> dict | None:
    """A stream entry's fields that ``decode_event`` must refuse (or a valid event it must not apply
    as an ordinary one); None: an entry without the ``e`` field."""
    good = event_map(worker, seq, "stored", [rng.choice(POOL)])
    r = rng.randrange(14)
    if r == 0:
        return None
    if r == 1:
        return {b"e": rng.choice([b"", b"\xc1", b"\xc1\xc1", bytes(rng.randrange(256) for _ in range(12)),
                                  b"\x80\x04\x95pickle"])}
    if r == 2:
        return {b"e": rng.choice([packed([1, 2]), packed(3), packed("stored"), packed(None), packed(b"xy"),
                                  packed([good])])}
    if r == 3:
        missing = rng.choice(sorted(good))
        return {b"e": packed({k: v for k, v in good.items() if k != missing})}
    if r == 4:
        return {b"e": b"\x00" * (MAX_BYTES + 1)}
    if r == 5:
        return {b"e": packed({**good, "pad": "x" * MAX_BYTES})}  # over the byte limit once encoded
    if r == 6:
        body = packed(good)
        return {b"e": rng.choice([body[:-1], body[: len(body) // 2], body + b"\x00", body + body])}
    if r == 7:
        return {b"e": packed({**good, "parent": msgpack.ExtType(1, b"x")})}
    if r == 8:  # not bytes (a client decoding responses would hand str), or bytes of another type
        return {b"e": rng.choice([packed(good).decode("latin-1"), bytearray(packed(good)), 17])}
    if r == 9:  # a map with a key that is not a string, or too many keys
        return {b"e": rng.choice([msgpack.packb({**good, 1: 2}, strict_types=False),
                                  packed({**good, **{f"k{i}": i for i in range(30)}})])}
    name, value = rng.choice(BAD_FIELDS)
    return {b"e": packed({**good, name: value})}


def random_entries(rng: random.Random, n: int) -> list[tuple[bytes, dict]]:
    seq = {w: 0 for w in WORKERS}   # each worker's next seq as its publisher numbers them
    out = []
    for i in range(n):
        w = rng.choice(WORKERS)
        r = rng.random()
        fields: dict | None
        if r < 0.5 or (r < 0.62 and not seq[w]):  # in order, ordinary
            kind = rng.choice(("stored", "stored", "removed"))
            k = rng.choice((0, 1, 1, 1, 2, 3, MAX_HASHES))
            hashes = [rng.choice(POOL) for _ in range(k)]  # duplicates within an event too
            medium = rng.choice(("device",) * 6 + ("host", "disk"))
            extra = {"medium": medium} if medium != "device" or rng.random() < 0.1 else {}
            if rng.random() < 0.1:
                extra["newer_field"] = [1, {"x": "y"}]     # unknown keys are ignored
            fields = {b"e": packed(event_map(w, seq[w], kind, hashes, rng.choice((None, rng.choice(POOL))),
                                             rng.randrange(1 << 40), **extra))}
            seq[w] += 1
        elif r < 0.62:  # a repeat of an older seq (a batch written twice)
            fields = {b"e": encode_event(KVEvent(w, rng.randrange(seq[w]), rng.choice(("stored", "removed")),
                                                 (rng.choice(POOL),), None, 0))}
        elif r < 0.68:  # a gap: events lost on the wire
            seq[w] += rng.randint(1, 3)
            fields = {b"e": encode_event(KVEvent(w, seq[w], "stored", (rng.choice(POOL),), None, 0))}
            seq[w] += 1
        elif r < 0.73:  # cleared: the worker restarted (seq from 0) or republishes
            if rng.random() < 0.5:
                seq[w] = 0
            fields = {b"e": encode_event(KVEvent(w, seq[w], "cleared", (), None, 0))}
            seq[w] += 1
        elif r < 0.76:  # a medium this router does not know
            fields = {b"e": packed(event_map(w, seq[w], "stored", [rng.choice(POOL)], medium="gpu"))}
            seq[w] += 1
        else:
            fields = malformed(rng, w, seq[w])
            if fields is None:
                fields = {b"other": b"x"}
        out.append((b"%d-%d" % (1000 + i, rng.randrange(3)), fields))
    return out


def index_state(index: PrefixIndex) -> tuple:
    """Every internal map of the index (equal only if the same updates ran in the same order)."""
    return (index._holders, index._slot, index._ids, index._bits, index._by_worker, sorted(index._free),
            index._media)


def drive(path: str, entries: list, seed: int, fail_at: frozenset[int] = frozenset(), forget: bool = True) -> dict:
    """Feed ``entries`` through one path, in random batches, as ``poll`` would: after an error, from
    the entry after ``last_id`` on. Returns everything observable."""
    index = PrefixIndex()
    reads: list[str] = []
    blocks: list[tuple[str, tuple[int, ...]]] = []
    errors: list[tuple] = []
    rng = random.Random(seed)

    async def snapshot(wid: str) -> Snapshot:
        n = len(reads)
        reads.append(wid)
        if n in fail_at:
            raise ConnectionError(f"snapshot {n} of {wid} unavailable")
        r = random.Random(f"{seed}/{wid}/{n}")
        tiers = {m: tuple(sorted(set(r.sample(POOL, 3)))) for m in MEDIA[1:] if r.random() < 0.3}
        return Snapshot(r.randrange(-1, 12), tuple(sorted(set(r.sample(POOL, r.randrange(6))))), tiers)

    consumer = KVEventConsumer(None, CFG, index, snapshot_source=snapshot,  # type: ignore[arg-type]
                               on_blocks=lambda w, h: blocks.append((w, h)))
    apply = consumer.apply_entries if path == "fast" else consumer.apply_entries_reference
    position = {eid: i for i, (eid, _) in enumerate(entries)}

    async def run() -> None:
        pos = 0
        while pos < len(entries):
            batch = entries[pos: pos + rng.choice((1, 2, 5, 17, 64, 1000))]
            try:
                got = await apply(batch)
            except ConnectionError as e:
                errors.append((consumer.stats.last_id, str(e), asdict(consumer.stats)))
                pos = position[consumer.stats.last_id.encode()] + 1
            else:
                assert got == len(batch)
                pos += len(batch)
            if forget and rng.random() < 0.05:  # a worker declared dead between polls
                consumer.forget_worker(rng.choice(WORKERS))

    asyncio.run(run())
    return {"index": index_state(index), "next_seq": consumer._next_seq, "last_id": consumer._last_id,
            "stats": asdict(consumer.stats), "reads": reads, "blocks": blocks, "errors": errors}


def logged(caplog, fn):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="router.event_consumer"):
        result = fn()
    return result, [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.event_consumer"]


@pytest.mark.parametrize("seed", range(40))
def test_batch_path_matches_reference_on_random_streams(seed, caplog):
    rng = random.Random(seed)
    entries = random_entries(rng, rng.choice((30, 200, 1500)))
    fail_at = frozenset(rng.sample(range(40), 3)) if seed % 3 == 0 else frozenset()
    ref, ref_log = logged(caplog, lambda: drive("reference", entries, seed, fail_at))
    fast, fast_log = logged(caplog, lambda: drive("fast", entries, seed, fail_at))
    for key in ref:
        assert fast[key] == ref[key], key
    assert fast_log == ref_log
    stats = ref["stats"]  # the stream exercised what it is meant to
    if len(entries) >= 1500:
        assert stats["malformed"] and stats["gaps"] and stats["skipped"] and stats["resyncs"]
        assert {"stored", "removed", "cleared"} <= set(stats["per_kind"])
        assert any(reason.startswith("skipping undecodable") for _, reason in ref_log)
    if fail_at and len(entries) >= 200:
        assert ref["errors"]


def test_batch_path_takes_ordinary_events_without_the_reference(monkeypatch):
    """In-order ordinary events never reach ``_handle`` (the fast path is the one used), and give
    the index the reference gives it."""
    rng = random.Random(7)
    entries = [(b"1-0", {b"e": encode_event(KVEvent("w0", 0, "cleared", (), None, 0))})]
    for seq in range(1, 400):
        hashes = tuple(rng.sample(POOL, rng.choice((1, 1, 3))))
        kind = rng.choice(("stored", "removed"))
        entries.append((b"%d-0" % (seq + 1), {b"e": encode_event(KVEvent("w0", seq, kind, hashes, None, 0,
                                                                         rng.choice(MEDIA)))}))
    ref = drive("reference", entries, 1, forget=False)
    handled = []
    original = KVEventConsumer._handle

    async def spy(self, payload):
        handled.append(payload)
        await original(self, payload)

    monkeypatch.setattr(KVEventConsumer, "_handle", spy)
    fast = drive("fast", entries, 1, forget=False)
    assert len(handled) == 1  # the `cleared` only
    assert fast == ref and ref["stats"]["applied"] + ref["stats"]["skipped"] == 400 and ref["stats"]["applied"] > 380


def test_batch_counts_reach_stats_before_a_resync_awaits():
    """A resync awaits: whatever reads ``stats`` meanwhile (``GET /router/state``) sees every event
    applied before it in the batch."""
    seen = []
    consumer: KVEventConsumer

    async def snapshot(wid):
        seen.append(asdict(consumer.stats))
        return Snapshot(-1, ())

    consumer = KVEventConsumer(None, CFG, PrefixIndex(), snapshot_source=snapshot)  # type: ignore[arg-type]
    entries = [(b"1-0", {b"e": encode_event(KVEvent("w0", 0, "cleared", (), None, 0))}),
               (b"2-0", {b"e": encode_event(KVEvent("w0", 1, "stored", (5,), None, 0))}),
               (b"3-0", {b"e": encode_event(KVEvent("w0", 1, "stored", (5,), None, 0))}),
               (b"4-0", {b"e": encode_event(KVEvent("w0", 5, "stored", (6,), None, 0))})]
    assert asyncio.run(consumer.apply_entries(entries)) == 4
    assert seen[1]["applied"] == 2 and seen[1]["skipped"] == 1 and seen[1]["last_id"] == "4-0"
    assert consumer.stats.per_kind == {"cleared": 1, "stored": 2} and consumer.stats.gaps == 1


# ------------------------------------------------------------ ordinary_event against decode_event

scalars = st.none() | st.booleans() | st.integers(-(1 << 63), U64 - 1) | st.floats(allow_nan=False) \
    | st.text(max_size=10) | st.binary(max_size=10)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


READER = EventReader(MAX_BYTES, MAX_HASHES)  # one for every example, as the consumer keeps one


def agrees(data) -> None:
    """``READER.ordinary(data)`` is None, or ``decode_event`` accepts ``data`` with the same fields; a
    fresh reader says the same (nothing of an earlier payload is left in the shared one)."""
    fast = READER.ordinary(data)
    assert fast == ordinary_event(data, MAX_BYTES, MAX_HASHES)
    try:
        ev = decode_event(data, MAX_BYTES, MAX_HASHES)
    except EventDecodeError:
        assert fast is None
        return
    if fast is not None:
        assert fast == (ev.worker, ev.seq, ev.kind, ev.hashes, ev.medium)
        assert ev.kind in ("stored", "removed") and ev.medium in MEDIA and type(fast[3]) is tuple
    else:  # refused by the fast path but valid: only what the reference must handle itself
        assert (ev.kind == "cleared" or ev.medium not in MEDIA or type(data) is not bytes
                or set(msgpack.unpackb(data, raw=False)) - set(KVEvent.__struct_fields__))  # a newer worker's field


GOOD = event_map("w1", 3, "stored", [1, 2, U64 - 1], 7, 1)


def test_ordinary_event_refuses_each_bad_field():
    for name, value in BAD_FIELDS:
        data = packed({**GOOD, name: value})
        assert ordinary_event(data, MAX_BYTES, MAX_HASHES) is None, (name, value)
        agrees(data)
    rng = random.Random(3)
    for _ in range(300):
        fields = malformed(rng, rng.choice(WORKERS), rng.randrange(5))
        if fields is not None:
            assert ordinary_event(fields[b"e"], MAX_BYTES, MAX_HASHES) is None, fields
            agrees(fields[b"e"])


@pytest.mark.slow
@FUZZ
@given(st.sampled_from(sorted(GOOD) + ["medium"]), values)
def test_ordinary_event_on_one_bad_field(name, value):
    agrees(packed({**GOOD, name: value}))


@FUZZ
@given(st.binary(max_size=200))
def test_ordinary_event_on_arbitrary_bytes(data):
    agrees(data)


@FUZZ
@given(st.data())
def test_ordinary_event_on_mutated_events(data):
    body = bytearray(packed({**GOOD, "medium": data.draw(st.sampled_from(MEDIA + ("gpu",)))}))
    for _ in range(data.draw(st.integers(1, 3))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    agrees(bytes(body[: data.draw(st.integers(1, len(body)))]))


@pytest.mark.slow
@FUZZ
@given(values)
def test_ordinary_event_on_arbitrary_msgpack(value):
    agrees(packed(value))


def test_ordinary_event_accepts_what_the_publisher_writes():
    for ev in [KVEvent("w", 0, "stored", (), None, 0), KVEvent("w" * 256, 1 << 62, "removed", (0, U64 - 1), U64 - 1, 5),
               KVEvent("w", 4, "stored", (9,), 3, 1, "disk"), KVEvent("w", 4, "removed", tuple(range(MAX_HASHES)), 0, 0,
                                                                      "host")]:
        assert ordinary_event(encode_event(ev), MAX_BYTES, MAX_HASHES) == (ev.worker, ev.seq, ev.kind, ev.hashes,
                                                                           ev.medium)
    for data in [encode_event(KVEvent("w", 0, "cleared", (), None, 0)), bytearray(encode_event(GOOD_EVENT)),
                 packed({**GOOD, "medium": "gpu"}), packed({**GOOD, "hashes": list(range(MAX_HASHES + 1))})]:
        assert ordinary_event(data, MAX_BYTES, MAX_HASHES) is None
    agrees(encode_event(GOOD_EVENT))


GOOD_EVENT = KVEvent("w1", 3, "stored", (1, 2, U64 - 1), 7, 1)


def test_reader_starts_clean_after_each_bad_payload():
    """A truncated payload leaves bytes in the unpacker, one with trailing bytes or two objects leaves
    the rest: none of it may join the next payload (here the second half of the same event)."""
    reader = EventReader(MAX_BYTES, MAX_HASHES)
    body = encode_event(GOOD_EVENT)
    want = ("w1", 3, "stored", (1, 2, U64 - 1), "device")
    for bad in (body[:7], body[:-1], body + b"\x01", body + body, b"\xc1", b"\x92", b"",
                b"\x00" * (MAX_BYTES + 1), packed([1] * (MAX_HASHES + 1)), packed({"k": "x" * 5000})[:MAX_BYTES]):
        assert reader.ordinary(bad) is None
        assert reader.ordinary(body[7:]) is None  # the rest of a split event is not an event
        assert reader.ordinary(body) == want
