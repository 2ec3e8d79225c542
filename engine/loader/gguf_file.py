"""A GGUF file's metadata and tensors, read fast; and dequantization of its common block types (csrc/gguf_dequant.c,
numpy where that cannot be built).

``gguf.GGUFReader`` (the ``gguf`` package, kept as the reference these are tested against in
tests/engine/test_gguf_file.py) builds a numpy view for every part of every metadata value: the
default model's 49,152 vocabulary strings and 48,900 merges took 6-11 s of each engine's, server's and
router's start. Here metadata values are decoded straight from the file's bytes (one ``struct`` call per
scalar, a slice per string) and tensors are memory-mapped views of their blocks, so reading the header
costs tens of milliseconds.

GGUF layout (little-endian, versions 2 and 3): ``"GGUF"``, version (u32), tensor count (u64), metadata
count (u64); each metadata entry is a key (u64 length + UTF-8), a value type (u32) and the value (an
array is an element type (u32), a count (u64) and the elements); each tensor info is a name, a number of
dimensions (u32), the dimensions (u64 each, fastest-varying first), a ggml type (u32) and an offset (u64)
into the data section, which starts at the next multiple of ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:   # the metadata reader needs no torch (a router reads only the metadata)
    import torch

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# metadata value types: struct format of a scalar, or None for string / array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# ggml types read here: name, elements per block, bytes per block
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),   # gpt-oss's experts: an e8m0 scale + 32 e2m1 values (decoded by gguf.quants)
}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can read (says what is wrong and where)."""


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]        # GGUF order: fastest-varying dimension first
    ggml_type: int
    offset: int                   # absolute, in the file
    n_bytes: int
    data: np.ndarray              # uint8 view of the tensor's bytes (memory-mapped)

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class GGUFFile:
    """``fields``: metadata key -> value (str, int, float, bool, or a list of them);
    ``tensors``: the tensor infos in file order, each with a memory-mapped view of its bytes."""

    def __init__(self, path: str) -> None:
        self.path = path
        # copy-on-write: writable views for torch.from_numpy, and the file is never written
        self._map = np.memmap(path, dtype=np.uint8, mode="c")
        buf = memoryview(self._map)
        self._buf, self._pos = buf, 0
        if bytes(buf[:4]) != MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (its first bytes are {bytes(buf[:4])!r}, not b'GGUF')")
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in SUPPORTED_VERSIONS:
            if self.version & 0xFFFF == 0:
                raise GGUFError(f"{path}: a big-endian GGUF file; only little-endian files are supported")
            raise GGUFError(f"{path}: GGUF version {self.version} is not supported (supported: 2, 3)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        self.field_types: dict[str, tuple[int, ...]] = {}
        for _ in range(n_fields):
            key = self._string()
            vtype = self._unpack("<I")
            self.fields[key] = self._value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            ndim = self._unpack("<I")
            shape = tuple(self._unpack("<Q") for _ in range(ndim))
            ggml_type, offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, shape, ggml_type, offset))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, shape, ggml_type, offset in infos:
            if ggml_type not in GGML_TYPES:
                raise GGUFError(f"{path}: tensor {name} has ggml type {ggml_type}, which this reader does not know")
            _, block, size = GGML_TYPES[ggml_type]
            n = 1
            for d in shape:
                n *= d
            if n % block:
                raise GGUFError(f"{path}: tensor {name} has {n} elements, not a multiple of its block of {block}")
            start, n_bytes = self.data_offset + offset, n // block * size
            if start + n_bytes > len(self._map):
                raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, shape, ggml_type, start, n_bytes,
                                           self._map[start:start + n_bytes]))
        del self._buf

    # -- decoding -----------------------------------------------------------------------
    def _unpack(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        except struct.error:
            raise GGUFError(f"{self.path}: the header ends early (at byte {self._pos}; truncated?)") from None
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._buf):
            raise GGUFError(f"{self.path}: a string at byte {self._pos} runs past the end of the file")
        s = str(self._buf[self._pos:end], "utf-8", "replace")
        self._pos = end
        return s

    def _value(self, vtype: int, key: str):
        if vtype in _SCALAR:
            self.field_types[key] = (vtype,)
            return self._unpack(_SCALAR[vtype])
        if vtype == _STRING:
            self.field_types[key] = (vtype,)
            return self._string()
        if vtype != _ARRAY:
            raise GGUFError(f"{self.path}: metadata {key!r} has value type {vtype}, which GGUF does not define")
        etype, count = self._unpack("<I"), self._unpack("<Q")
        self.field_types[key] = (vtype, etype)
        if etype in _NUMPY:   # numbers: one numpy read of the whole array
            dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise GGUFError(f"{self.path}: metadata {key!r} runs past the end of the file")
            out = np.frombuffer(self._buf[self._pos:end], dtype=dtype).tolist()
            self._pos = end
            return out
        if etype == _STRING:
            buf, pos, out = self._buf, self._pos, []
            unpack, size = struct.Struct("<Q").unpack_from, len(self._buf)
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise GGUFError(f"{self.path}: metadata {key!r} runs past the end of the file")
                out.append(str(buf[pos:pos + n], "utf-8", "replace"))
                pos += n
            self._pos = pos
            return out
        # arrays of arrays are legal GGUF but no model metadata we read uses them
        return [self._value(etype, key) for _ in range(count)]


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """``GGUFFile(path)``; inside :func:`gguf_headers_kept`, parsed once while the file stays the same (its
    inode, size and modification time): a model load read the default model's header four times (its block
    types for the quantization choice, the tokenizer, the weights, the shapes the CPU picks time), ~50 ms a
    parse of its 49,152-token vocabulary and merges. Callers only read the result."""
    if not _kept_depth:
        return GGUFFile(path)
    st = os.stat(path)
    return _read_gguf(os.fspath(path), st.st_ino, st.st_size, st.st_mtime_ns)


@contextlib.contextmanager
def gguf_headers_kept() -> Iterator[None]:
    """While it is open (engine/builder.py: the model load), :func:`read_gguf` keeps what it parsed; when the
    last one closes, the parses go (the default model's is 9 MB of Python objects, a 128k-token vocabulary's
    some 30 MB, which a serving process would otherwise hold for nothing)."""
    global _kept_depth
    with _kept_lock:
        _kept_depth += 1
    try:
        yield
    finally:
        with _kept_lock:
            _kept_depth -= 1
            if not _kept_depth:
                _read_gguf.cache_clear()


_kept_depth = 0
_kept_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _read_gguf(path: str, inode: int, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


# -- dequantization ------------------------------------------------------------------------
# In numpy: its ufuncs on these byte arrays run ~9x faster than the same torch ops (uint8 shifts and
# masks, float16 -> float32), and give the same float32 values (one multiply, then one add, each rounded).
# Loading the default model's 210 Q4_1 tensors took ~4 s in torch, ~0.5 s here, at every engine start.
def _blocks(t: GGUFTensor, size: int) -> np.ndarray:
    return np.asarray(t.data).reshape(-1, size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """Bytes ``at:at+2`` of each block, a little-endian float16 -> float32 (n, 1)."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values: the low nibbles are elements 0-15, the high ones 16-31."""
    out = np.empty((qs.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    return out


Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")   # what q4_blocks reads as 32-value blocks of 4-bit values
# blocks of 5-8 bits a value: kept as 8-bit blocks for ``quantization="gguf"`` (engine/loader/gguf_loader.py), never
# fewer bits than the file gives them (Q4_K_M files store attn_v and ffn_down of half their layers, and the
# output, as Q6_K)
WIDER_TYPES = frozenset({"Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q5_K", "Q6_K", "Q8_K"})


def _q4k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of packed 6-bit sub-block scales and minimums -> (sc, m), each (n, 8) float32."""
    d, m, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (hi & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def q4_blocks(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K tensor's blocks as stored: ``(q, d, m)`` with ``w = d * q + m``, q (blocks, 32)
    uint8 in 0..15, d and m (blocks, 1) float32. Q4_0 (d, nibbles; ``w = d * (q - 8)``) gives m = -8 d.
    Q4_K's 256-value super-blocks (fp16 d and dmin, eight 6-bit scales sc and minimums mn) are eight blocks
    of 32 with d = d * sc and m = -(dmin * mn), the float32 products its dequantization computes, so
    ``d * q + m`` is its ``d * sc * q - dmin * mn`` bit for bit."""
    import torch

    if t.type_name == "Q4_K":
        b = _blocks(t, 144)
        sc, mn = _q4k_scales(b[:, 4:16])
        d, m = _f16(b, 0) * sc, -(_f16(b, 2) * mn)                             # (n, 8)
        qs = b[:, 16:].reshape(-1, 4, 1, 32)                                    # 4 groups of 32 bytes
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 32)        # sub-blocks 2g, 2g + 1
        return torch.from_numpy(q), torch.from_numpy(d.reshape(-1, 1)), torch.from_numpy(m.reshape(-1, 1))
    if t.type_name == "Q4_1":
        b = _blocks(t, 20)
        return tuple(map(torch.from_numpy, (_nibbles(b[:, 4:]), _f16(b, 0), _f16(b, 2))))
    if t.type_name == "Q4_0":
        b = _blocks(t, 18)
        d = _f16(b, 0)
        return torch.from_numpy(_nibbles(b[:, 2:])), torch.from_numpy(d), torch.from_numpy(np.float32(-8.0) * d)
    raise ValueError(f"tensor {t.name} is {t.type_name}, not Q4_0, Q4_1 or Q4_K")


def q8_blocks(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's blocks as stored: ``(q, d)`` with ``w = d * q``, q (blocks, 32) int8, d (blocks, 1)
    float32."""
    import torch

    if t.type_name != "Q8_0":
        raise ValueError(f"tensor {t.name} is {t.type_name}, not Q8_0")
    b = _blocks(t, 34)
    return torch.from_numpy(np.ascontiguousarray(b[:, 2:]).view(np.int8)), torch.from_numpy(_f16(b, 0))


_C_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}   # what csrc/gguf_dequant.c decodes


@functools.cache
def _c_dequant():
    """csrc/gguf_dequant.c's ``gguf_dequant``, built on first use (engine/cpu_build.py); None where it cannot
    be built: dequantize() then decodes in numpy (the reason is logged once)."""
    import ctypes
    import logging
    import subprocess
    from pathlib import Path

    from engine.cpu_build import build
    try:
        lib = ctypes.CDLL(str(build(Path(__file__).parent / "csrc" / "gguf_dequant.c")))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logging.getLogger("engine.loader").warning("GGUF block decoding in numpy (no C kernel: %s)", exc)
        return None
    fn = lib.gguf_dequant
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    return fn


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """The tensor as float32 (see :func:`dequantize_numpy`); Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks
    through csrc/gguf_dequant.c where it builds, the same values bit for bit in one pass over every thread
    (the K types' numpy path is gguf-py's reference, many passes over each tensor)."""
    import torch

    fn = _c_dequant() if t.type_name in _C_TYPES else None
    if fn is None:
        return dequantize_numpy(t)
    raw = np.ascontiguousarray(np.asarray(t.data).reshape(-1))
    out = torch.empty(tuple(reversed(t.shape)), dtype=torch.float32)
    fn(raw.ctypes.data, raw.size // GGML_TYPES[t.ggml_type][2], _C_TYPES[t.type_name], out.data_ptr())
    return out


def dequantize_numpy(t: GGUFTensor) -> torch.Tensor:
    """The tensor as float32, shaped as its row-major array (``reversed(t.shape)``). F32/F16/BF16, Q4_0,
    Q4_1 and Q8_0 are decoded here in torch, exactly as ``gguf.quants.dequantize`` computes them (float32,
    the same operations in the same order); other types go through ``gguf.quants``."""
    import torch

    shape = tuple(reversed(t.shape))
    name = t.type_name
    raw = torch.from_numpy(np.asarray(t.data))
    if name == "F32":
        out = raw.view(torch.float32).clone()
    elif name == "F16":
        out = raw.view(torch.float16).float()
    elif name == "BF16":
        out = raw.view(torch.bfloat16).float()
    elif name == "Q8_0":
        b = _blocks(t, 34)
        out = torch.from_numpy(np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32) * _f16(b, 0))
    elif name == "Q4_0":
        b = _blocks(t, 18)
        q = (_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)
        out = torch.from_numpy(_f16(b, 0) * q)
    elif name == "Q4_1":
        b = _blocks(t, 20)
        out = _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32)
        out += _f16(b, 2)
        out = torch.from_numpy(out)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as reference
        arr = reference(np.asarray(t.data).reshape(-1, GGML_TYPES[t.ggml_type][2]),
                        GGMLQuantizationType(t.ggml_type))
        out = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return out.reshape(shape)
