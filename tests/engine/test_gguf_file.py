"""engine/loader/gguf_file.py against the ``gguf`` package's reader and dequantizers (the reference):
the default model's metadata and tensor infos read the same, every tensor dequantizes to exactly the
reference's floats, each block type decoded in torch matches ``gguf.quants`` on random blocks, and a
damaged file is refused with a message saying what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as reference_dequantize

from engine.loader.gguf_file import (GGML_TYPES, GGUFError, GGUFFile, GGUFTensor, dequantize, gguf_headers_kept,
                                    read_gguf)
from engine.loader.gguf_loader import default_model_path


@pytest.fixture(scope="module")
def both():
    path = default_model_path()
    return GGUFFile(path), GGUFReader(path)


@pytest.mark.slow
def test_metadata_and_tensor_infos_match_the_reference_reader(both):
    ours, ref = both
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(ref_fields)
    for key, field in ref_fields.items():
        want = field.contents()
        got = ours.fields[key]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=0, abs=0), key
        else:
            assert got == want, key
        assert ours.field_types[key] == tuple(int(t) for t in field.types), key
    assert len(ours.tensors) == len(ref.tensors) == 272
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.name, t.shape, t.ggml_type, t.n_bytes) == (r.name, tuple(int(d) for d in r.shape),
                                                             int(r.tensor_type), int(r.n_bytes))
        assert t.offset == int(r.data_offset)   # absolute in the file, as the reference gives it
        assert bytes(t.data[:64]) == bytes(np.asarray(r.data).reshape(-1).view(np.uint8)[:64])


@pytest.mark.slow
def test_every_tensor_dequantizes_to_the_reference_floats(both):
    ours, ref = both
    seen = set()
    for t, r in zip(ours.tensors, ref.tensors):
        got = dequantize(t)
        want = np.asarray(reference_dequantize(r.data, r.tensor_type), dtype=np.float32)
        want = want.reshape([int(d) for d in reversed(r.shape)])
        assert tuple(got.shape) == want.shape, t.name
        assert torch.equal(got, torch.from_numpy(want.copy())), t.name
        seen.add(t.type_name)
    assert seen == {"F32", "Q4_1", "Q8_0"}   # the default model's types


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "Q6_K", "MXFP4"])
def test_each_block_type_matches_the_reference_on_random_blocks(name, tmp_path):
    code = next(c for c, (n, _, _) in GGML_TYPES.items() if n == name)
    _, block, size = GGML_TYPES[code]
    rng = np.random.default_rng(code)
    n_blocks = 64
    raw = rng.integers(0, 256, size=n_blocks * size, dtype=np.uint8)
    if name in ("Q4_0", "Q4_1", "Q8_0", "Q6_K"):   # finite float16 scales: bytes 0-1 (and 2-3 for Q4_1's min)
        blocks = raw.reshape(n_blocks, size)
        scale_at = {"Q6_K": [size - 2]}.get(name, [0, 2] if name == "Q4_1" else [0])
        for at in scale_at:
            blocks[:, at:at + 2] = np.frombuffer(rng.uniform(-2, 2, n_blocks).astype(np.float16).tobytes(),
                                                 dtype=np.uint8).reshape(n_blocks, 2)
    elif name == "F16":
        raw = rng.uniform(-4, 4, n_blocks * size // 2).astype(np.float16).view(np.uint8)
    elif name == "MXFP4":   # e8m0 scales within float32's range (2^-27 .. 2^22), any 4-bit values
        raw.reshape(n_blocks, size)[:, 0] = rng.integers(100, 150, n_blocks)
    elif name == "BF16":
        raw = (rng.uniform(-4, 4, n_blocks * size // 2).astype(np.float32).view(np.uint32) >> 16)
        raw = raw.astype(np.uint16).view(np.uint8)
    n = n_blocks * block
    t = GGUFTensor("x", (n // 4, 4), code, 0, raw.nbytes, raw.copy())
    got = dequantize(t)
    want = np.asarray(reference_dequantize(raw.reshape(4, -1), GGMLQuantizationType(code)), dtype=np.float32)
    assert torch.equal(got, torch.from_numpy(want.reshape(4, n // 4))), name


def test_a_damaged_file_is_refused_with_what_is_wrong(tmp_path):
    data = open(default_model_path(), "rb").read(1 << 20)
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(str(bad_magic))
    version = tmp_path / "version.gguf"
    version.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFError, match="version 7 is not supported"):
        GGUFFile(str(version))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:200_000])   # inside the vocabulary
    with pytest.raises(GGUFError, match="past the end|ends early"):
        GGUFFile(str(truncated))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data)           # metadata complete, tensor data missing
    with pytest.raises(GGUFError, match="runs past the end of the file"):
        GGUFFile(str(header_only))


def test_read_gguf_parses_a_file_once_until_it_changes(tmp_path):
    """Inside gguf_headers_kept (a model load) reads of one file share one parse; a file rewritten (or replaced)
    at that path is parsed again, a damaged one is refused each time, not remembered as the last good parse;
    once the last one closes, nothing is kept."""
    path = tmp_path / "model.gguf"
    data = open(default_model_path(), "rb").read()
    path.write_bytes(data)
    with gguf_headers_kept():
        first = read_gguf(path)
        with gguf_headers_kept():                  # nested: the inner one closing keeps the outer's parses
            assert read_gguf(str(path)) is first
        assert read_gguf(path) is first
        fields = dict(first.fields)
        path.write_bytes(data + b"\0" * 64)        # rewritten: another size
        again = read_gguf(path)
        assert again is not first and again.fields == fields
        path.write_bytes(data[:200_000])           # now damaged
        for _ in range(2):
            with pytest.raises(GGUFError, match="past the end|ends early"):
                read_gguf(path)
        path.write_bytes(data)
        kept = read_gguf(path)
    assert read_gguf(path) is not kept and read_gguf(path) is not read_gguf(path)   # closed: parsed each time


@pytest.mark.slow
def test_a_model_load_parses_its_gguf_header_once(monkeypatch):
    """The block types, the tokenizer, the weights and the CPU picks of one engine load share one parse."""
    import engine.builder as builder
    from engine import EngineConfig
    from engine.loader import gguf_file, load_model_files

    parsed = []

    class Counting(gguf_file.GGUFFile):
        def __init__(self, path):
            parsed.append(path)
            super().__init__(path)
    monkeypatch.setattr(gguf_file, "GGUFFile", Counting)
    monkeypatch.setattr(builder, "load_model_files", load_model_files)   # the real loader, not the suite's cache
    builder.load_model(EngineConfig(kv_cache_tokens=1024, dtype="auto"))
    assert len(parsed) == 1
