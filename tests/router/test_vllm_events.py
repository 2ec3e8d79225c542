"""vLLM-format KV events (router/vllm_wire.py, vllm_hashmap.py, vllm_consumer.py, vllm_publisher.py).

Frames are built by hand from vLLM's published schema (vllm-project/vllm
``vllm/distributed/kv_events.py``: ``EventBatch(ts, events, data_parallel_rank)``, tagged
``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
...)``, ``BlockRemoved(block_hashes, medium)``, ``AllBlocksCleared``; frames ``[topic, 8-byte
big-endian seq, msgpack batch]``; replay ROUTER: ``[b"", start]`` -> ``[b"", seq, payload]``...,
``[b"", -1, b""]``) in both encodings, sent over real ZMQ sockets to the follower, and the index is
checked to hold exactly the expected (worker, hash) pairs. No model is loaded.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import msgpack
import pytest
import zmq
import zmq.asyncio

from engine.hashing import block_hashes, make_seed
from router.index import PrefixIndex
from router.vllm_consumer import VllmEventFollower
from router.vllm_hashmap import ChainMapper
from router.vllm_publisher import ZmqKVEventPublisher
from router.vllm_wire import (AllBlocksCleared, BlockRemoved, BlockStored, VllmDecodeError, decode_batch,
                              encode_batch, zmq_endpoint)

SEED = make_seed("test-model")
B = 4  # our block size in these tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours(tokens: list[int], parent: int | None = None) -> list[int]:
    return block_hashes(tokens, B, SEED, parent)


def pairs(index: PrefixIndex) -> set[tuple[str, int]]:
    return {(w, h) for w in index.workers() for h in index.hashes_of(w)}


# ------------------------------------------------------------------ hand-built batches (vLLM's schema)

def stored_array(hashes, parent, tokens, block_size, *, medium: str | None = "GPU", extra=()) -> list:
    """``BlockStored`` with ``array_like=True``: the tag, then the fields in declaration order."""
    return ["BlockStored", hashes, parent, tokens, block_size, None, medium, None, *extra]


def stored_map(hashes, parent, tokens, block_size, **more) -> dict:
    """``BlockStored`` as a tagged map (``tag=True`` without ``array_like``)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None, **more}


def batch_array(*events, ts: float = 1.5) -> bytes:
    return msgpack.packb([ts, list(events)])


def batch_map(*events, ts: float = 1.5) -> bytes:
    return msgpack.packb({"ts": ts, "events": list(events), "data_parallel_rank": 0})


def frame(seq: int, payload: bytes, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


# ------------------------------------------------------------------ codec


def test_decode_both_encodings_the_same():
    toks = list(range(8))
    a = decode_batch(batch_array(stored_array([11, -5], None, toks, 4), ["BlockRemoved", [11], "GPU"],
                                 ["AllBlocksCleared"]))
    m = decode_batch(batch_map(stored_map([11, -5], None, toks, 4), {"type": "BlockRemoved", "block_hashes": [11],
                                                                     "medium": "GPU"}, {"type": "AllBlocksCleared"}))
    assert a.events == m.events
    assert a.events[0] == BlockStored((11, (1 << 64) - 5), None, tuple(toks), 4, medium="GPU")  # signed -> u64
    assert a.events[1] == BlockRemoved((11,), "GPU")
    assert a.events[2] == AllBlocksCleared()
    assert m.data_parallel_rank == 0 and a.ts == 1.5
    # SGLang's older layout: BlockStored ends at lora_id, BlockRemoved has no medium; bytes hashes (newer vLLM)
    s = decode_batch(batch_array(["BlockStored", [b"\x01" * 32], b"\x02" * 32, [1, 2], 2, None],
                                 ["BlockRemoved", [b"\x01" * 32]], ["SomethingNew", 1]))
    assert s.events[0].block_hashes == (b"\x01" * 32,) and s.events[0].parent == b"\x02" * 32
    assert s.events[1] == BlockRemoved((b"\x01" * 32,), None)
    assert s.unknown == 1
    # fields and batch elements a newer producer adds are ignored
    n = decode_batch(msgpack.packb([2, [stored_array([1], None, [1, 2], 2, extra=(None, 3, "new")),
                                        {**stored_map([1], None, [1, 2], 2, group_idx=3), "newer": 1}], 0, "more"]))
    assert n.ts == 2.0 and n.events[0] == n.events[1] == BlockStored((1,), None, (1, 2), 2, medium="GPU", group_idx=3)


@pytest.mark.parametrize("payload, why", [
    (b"\xc1", "msgpack"),
    (msgpack.packb([1.0]), "batch: Expected `array` of at least length 2"),
    (msgpack.packb([1.0, [["BlockStored", [1, 2], None, [1, 2, 3], 2, None]]]), "3 token ids for 2 blocks"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None]]]), "block_size"),
    (msgpack.packb([1.0, [["BlockStored", ["x"], None, [1, 2], 2, None]]]),
     r"`int \| bytes`, got `str` - at `\$.block_hashes\[0\]`"),
    (msgpack.packb([1.0, [["BlockStored", [1], 2.5, [1, 2], 2, None]]]), r"got `float` - at `\$.parent_block_hash`"),
    (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "'type'"),
    (msgpack.packb([1.0, [["BlockRemoved"]]]), r"events\[0\] \(BlockRemoved\): Object missing required field"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [-1, 2], 2, None]]]), r"`int` >= 0 - at `\$.token_ids\[0\]`"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1 << 32, 2], 2, None]]]), r"<= 4294967295 - at `\$.token_ids"),
    (msgpack.packb([1.0, [["BlockStored", [True], None, [1, 2], 2, None]]]), r"got `bool` - at `\$.block_hashes\[0\]`"),
    (msgpack.packb([1.0, [["BlockStored", ["AQ=="], None, [1, 2], 2, None]]]), r"got `str`"),  # never base64 bytes
    (msgpack.packb([1.0, [["BlockStored", [b""], None, [1, 2], 2, None]]]), r"length >= 1 - at `\$.block_hashes\[0\]`"),
    (msgpack.packb([1.0, [["BlockStored", [b"x" * 65], None, [1, 2], 2, None]]]), "not a msgpack batch"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], True, None]]]), r"got `bool` - at `\$.block_size`"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]), r"Expected `str \| null`, got `int` - at `\$.medium`"),
    (msgpack.packb([True, []]), r"batch: Expected `float`, got `bool` - at `\$\[0\]`"),
    (msgpack.packb([1.0, [], False]), r"got `bool` - at `\$\[2\]`"),
    (msgpack.packb({"ts": 1.0}), "missing required field `events`"),
    (msgpack.packb([1.0, [5]]), r"events\[0\] must be an array"),
])
def test_decode_rejects(payload, why):
    with pytest.raises(VllmDecodeError, match=why):
        decode_batch(payload)


def test_encode_round_trips_both_encodings():
    events = [BlockStored(((1 << 64) - 1, 7), None, (1, 2, 3, 4), 2, medium="GPU"), BlockRemoved((7,), "GPU"),
              AllBlocksCleared(), BlockStored((9,), 7, (5, 6), 2, medium="GPU", extra_keys=(("cache_salt",),))]
    for enc in ("array", "map"):
        raw = msgpack.unpackb(encode_batch(events, 2.0, enc))
        assert raw[0] == 2.0
        stored = raw[1][0]
        if enc == "array":
            assert stored[:5] == ["BlockStored", [-1, 7], None, [1, 2, 3, 4], 2]  # hashes as signed int64
        else:
            assert stored["type"] == "BlockStored" and stored["block_hashes"] == [-1, 7]
        assert decode_batch(encode_batch(events, 2.0, enc)).events == tuple(events)


# ------------------------------------------------------------------ hash mapping


def test_mapper_equal_larger_and_smaller_external_blocks():
    toks = list(range(100, 124))  # 24 tokens: 6 of our 4-token blocks
    want = ours(toks)
    for ext_size in (4, 8, 2, 3):  # equal, two of ours per block, half, and unaligned
        m = ChainMapper(SEED, B)
        n = len(toks) // ext_size
        got = m.stored(BlockStored(tuple(range(1000, 1000 + n)), None, tuple(toks[:n * ext_size]), ext_size))
        assert got == want[:n * ext_size // B], ext_size
        assert m.held() == frozenset(got)
    # split over two events chained by the parent hash, then removal of the second event's blocks
    m = ChainMapper(SEED, B)
    first = m.stored(BlockStored((1, 2, 3), None, tuple(toks[:9]), 3))       # 9 tokens: 2 of ours + 1 left
    second = m.stored(BlockStored((4, 5, 6, 7, 8), 3, tuple(toks[9:24]), 3))  # completes the rest
    assert first + second == want
    assert m.removed(BlockRemoved((5,))) == []                   # ext 5 (tokens 12..14) completes none of ours
    assert m.removed(BlockRemoved((8, 7))) == [want[5], want[4]]  # tokens 21..23 and 18..20 complete 24 and 20
    assert m.removed(BlockRemoved((99,))) == [] and m.stats.unknown_removed == 1


def test_mapper_orphans_foreign_and_other_medium_are_not_indexed():
    toks = list(range(8))
    m = ChainMapper(SEED, B)
    assert m.stored(BlockStored((5, 6), 404, tuple(toks), 4)) == []           # parent never seen
    assert m.stored(BlockStored((7,), 6, tuple(range(4)), 4)) == []           # child of an orphan
    assert m.stats.orphans == 2
    assert m.stored(BlockStored((1,), None, (1, 2, 3, 4), 4, lora_name="adapter")) == []
    assert m.stored(BlockStored((2,), None, (1, 2, 3, 4), 4, extra_keys=(("salt",),))) == []
    assert m.stats.foreign == 2
    assert m.stored(BlockStored((3,), None, (1, 2, 3, 4), 4, medium="CPU")) == []
    assert m.removed(BlockRemoved((3,), "CPU")) == [] and m.stats.other_medium == 2
    assert m.held() == frozenset()


# ------------------------------------------------------------------ over real ZMQ sockets


class FakeVllmWorker:
    """A PUB socket and a replay ROUTER socket speaking vLLM's protocol with hand-built frames; ``drop``
    seqs are buffered for replay but never sent live (a gap)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        # bound to a port the OS picks in the bind itself: a port probed free and bound later can be taken
        # between the two by another process (seen once: "Address already in use")
        self.events = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_sock = self.ctx.socket(zmq.ROUTER)
        self.replay = f"tcp://127.0.0.1:{self.replay_sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0  # the next batch's seq
        self.requests: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, payload: bytes, live: bool = True) -> int:
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart(frame(seq, payload))
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.replay_sock.poll(20):
                continue
            client, _, start = self.replay_sock.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    self.replay_sock.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self.replay_sock.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ctx.destroy(linger=0)


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def joined(follower: VllmEventFollower, fake: FakeVllmWorker) -> None:
    """Wait until the SUB subscription reached the publisher (ZMQ's slow joiner): probe frames are sent
    (and buffered) until the follower applied one."""
    while follower.stats.batches == 0:
        fake.send(batch_array())
        await asyncio.sleep(0.02)
    await until(lambda: follower.next_seq == fake.seq)


@pytest.fixture
def fake():
    worker = FakeVllmWorker()
    yield worker
    worker.close()


def follow(fake: FakeVllmWorker, index: PrefixIndex, **kw) -> VllmEventFollower:
    return VllmEventFollower("gpu0", fake.events, index, ChainMapper(SEED, B), replay_endpoint=fake.replay,
                             replay_timeout_s=2.0, context=zmq.asyncio.Context.instance(), **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_frames_reach_the_index_exactly(fake, encoding):
    """Stored / removed / cleared, hand-built in one encoding, over a real PUB socket; 8-token external
    blocks over our 4-token ones; bytes hashes in the map case (newer vLLM)."""
    stored, batch = (stored_array, batch_array) if encoding == "array" else (stored_map, batch_map)
    removed = (lambda hs: ["BlockRemoved", hs, "GPU"]) if encoding == "array" else \
        (lambda hs: {"type": "BlockRemoved", "block_hashes": hs, "medium": "GPU"})
    cleared = ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    h = (lambda i: i * 1000 + 7) if encoding == "array" else (lambda i: bytes([i]) * 32)
    a = list(range(1, 17))        # prompt A: 16 tokens = 2 external blocks, 4 of ours
    b = list(range(50, 58))       # continues A by one external block (2 of ours)
    c = list(range(200, 208))     # an unrelated prefix
    want_a, want_b, want_c = ours(a), ours(b, ours(a)[-1]), ours(c)

    async def run():
        index = PrefixIndex()
        confirmed = []
        f = follow(fake, index, on_blocks=lambda w, hs: confirmed.append((w, hs)))
        f.start()
        try:
            await joined(f, fake)
            gaps = f.stats.gaps  # 0, or 1 if the first probe reached no subscriber yet
            fake.send(batch(stored([h(1), h(2)], None, a, 8), stored([h(3)], h(2), b, 8)))
            fake.send(batch(stored([h(4)], None, c, 8)))
            await until(lambda: f.next_seq == fake.seq)
            assert pairs(index) == {("gpu0", x) for x in want_a + want_b + want_c}
            assert index.match(ours(a + b)) == {"gpu0": 6}
            assert confirmed == [("gpu0", tuple(want_a)), ("gpu0", tuple(want_b)), ("gpu0", tuple(want_c))]
            fake.send(batch(removed([h(3)])))  # the leaf: our last two blocks of A+B
            await until(lambda: f.next_seq == fake.seq)
            assert pairs(index) == {("gpu0", x) for x in want_a + want_c}
            fake.send(batch(cleared, stored([h(4)], None, c, 8)))  # cleared, then C again
            await until(lambda: f.next_seq == fake.seq)
            assert pairs(index) == {("gpu0", x) for x in want_c}
            assert f.stats.malformed == f.stats.lost == 0 and f.stats.gaps == gaps
        finally:
            await f.stop()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_gap_is_replayed_and_late_join_loads_the_buffer(fake):
    """Batches published before the follower joined, and one dropped from the live stream, arrive
    through the replay socket; a malformed batch is counted and skipped; a restart drops the entries."""
    a, b, c = list(range(1, 9)), list(range(9, 17)), list(range(300, 304))
    want_a, want_b = ours(a), ours(b, ours(a)[-1])

    async def run():
        index = PrefixIndex()
        fake.send(batch_array(stored_array([1], None, a, 8)), live=False)   # before we joined
        f = follow(fake, index)
        f.start()
        try:
            await joined(f, fake)  # its first live frame (seq 1) is a gap from 0: replay from 0
            assert fake.requests[0] == 0 and f.stats.replayed >= 1
            assert pairs(index) == {("gpu0", x) for x in want_a}
            n = fake.send(batch_array(stored_array([2], 1, b, 8)), live=False)  # dropped live
            fake.send(b"\x93\xc1")                                      # undecodable
            fake.send(batch_array(stored_array([3], None, c, 4)))
            await until(lambda: f.next_seq == fake.seq)
            assert fake.requests[-1] == n
            assert f.stats.gaps == 2 and f.stats.malformed == 1 and f.stats.lost == 0
            assert pairs(index) == {("gpu0", x) for x in want_a + want_b + ours(c)}
            # the worker restarts: its new publisher counts from 0 again, opening with AllBlocksCleared
            fake.buffer.clear()
            fake.seq = 0
            fake.send(batch_array(["AllBlocksCleared"], stored_array([3], None, c, 4)))
            await until(lambda: f.stats.restarts == 1 and f.next_seq == 1)
            assert pairs(index) == {("gpu0", x) for x in ours(c)}
        finally:
            await f.stop()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_gap_without_replay_is_counted_lost(fake):
    async def run():
        index = PrefixIndex()
        f = VllmEventFollower("gpu0", fake.events, index, ChainMapper(SEED, B), replay_endpoint=None)
        f.start()
        try:
            await joined(f, fake)
            lost = f.stats.lost  # 0, or 1 if the first probe reached no subscriber yet
            fake.send(batch_array(stored_array([1], None, list(range(8)), 8)), live=False)
            fake.send(batch_array(stored_array([2], 1, list(range(8, 16)), 8)))  # its parent was lost
            await until(lambda: f.next_seq == fake.seq)
            assert f.stats.lost == lost + 1 and f.mapper.stats.orphans == 1
            assert pairs(index) == set()  # a loss never invents blocks
        finally:
            await f.stop()

    asyncio.run(run())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("encoding", ["array", "map"])
def test_round_trip_our_publisher_to_our_consumer(encoding):
    """Our publisher's frames (hashes = our chain hashes, as the radix cache reports them) -> our
    follower, which recomputes the same hashes from the token ids; a replay of what it missed."""
    port, rport = free_port(), free_port()
    pub = ZmqKVEventPublisher(f"zmq://127.0.0.1:{port}", block_size=B, replay_endpoint=f"zmq://127.0.0.1:{rport}",
                              topic="kv", encoding=encoding)
    toks = list(range(40, 64))
    h = ours(toks)

    async def run():
        index = PrefixIndex()
        pub.start()
        pub.publish("stored", h[:2], None, toks[:8])  # sent before the follower subscribed: replayed
        pub.flush()
        f = VllmEventFollower("w1", zmq_endpoint(f"zmq://127.0.0.1:{port}"), index, ChainMapper(SEED, B),
                              replay_endpoint=f"tcp://127.0.0.1:{rport}", topic="kv")
        f.start()
        try:
            i = 2
            while f.next_seq == 0:  # the slow joiner: publish until a live frame reaches the follower
                pub.publish("stored", [h[i]], h[i - 1], toks[i * B:(i + 1) * B])
                i += 1
                assert i < 6
                await asyncio.sleep(0.05)
            pub.publish("stored", h[i:], h[i - 1], toks[i * B:])
            pub.publish("removed", [h[-1]], h[-2])
            pub.flush()
            await until(lambda: f.next_seq == pub.last_seq + 1)
            assert pairs(index) == {("w1", x) for x in h[:-1]}
            assert pub.replays_served >= 1 and f.stats.replayed >= 2
            pub.publish("cleared", [], None)
            pub.flush()
            await until(lambda: f.next_seq == pub.last_seq + 1)
            assert pairs(index) == set()
            # a salted tenant's blocks are marked (extra_keys) and not taken for unsalted prefixes
            pub.publish("stored", [12345], None, toks[:B], salt="tenant-a")
            pub.flush()
            await until(lambda: f.next_seq == pub.last_seq + 1)
            assert pairs(index) == set() and f.mapper.stats.foreign == 1
            with pytest.raises(ValueError, match="token ids"):
                pub.publish("stored", [h[0]], None, toks[:3])
        finally:
            await f.stop()
            pub.close()

    asyncio.run(run())
