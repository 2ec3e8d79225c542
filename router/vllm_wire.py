"""vLLM's KV-event wire format: the msgpack codec both our publisher and our consumer use.

vLLM, SGLang (and TensorRT-LLM) workers publish their prefix-cache changes on a ZMQ PUB socket as
three-frame messages ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian integer counting
batches from 0, ``payload`` one msgpack ``EventBatch``. Dynamo's KV router and llm-d's precise
prefix scorer consume exactly these, so speaking the format lets agentrt's router follow such
workers (``router/vllm_consumer.py``) and lets those routers follow agentrt workers
(``router/vllm_publisher.py``). A second socket, ROUTER, serves replays (see the consumer).

Reference, read for the field lists and encodings (no code taken; vLLM's own structs are not imported:
the fields' types are restated here as msgspec structs, ``_StoredWire`` and the like, which
``decode_batch`` checks each event against):

* vllm-project/vllm ``vllm/distributed/kv_events.py``: ``EventBatch(ts: float, events: list,
  data_parallel_rank: int | None = None)``; ``KVCacheEvent`` is a msgspec ``tag=True`` union, the
  tag being the class name; ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None, ...)``,
  ``BlockRemoved(block_hashes, medium, group_idx=None)``, ``AllBlocksCleared()``; block hashes are
  ``ExternalBlockHash = bytes | int``; ``MEDIUM_GPU = "GPU"``; ``omit_defaults=True`` drops trailing
  fields left at their default.
* Two encodings are in the wild. **array**: structs with ``array_like=True`` are msgpack arrays in
  field order, a tagged event's first element being its tag: ``[ts, [["BlockStored", hashes,
  parent, token_ids, block_size, lora_id, ...], ...], dp_rank?]`` (older vLLM; SGLang's
  ``python/sglang/srt/disaggregation/kv_events.py``, whose ``BlockStored`` ends at ``lora_id`` and
  whose ``BlockRemoved`` has no ``medium``; llm-d's ``pkg/kvcache/kvevents/events.go`` decodes
  this). **map**: events without ``array_like`` are msgpack maps whose ``"type"`` key holds the
  tag, ``{"type": "BlockStored", "block_hashes": ..., ...}`` (newer vLLM); the newest vLLM also
  encodes the batch itself as a map ``{"ts", "events", "data_parallel_rank"}``. ai-dynamo/dynamo
  ``lib/kv-router/src/zmq_wire.rs`` accepts both event encodings inside an array batch.

``decode_batch`` accepts all of these, bounded (msgpack's unpack limits) and strict on the fields it
uses (anything else raises ``VllmDecodeError`` naming the event, the field and what it must be; the
consumer counts, logs and skips the batch, as contract 2 asks).
Unknown event types are skipped (counted), so a newer producer cannot blind us. Hash values are
normalised: ints to unsigned 64-bit (producers send both signs), bytes kept as bytes.
``encode_batch`` writes either encoding; block hashes go out as signed 64-bit ints, which every
consumer above decodes (Go's ``int64`` in llm-d, Rust's ``i64 | u64`` in Dynamo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Sequence

import msgpack
import msgspec
from msgspec import Meta

ExternalHash = int | bytes
Encoding = Literal["array", "map"]
ENCODINGS: tuple[str, ...] = ("array", "map")

_U64 = 1 << 64
_MAX_HASH_BYTES = 64
END_SEQ = -1  # a replay's last reply carries seq -1 and an empty payload
MEDIUM_GPU = "GPU"


class VllmDecodeError(ValueError):
    """Bytes that are not a valid vLLM KV-event frame or batch."""


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the worker's prefix cache: ``token_ids`` holds ``block_size`` tokens per
    hash, in order; ``parent`` is the hash of the block before the first one (None: a prefix start)."""

    block_hashes: tuple[ExternalHash, ...]
    parent: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type this codec does not know, skipped


def is_device_medium(medium: str | None) -> bool:
    """Whether an event's ``medium`` is the GPU cache (absent means GPU, as in vLLM)."""
    return medium is None or medium.upper() == MEDIUM_GPU


# ------------------------------------------------------------------ frames


def zmq_endpoint(url: str) -> str:
    """``zmq://host:port`` as ZMQ's ``tcp://host:port``; ``tcp://``, ``ipc://`` and ``inproc://`` as they are."""
    if url.startswith("zmq://"):
        return "tcp://" + url.removeprefix("zmq://")
    if url.startswith(("tcp://", "ipc://", "inproc://")):
        return url
    raise ValueError(f"a KV-event endpoint is zmq://HOST:PORT (or tcp://, ipc://, inproc://), got {url!r}")


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise VllmDecodeError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ------------------------------------------------------------------ decoding

# The fields' types, checked by msgspec after msgpack's unpack has bounded the payload. A msgpack integer
# lies in [-2**63, 2**64) already, so any int is a 64-bit hash (normalised to unsigned by ``_u64``).
Hash = int | Annotated[bytes, Meta(min_length=1, max_length=_MAX_HASH_BYTES)]
TokenId = Annotated[int, Meta(ge=0, lt=1 << 32)]


def _u64(h: ExternalHash) -> ExternalHash:
    return h % _U64 if type(h) is int else h


class _StoredWire(msgspec.Struct):
    """``BlockStored``'s fields as vLLM names them (unknown ones ignored: a newer producer's)."""

    block_hashes: list[Hash]
    token_ids: list[TokenId]
    block_size: Annotated[int, Meta(ge=1)]
    parent_block_hash: Hash | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block: None, or the keys (a list) mixed into its hash
    group_idx: int | None = None

    def event(self) -> BlockStored:
        hashes, size = tuple(map(_u64, self.block_hashes)), self.block_size
        if len(self.token_ids) != len(hashes) * size:
            raise VllmDecodeError(f"BlockStored has {len(self.token_ids)} token ids for {len(hashes)} blocks of "
                                  f"{size} tokens (expected {len(hashes) * size})")
        extra = None if self.extra_keys is None else tuple(tuple(k) if isinstance(k, list) else k
                                                           for k in self.extra_keys)
        parent = None if self.parent_block_hash is None else _u64(self.parent_block_hash)
        return BlockStored(hashes, parent, tuple(self.token_ids), size, self.lora_id, self.medium, self.lora_name,
                           extra, self.group_idx)


class _RemovedWire(msgspec.Struct):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None

    def event(self) -> BlockRemoved:
        return BlockRemoved(tuple(map(_u64, self.block_hashes)), self.medium, self.group_idx)


class _ClearedWire(msgspec.Struct):
    def event(self) -> AllBlocksCleared:
        return AllBlocksCleared()


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[Any]  # each event on its own (``_event``): one of an unknown type is skipped, not an error
    data_parallel_rank: int | None = None


class _ArrayBatch(_MapBatch, array_like=True):
    """``[ts, events, dp_rank?]`` (trailing elements a newer producer adds are ignored)."""


# Field order of the array encoding (vLLM's declaration order); trailing ones may be omitted.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_WIRE = {"BlockStored": (_STORED_FIELDS, _StoredWire), "BlockRemoved": (_REMOVED_FIELDS, _RemovedWire),
         "AllBlocksCleared": ((), _ClearedWire)}


def _convert(obj: Any, typ: type, what: str) -> Any:
    try:  # builtin_types: a str is never taken for base64 bytes
        return msgspec.convert(obj, typ, builtin_types=(bytes,))
    except msgspec.ValidationError as e:
        raise VllmDecodeError(f"{what}: {e}") from None


def _event(raw: Any, i: int) -> Event | None:
    """One event in either encoding; None for an event type we do not know."""
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag = raw["type"]
    else:
        raise VllmDecodeError(f"events[{i}] must be an array that starts with its type tag or a map with a "
                              f"string 'type', got {type(raw).__name__}")
    if tag not in _WIRE:
        return None
    names, wire = _WIRE[tag]
    fields = dict(zip(names, raw[1:])) if isinstance(raw, list) else raw
    return _convert(fields, wire, f"events[{i}] ({tag})").event()


def unpack_bounded(data: bytes, what: str, error: type[ValueError], max_bytes: int, *, payload: str = "payload",
                   max_array_len: int, max_map_len: int, max_bin_len: int) -> Any:
    """``data`` as one msgpack object (``what``: an event, a batch) of at most ``max_bytes``, within msgpack's
    limits (arrays, maps and bin values as given, strings of 4096 bytes, no ext values); ``error`` naming what
    is wrong otherwise (this module's ``decode_batch`` and router/events.py's ``decode_event``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise error(f"{payload} must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise error(f"{what} of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                               max_array_len=max_array_len, max_map_len=max_map_len, max_str_len=4096,
                               max_bin_len=max_bin_len, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise error(f"not a msgpack {what}: {type(e).__name__}: {e}") from None


def decode_batch(data: bytes, max_bytes: int = 16 << 20, max_items: int = 1 << 20) -> EventBatch:
    """Decode and validate one ``EventBatch`` payload (either encoding); ``VllmDecodeError`` otherwise,
    naming the field and what it must be."""
    obj = unpack_bounded(data, "batch", VllmDecodeError, max_bytes, max_array_len=max_items, max_map_len=64,
                         max_bin_len=_MAX_HASH_BYTES)
    batch = _convert(obj, _ArrayBatch if isinstance(obj, list) else _MapBatch, "batch")
    decoded = [_event(e, i) for i, e in enumerate(batch.events)]
    known = tuple(e for e in decoded if e is not None)
    return EventBatch(batch.ts, known, batch.data_parallel_rank, len(decoded) - len(known))


# ------------------------------------------------------------------ encoding


def _signed(h: int) -> int:
    return h - _U64 if h >= 1 << 63 else h


def _wire_hash(h: ExternalHash) -> ExternalHash:
    return _signed(h) if isinstance(h, int) else h


def _event_fields(event: Event) -> tuple[str, dict[str, Any]]:
    if isinstance(event, BlockStored):
        return "BlockStored", {
            "block_hashes": [_wire_hash(h) for h in event.block_hashes],
            "parent_block_hash": None if event.parent is None else _wire_hash(event.parent),
            "token_ids": list(event.token_ids), "block_size": event.block_size, "lora_id": event.lora_id,
            "medium": event.medium, "lora_name": event.lora_name,
            # omitted at its default (None), as msgspec's omit_defaults does
            **({} if event.extra_keys is None else {"extra_keys": [None if k is None else list(k)
                                                                   for k in event.extra_keys]})}
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", {"block_hashes": [_wire_hash(h) for h in event.block_hashes], "medium": event.medium}
    return "AllBlocksCleared", {}


def encode_batch(events: Sequence[Event], ts: float, encoding: Encoding = "array") -> bytes:
    """One ``EventBatch`` payload: ``array`` (array batch, array events) or ``map`` (array batch, events
    as maps with ``type``), the two layouts every consumer named in the module docstring decodes."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    wire = []
    for event in events:
        tag, fields = _event_fields(event)
        wire.append([tag, *fields.values()] if encoding == "array" else {"type": tag, **fields})
    return msgpack.packb([ts, wire])
