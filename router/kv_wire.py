"""The wire format of KV pages moving between workers (``POST /internal/kv/blocks``, router/kv_moves.py).

Request (JSON, ``KVPullRequest``): the prompt's token ids (full blocks only), its cache salt, the
first block wanted (``start``), the puller's block hashes of blocks ``start ..`` (contract 1, from
the puller's own seed) and the puller's ``WireLayout``. The holder refuses with 409 and a message
naming the difference when its layout differs (another model, dtype, page size, layer count, KV
heads, head dim or pool layout) or its first block's hash differs (another model id or cache salt).

Response (``application/octet-stream``), in order:

1. ``MAGIC``, a little-endian u32 length, then that many bytes of JSON: the holder's ``StreamHeader``
   (its layout and the first block it sends);
2. one record per block, in order from ``start``: ``RECORD`` = kind (1), block hash (u64), CRC-32 of
   the payload (u32), payload bytes (u64), then the payload: the page in the pool's own layout
   (``KVCache.read_page``: ``[2, layers, *page]`` of ``page_dtype``; int8 pools: bytes with the scales);
3. an end record: kind 2, hash 0, crc 0, and the number of pages sent in the bytes field.

A stream that stops before its end record was cut: the pages received whole and verified are kept,
the rest is recomputed. ``StreamReader`` parses a stream fed in arbitrary pieces and checks every
record: hash against the puller's own hashes of its token ids, length against the layout, CRC-32
against the bytes. Any failure raises ``KVWireError`` naming the block.
"""

from __future__ import annotations

import struct
import zlib
from typing import Iterator

import msgspec
import torch

MAGIC = b"AGKVMV01"
_LEN = struct.Struct("<I")
RECORD = struct.Struct("<BQIQ")   # kind, block hash, crc32, payload bytes
PAGE, END = 1, 2
MAX_HEADER_BYTES = 1 << 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


class KVWireError(ValueError):
    """A KV stream (or pull request) that is not what it claims: its message names the block or field."""


class WireLayout(msgspec.Struct, frozen=True):
    """``engine.kv_move.KVLayout`` on the wire."""

    model_fingerprint: str
    page_dtype: str
    page_shape: list[int]
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str

    @classmethod
    def of(cls, layout) -> "WireLayout":
        return cls(layout.model_fingerprint, layout.page_dtype, list(layout.page_shape), layout.page_size,
                   layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.layout)

    def mismatch(self, other: "WireLayout") -> str | None:
        """None when equal, else the fields that differ (``other``'s value vs this one's)."""
        diffs = [f"{name} {getattr(other, name)!r} vs {getattr(self, name)!r}"
                 for name in self.__struct_fields__ if getattr(self, name) != getattr(other, name)]
        return "; ".join(diffs) or None

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * DTYPES[self.page_dtype].itemsize


class KVPullRequest(msgspec.Struct, frozen=True):
    token_ids: list[int]
    start: int
    hashes: list[int]          # the puller's hashes of blocks start .. start + len(hashes)
    layout: WireLayout
    cache_salt: str = ""


class StreamHeader(msgspec.Struct, frozen=True):
    layout: WireLayout
    start: int


_json = msgspec.json.Encoder()


def encode_request(req: KVPullRequest) -> bytes:
    return _json.encode(req)


def decode_request(data: bytes) -> KVPullRequest:
    """The request, typed; ``KVWireError`` naming the field otherwise, or when its lists disagree."""
    try:
        req = msgspec.json.decode(data, type=KVPullRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise KVWireError(f"malformed KV pull request: {exc}") from None
    if req.layout.page_dtype not in DTYPES:
        raise KVWireError(f"page_dtype {req.layout.page_dtype!r} is not one of {sorted(DTYPES)}")
    if req.start < 0 or req.layout.page_size <= 0:
        raise KVWireError("start must be >= 0 and page_size > 0")
    if (req.start + len(req.hashes)) * req.layout.page_size > len(req.token_ids):
        raise KVWireError(f"{len(req.hashes)} hashes from block {req.start} need more than the "
                          f"{len(req.token_ids)} token ids sent")
    return req


def encode_header(layout: WireLayout, start: int) -> bytes:
    body = _json.encode(StreamHeader(layout, start))
    return MAGIC + _LEN.pack(len(body)) + body


def encode_page(block_hash: int, page: torch.Tensor) -> bytes:
    """One record: its header and the page's bytes (a copy)."""
    raw = page.contiguous().reshape(-1).view(torch.uint8).numpy()
    return RECORD.pack(PAGE, block_hash, zlib.crc32(raw), raw.nbytes) + raw.tobytes()


def encode_end(sent: int) -> bytes:
    return RECORD.pack(END, 0, 0, sent)


class StreamReader:
    """Parses one KV stream against what the puller expects: its layout, and its own hashes of blocks
    ``start ..``. ``feed`` returns the pages completed by the bytes given, as tensors of the layout's
    dtype and shape; ``ended`` once the end record came."""

    def __init__(self, layout: WireLayout, start: int, hashes: list[int]) -> None:
        self.layout, self.start, self.hashes = layout, start, hashes
        self._buf = bytearray()
        self.header: StreamHeader | None = None
        self.received = 0
        self.ended = False
        self.error: KVWireError | None = None

    def feed(self, data: bytes) -> list[torch.Tensor]:
        """The pages ``data`` completes. A bad record raises ``KVWireError``; when pages came before it
        in the same call they are returned first and the error is kept in ``error`` (raised by the next
        ``feed``): verified pages are never lost to a later bad one."""
        if self.error is not None:
            raise self.error
        self._buf += data
        out: list[torch.Tensor] = []
        try:
            if self.header is None and not self._read_header():
                return out
            while not self.ended:
                page = self._read_record()
                if page is None:
                    break
                out.append(page)
        except KVWireError as exc:
            self.error = exc
            if not out:
                raise
        return out

    def _read_header(self) -> bool:
        if len(self._buf) < len(MAGIC) + _LEN.size:
            return False
        if self._buf[:len(MAGIC)] != MAGIC:
            raise KVWireError("the response is not a KV stream (bad magic)")
        (n,) = _LEN.unpack_from(self._buf, len(MAGIC))
        if n > MAX_HEADER_BYTES:
            raise KVWireError(f"KV stream header of {n} bytes (at most {MAX_HEADER_BYTES})")
        end = len(MAGIC) + _LEN.size + n
        if len(self._buf) < end:
            return False
        try:
            header = msgspec.json.decode(bytes(self._buf[len(MAGIC) + _LEN.size:end]), type=StreamHeader)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise KVWireError(f"malformed KV stream header: {exc}") from None
        why = self.layout.mismatch(header.layout)
        if why:
            raise KVWireError(f"the holder's KV layout differs: {why}")
        if header.start != self.start:
            raise KVWireError(f"the stream starts at block {header.start}, {self.start} was asked for")
        self.header = header
        del self._buf[:end]
        return True

    def _read_record(self) -> torch.Tensor | None:
        if len(self._buf) < RECORD.size:
            return None
        kind, h, crc, n = RECORD.unpack_from(self._buf)
        block = self.start + self.received
        if kind == END:
            if n != self.received:
                raise KVWireError(f"the end record counts {n} pages, {self.received} came")
            self.ended = True
            del self._buf[:RECORD.size]
            return None
        if kind != PAGE:
            raise KVWireError(f"block {block}: unknown record kind {kind}")
        if self.received >= len(self.hashes):
            raise KVWireError(f"block {block}: more pages than the {len(self.hashes)} asked for")
        if h != self.hashes[self.received]:
            raise KVWireError(f"block {block}: hash {h:016x}, the prompt's is {self.hashes[self.received]:016x}")
        if n != self.layout.page_bytes:
            raise KVWireError(f"block {block}: {n} payload bytes, a page is {self.layout.page_bytes}")
        if len(self._buf) < RECORD.size + n:
            return None
        payload = self._buf[RECORD.size:RECORD.size + n]                # a copy the page keeps
        del self._buf[:RECORD.size + n]
        if zlib.crc32(payload) != crc:
            raise KVWireError(f"block {block}: checksum mismatch (the page's bytes changed in transit)")
        self.received += 1
        dtype = DTYPES[self.layout.page_dtype]
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(self.layout.page_shape)


def records(stream: bytes) -> Iterator[tuple[int, int, int, int]]:
    """(offset of the payload, kind, hash, payload bytes) of each record of a whole stream (tests and tools
    that need to find a page in a stream)."""
    (n,) = _LEN.unpack_from(stream, len(MAGIC))
    pos = len(MAGIC) + _LEN.size + n
    while pos + RECORD.size <= len(stream):
        kind, h, _, size = RECORD.unpack_from(stream, pos)
        yield pos + RECORD.size, kind, h, size
        if kind == END:
            return
        pos += RECORD.size + size


__all__ = ["DTYPES", "KVPullRequest", "KVWireError", "MAGIC", "RECORD", "StreamHeader", "StreamReader",
           "WireLayout", "decode_request", "encode_end", "encode_header", "encode_page", "encode_request", "records"]
