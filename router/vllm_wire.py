"""vLLM's KV-event wire format: the msgpack codec both our publisher and our consumer use.

vLLM, SGLang (and TensorRT-LLM) workers publish their prefix-cache changes on a ZMQ PUB socket as
three-frame messages ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian integer counting
batches from 0, ``payload`` one msgpack ``EventBatch``. Dynamo's KV router and llm-d's precise
prefix scorer consume exactly these, so speaking the format lets agentrt's router follow such
workers (``router/vllm_consumer.py``) and lets those routers follow agentrt workers
(``router/vllm_publisher.py``). A second socket, ROUTER, serves replays (see the consumer).

Reference, read for the field lists and encodings (no code taken; plain ``msgpack`` here, not
``msgspec``):

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

``decode_batch`` accepts all of these, bounded and strict on the fields it uses (anything else
raises ``VllmDecodeError``; the consumer counts, logs and skips the batch, as contract 2 asks).
Unknown event types are skipped (counted), so a newer producer cannot blind us. Hash values are
normalised: ints to unsigned 64-bit (producers send both signs), bytes kept as bytes.
``encode_batch`` writes either encoding; block hashes go out as signed 64-bit ints, which every
consumer above decodes (Go's ``int64`` in llm-d, Rust's ``i64 | u64`` in Dynamo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import msgpack

ExternalHash = int | bytes
Encoding = Literal["array", "map"]
ENCODINGS: tuple[str, ...] = ("array", "map")

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _hash(value: Any, what: str) -> ExternalHash:
    if _is_int(value):
        if not _I64_MIN <= value < _U64:
            raise VllmDecodeError(f"{what} {value} is not a 64-bit integer")
        return value % _U64
    if isinstance(value, bytes):
        if not 0 < len(value) <= _MAX_HASH_BYTES:
            raise VllmDecodeError(f"{what} must be 1..{_MAX_HASH_BYTES} bytes, got {len(value)}")
        return value
    raise VllmDecodeError(f"{what} must be an integer or bytes, got {type(value).__name__}")


def _hashes(value: Any) -> tuple[ExternalHash, ...]:
    if not isinstance(value, list):
        raise VllmDecodeError(f"block_hashes must be a list, got {type(value).__name__}")
    return tuple(_hash(h, "block hash") for h in value)


def _opt(value: Any, kind: type, what: str) -> Any:
    if value is None:
        return None
    if kind is int and not _is_int(value) or kind is not int and not isinstance(value, kind):
        raise VllmDecodeError(f"{what} must be {kind.__name__} or None, got {type(value).__name__}")
    return value


def _stored(f: dict[str, Any]) -> BlockStored:
    for name in ("block_hashes", "token_ids", "block_size"):
        if name not in f:
            raise VllmDecodeError(f"BlockStored lacks {name}")
    hashes = _hashes(f["block_hashes"])
    tokens = f["token_ids"]
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < (1 << 32) for t in tokens):
        raise VllmDecodeError("token_ids must be a list of unsigned 32-bit integers")
    size = f["block_size"]
    if not _is_int(size) or size < 1:
        raise VllmDecodeError(f"block_size must be an integer >= 1, got {size!r}")
    if len(tokens) != len(hashes) * size:
        raise VllmDecodeError(f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of "
                              f"{size} tokens (expected {len(hashes) * size})")
    parent = f.get("parent_block_hash")
    extra = f.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise VllmDecodeError("extra_keys must be a list or None")
    if extra is not None:  # one entry per block: None, or the keys (a list on the wire) mixed into its hash
        extra = tuple(tuple(k) if isinstance(k, list) else k for k in extra)
    return BlockStored(hashes, None if parent is None else _hash(parent, "parent_block_hash"), tuple(tokens), size,
                       _opt(f.get("lora_id"), int, "lora_id"), _opt(f.get("medium"), str, "medium"),
                       _opt(f.get("lora_name"), str, "lora_name"), extra,
                       _opt(f.get("group_idx"), int, "group_idx"))


def _removed(f: dict[str, Any]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise VllmDecodeError("BlockRemoved lacks block_hashes")
    return BlockRemoved(_hashes(f["block_hashes"]), _opt(f.get("medium"), str, "medium"),
                        _opt(f.get("group_idx"), int, "group_idx"))


# Field order of the array encoding (vLLM's declaration order); trailing ones may be omitted.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_DECODERS = {"BlockStored": (_STORED_FIELDS, _stored), "BlockRemoved": (_REMOVED_FIELDS, _removed),
             "AllBlocksCleared": ((), lambda f: AllBlocksCleared())}


def _event(raw: Any) -> Event | None:
    """One event in either encoding; None for an event type we do not know."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise VllmDecodeError("an array-encoded event must start with its type tag")
        tag, values = raw[0], raw[1:]
        if tag not in _DECODERS:
            return None
        names, decode = _DECODERS[tag]
        return decode(dict(zip(names, values)))
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise VllmDecodeError("a map-encoded event needs a string 'type'")
        if tag not in _DECODERS:
            return None
        return _DECODERS[tag][1](raw)
    raise VllmDecodeError(f"an event must be an array or a map, got {type(raw).__name__}")


def decode_batch(data: bytes, max_bytes: int = 16 << 20, max_items: int = 1 << 20) -> EventBatch:
    """Decode and validate one ``EventBatch`` payload (either encoding); ``VllmDecodeError`` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise VllmDecodeError(f"payload must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise VllmDecodeError(f"batch of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                              max_array_len=max_items, max_map_len=64, max_str_len=4096,
                              max_bin_len=_MAX_HASH_BYTES, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise VllmDecodeError(f"not a msgpack batch: {type(e).__name__}: {e}") from None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise VllmDecodeError("an array-encoded batch needs [ts, events, ...]")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise VllmDecodeError("a map-encoded batch needs 'ts' and 'events'")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise VllmDecodeError(f"a batch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise VllmDecodeError(f"ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise VllmDecodeError(f"events must be a list, got {type(events).__name__}")
    decoded = [_event(e) for e in events]
    known = tuple(e for e in decoded if e is not None)
    return EventBatch(float(ts), known, _opt(rank, int, "data_parallel_rank"), len(decoded) - len(known))


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
