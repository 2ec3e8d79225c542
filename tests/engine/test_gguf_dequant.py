"""engine/loader/csrc/gguf_dequant.c against the numpy decoder it replaces at load (``dequantize_numpy``:
its own for Q4_0 / Q4_1 / Q8_0, gguf-py's for the K types) and against gguf-py's ``gguf.quants.dequantize``:
the same float32 values bit for bit, on every block tensor of the default model and on random blocks of each
type (negative, zero and subnormal scales; the K types' packed 6-bit scales and high bits all random)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_reference

from engine.loader import resolve_model
from engine.loader.gguf_file import GGML_TYPES, GGUFFile, GGUFTensor, _c_dequant, dequantize, dequantize_numpy

TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
SCALE_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)   # -0.0 and 0.0 apart, NaN payloads compared


@pytest.fixture(scope="module")
def kernel():
    fn = _c_dequant()
    if fn is None:
        pytest.skip("no C compiler: the loader decodes in numpy (that path is the reference here)")
    return fn


def random_tensor(name: str, rows: int, cols: int, seed: int) -> GGUFTensor:
    ggml_type = TYPES[name]
    _, per, size = GGML_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in SCALE_AT[name]:   # finite float16 scales (random bytes would hold NaNs), some zero or subnormal
        scales = np.concatenate([rng.normal(0, 0.05, n - 4), [0.0, -0.0, 3e-8, -0.02]]).astype(np.float16)
        raw[:, at:at + 2] = rng.permutation(scales).view(np.uint8).reshape(n, 2)
    return GGUFTensor(name, (cols, rows), ggml_type, 0, raw.size, raw.reshape(-1))


@pytest.mark.parametrize("name", sorted(TYPES))
def test_random_blocks_decode_as_numpy_and_gguf_py(kernel, name):
    t = random_tensor(name, 96, 256, seed=len(name))
    got = dequantize(t)
    assert got.shape == (96, 256)
    assert torch.equal(bits(got), bits(dequantize_numpy(t)))
    ref = gguf_reference(t.data.reshape(-1, GGML_TYPES[t.ggml_type][2]), GGMLQuantizationType(t.ggml_type))
    assert torch.equal(bits(got), bits(torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)).reshape(96, 256)))


@pytest.mark.slow
def test_every_block_tensor_of_the_default_model(kernel):
    reader = GGUFFile(resolve_model(None)[0])
    blocks = [t for t in reader.tensors if t.type_name in TYPES]
    assert len(blocks) >= 200                       # the default model's Q4_1 layers (and any Q8_0)
    for t in blocks:
        assert torch.equal(bits(dequantize(t)), bits(dequantize_numpy(t))), t.name


def test_a_planted_rounding_would_be_seen(kernel):
    """The comparison above can fail: one ulp on one weight is a difference."""
    t = random_tensor("Q4_1", 32, 64, seed=3)
    got = dequantize(t)
    got.view(-1)[5] = torch.nextafter(got.view(-1)[5], torch.tensor(float("inf")))
    assert not torch.equal(bits(got), bits(dequantize_numpy(t)))
