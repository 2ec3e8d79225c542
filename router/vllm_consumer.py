"""Router side of vLLM's KV-event wire format: follow one vLLM/SGLang-style worker into the index.

``VllmEventFollower`` subscribes (ZMQ SUB, ``zmq.asyncio``, on the router's event loop) to one
worker's events endpoint (``router/vllm_wire.py`` for the frames), maps each batch's external block
hashes to our contract-1 chain hashes (``ChainMapper``, ``router/vllm_hashmap.py``) and applies them
to the same ``PrefixIndex`` the Redis consumer feeds, under the worker's id. Frames that cannot be
decoded are counted, logged and skipped (contract 2).

Sequence numbers (per worker, counting batches from 0):

* a frame whose seq is past the next expected one is a **gap** (the SUB socket dropped frames, or
  we joined after the worker started): the follower asks the worker's replay socket (ROUTER) for
  every batch from the next expected seq on, with a DEALER socket: request ``[b"", start]``,
  replies ``[b"", seq, payload]`` until seq -1 (vLLM's protocol), applies them in order and goes on.
  Joining late is just a gap from seq 0, so a router starting next to a running worker loads
  everything the worker's replay buffer still holds. A replay that cannot reach back (no replay
  socket, a timeout, a buffer that starts later) leaves the missing batches **lost** (counted): the
  index keeps what it had, and blocks whose parent was lost are not indexed (the mapper cannot
  chain them), so a loss can make the index miss blocks but never invent any;
* a frame at or below a seq already seen *live* means the worker restarted (a fresh publisher counts
  from 0 again): its entries are dropped and the new run is followed from that frame;
* frames below the next expected seq that a replay already delivered are skipped.

``AllBlocksCleared`` drops the worker's entries. The mapper survives the worker leaving the live set
(a failed health probe): ``held()`` refills the index when it comes back.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import zmq
import zmq.asyncio

from agentrt.core.tasks import cancel_and_wait
from router.index import PrefixIndex
from router.vllm_hashmap import ChainMapper
from router.vllm_wire import (BlockRemoved, BlockStored, END_SEQ, VllmDecodeError,
                              decode_batch, pack_seq, unpack_seq)

log = logging.getLogger(__name__)


@dataclass
class FollowerStats:
    batches: int = 0       # batches applied (live and replayed)
    events: int = 0        # events applied
    malformed: int = 0     # frames or batches that could not be decoded (skipped)
    unknown: int = 0       # events of an unknown type (skipped)
    duplicates: int = 0    # frames already applied (delivered by a replay first)
    gaps: int = 0          # gaps seen in the live stream
    replays: int = 0       # replay requests answered
    replayed: int = 0      # batches applied from replays
    replay_failures: int = 0
    lost: int = 0          # batches neither received nor replayed
    restarts: int = 0      # the worker's publisher started over


class VllmEventFollower:
    def __init__(self, worker_id: str, events_endpoint: str, index: PrefixIndex, mapper: ChainMapper, *,
                 replay_endpoint: str | None = None, topic: str = "", replay_timeout_s: float = 2.0,
                 on_blocks: Callable[[str, tuple[int, ...]], None] | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        self.worker_id = worker_id
        self.events_endpoint = events_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = index
        self.mapper = mapper
        self.replay_timeout_s = replay_timeout_s
        self.on_blocks = on_blocks
        self.stats = FollowerStats()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._next = 0                     # next seq to apply
        self._last_live: int | None = None  # last seq received on the SUB socket
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def next_seq(self) -> int:
        return self._next

    def held(self) -> frozenset[int]:
        """Our hashes of every block the worker is known to hold."""
        return self.mapper.held()

    # ------------------------------------------------------------ lifecycle

    def connect(self) -> None:
        """Open the SUB socket (frames published from now on queue up for :meth:`run`)."""
        if self._sub is None:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            self._sub.connect(self.events_endpoint)

    def start(self) -> asyncio.Task:
        self.connect()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name=f"vllm-events-{self.worker_id}")
        return self._task

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def run(self) -> None:
        """Receive and apply frames forever; an unexpected error is logged and the loop goes on."""
        self.connect()
        while True:
            try:
                await self.handle_frame(await self._sub.recv_multipart())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("following KV events of %s failed; going on", self.worker_id)
                await asyncio.sleep(0.1)

    # ------------------------------------------------------------ frames

    async def handle_frame(self, frames: list[bytes]) -> None:
        """One live frame ``[topic, seq, payload]``."""
        if len(frames) != 3:
            self._malformed(f"a frame has {len(frames)} parts, expected 3 (topic, seq, payload)")
            return
        try:
            seq = unpack_seq(frames[1])
        except VllmDecodeError as e:
            self._malformed(str(e))
            return
        if seq < 0:
            self._malformed(f"negative seq {seq} in the live stream")
            return
        if self._last_live is not None and seq <= self._last_live:
            log.warning("KV events of %s: seq %d after %d, the worker restarted; dropping its entries",
                        self.worker_id, seq, self._last_live)
            self.stats.restarts += 1
            self._clear()
            self._next = 0
        self._last_live = seq
        if seq < self._next:
            self.stats.duplicates += 1
            return
        if seq > self._next:
            self.stats.gaps += 1
            log.info("KV events of %s: gap (expected seq %d, got %d); asking for a replay", self.worker_id,
                     self._next, seq)
            await self.replay(self._next)
            if seq < self._next:
                self.stats.duplicates += 1
                return
            if seq > self._next:
                self.stats.lost += seq - self._next
                log.warning("KV events of %s: batches %d..%d are lost", self.worker_id, self._next, seq - 1)
                self._next = seq
        self._apply(seq, frames[2])

    async def replay(self, start: int) -> None:
        """Ask the worker for every buffered batch from ``start`` on and apply the ones still missing."""
        if self.replay_endpoint is None:
            self.stats.replay_failures += 1
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", pack_seq(start)])
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    self.stats.replay_failures += 1
                    log.warning("KV-event replay from %s timed out after %.1f s", self.replay_endpoint,
                                self.replay_timeout_s)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    self._malformed(f"a replay reply has {len(frames)} parts, expected 3")
                    continue
                try:
                    seq = unpack_seq(frames[1])
                except VllmDecodeError as e:
                    self._malformed(str(e))
                    continue
                if seq == END_SEQ:
                    self.stats.replays += 1
                    return
                if seq < self._next:
                    continue
                if seq > self._next:  # the buffer no longer reaches back that far
                    self.stats.lost += seq - self._next
                    log.warning("KV-event replay of %s starts at %d, not %d: batches lost", self.worker_id,
                                seq, self._next)
                    self._next = seq
                self.stats.replayed += 1
                self._apply(seq, frames[2])
        finally:
            sock.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._next = seq + 1
        try:
            batch = decode_batch(payload)
        except VllmDecodeError as e:
            self._malformed(f"batch {seq}: {e}")
            return
        self.stats.batches += 1
        self.stats.unknown += batch.unknown
        wid = self.worker_id
        for event in batch.events:
            self.stats.events += 1
            try:
                if isinstance(event, BlockStored):
                    ours = self.mapper.stored(event)
                    self.index.stored(wid, ours)
                elif isinstance(event, BlockRemoved):
                    ours = self.mapper.removed(event)
                    self.index.removed(wid, ours)
                else:  # AllBlocksCleared
                    self._clear()
                    continue
            except ValueError as e:  # e.g. token ids outside uint32 slipped through: skip this event
                self._malformed(f"batch {seq}: {e}")
                continue
            if ours and self.on_blocks is not None:
                self.on_blocks(wid, tuple(ours))

    def _clear(self) -> None:
        self.mapper.clear()
        self.index.clear_worker(self.worker_id)

    def _malformed(self, why: str) -> None:
        self.stats.malformed += 1
        log.warning("skipping an undecodable KV event of %s: %s", self.worker_id, why)
