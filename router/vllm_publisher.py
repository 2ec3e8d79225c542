"""Worker side of vLLM's KV-event wire format: ``agentrt worker --kv-events zmq://*:PORT``.

Beside the Redis stream of contract 2 (``router/events.py``), a worker can publish the same cache
changes as vLLM does (``router/vllm_wire.py``), so Dynamo's KV router, llm-d's precise prefix scorer
or another agentrt router (``--vllm-worker``) can route to it. Both publishers hang off the same
radix-cache hook (``router/worker.py``), so they see the same events in the same order.

Frames are ``[topic, seq, payload]`` on a PUB socket, ``seq`` counting batches from 0 (8 bytes,
big-endian), one ``EventBatch`` per cache event: ``BlockStored`` with ``block_hashes`` = our
contract-1 chain hashes, ``parent_block_hash`` = our parent's, ``token_ids`` and ``block_size`` =
our page size, ``medium`` "GPU", ``extra_keys`` marking blocks of a salted tenant (their hashes are
seeded by the salt, contract 1; the salt itself is not sent); ``BlockRemoved``; ``AllBlocksCleared`` first, at seq 0, so a
consumer drops what it had from an earlier run of this worker. Because the hashes are our chain
hashes, a consumer that recomputes them from ``token_ids`` (ours does) gets the same values.

Replay (optional ``--kv-events-replay``): a ROUTER socket answers a request ``[b"", start seq]``
(8 bytes big-endian, from a DEALER or REQ socket) with ``[b"", seq, payload]`` for every buffered
batch with ``seq >= start`` and then ``[b"", -1, b""]``; the buffer keeps the last
``buffer_steps`` batches. This is the protocol of vLLM's ``ZmqEventPublisher``
(vllm-project/vllm ``vllm/distributed/kv_events.py``).

``publish`` only enqueues (the engine thread never blocks on a socket); a daemon thread owns both
sockets (ZMQ sockets are not thread-safe), sends, and serves replays between sends.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Sequence

import zmq

from router.vllm_wire import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Encoding, Event, END_SEQ,
                              encode_batch, pack_seq, zmq_endpoint)

log = logging.getLogger(__name__)


class ZmqKVEventPublisher:
    """Publishes radix-cache events in vLLM's format. ``publish(kind, hashes, parent, token_ids)``
    matches the engine's hook with ``kv_event_tokens=True``; ``kind`` is contract 2's."""

    def __init__(self, endpoint: str, block_size: int, replay_endpoint: str | None = None, topic: str = "",
                 encoding: Encoding = "array", buffer_steps: int = 10_000, hwm: int = 100_000) -> None:
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.endpoint = zmq_endpoint(endpoint)
        self.replay_endpoint = None if replay_endpoint is None else zmq_endpoint(replay_endpoint)
        self.block_size = block_size
        self.topic = topic.encode()
        self.encoding = encoding
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)  # the worker is the stable side: it binds, consumers connect
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._seq = 0
        self.replays_served = 0
        self._thread: threading.Thread | None = None

    @property
    def last_seq(self) -> int:
        """Seq of the last batch sent (-1: none yet)."""
        return self._seq - 1

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._queue.put(AllBlocksCleared())
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("publishing vLLM-format KV events on %s (replay %s, topic %r, %s encoding)", self.endpoint,
                 self.replay_endpoint, self.topic.decode(), self.encoding)

    def publish(self, kind: str, hashes: Sequence[int], parent: int | None,
                token_ids: Sequence[int] | None = None, salt: str = "") -> None:
        if kind == "stored":
            if token_ids is None or len(token_ids) != len(hashes) * self.block_size:
                raise ValueError(f"a stored event needs {len(hashes) * self.block_size} token ids "
                                 f"({len(hashes)} blocks of {self.block_size}); got "
                                 f"{None if token_ids is None else len(token_ids)}")
            # A tenant's cache salt seeds its hashes (contract 1): say so per block, as vLLM puts a
            # request's cache_salt in extra_keys, so no consumer takes them for unsalted token prefixes.
            # The salt itself stays here.
            extra = tuple(("cache_salt",) for _ in hashes) if salt else None
            event: Event = BlockStored(tuple(hashes), parent, tuple(token_ids), self.block_size, medium=MEDIUM_GPU,
                                       extra_keys=extra)
        elif kind == "removed":
            event = BlockRemoved(tuple(hashes), medium=MEDIUM_GPU)
        elif kind == "cleared":
            event = AllBlocksCleared()
        else:
            raise ValueError(f"kind must be stored, removed or cleared, got {kind!r}")
        self._queue.put(event)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every event published so far has been sent."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._queue.unfinished_tasks} KV events not yet sent")
            time.sleep(0.002)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ------------------------------------------------------------ the sending thread

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError:
                    log.exception("serving a KV-event replay failed")
            try:
                event = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            try:
                if event is None:
                    return
                payload = encode_batch([event], time.time(), self.encoding)
                seq = self._seq
                self._pub.send_multipart((self.topic, pack_seq(seq), payload))
                self._buffer.append((seq, payload))
                self._seq += 1
            except zmq.ZMQError:  # a send that failed is not retried: consumers see the gap and replay
                log.exception("sending a KV event failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", pack_seq(seq), payload))
        self._replay.send_multipart((client, b"", pack_seq(END_SEQ), b""))
        self.replays_served += 1
