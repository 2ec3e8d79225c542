"""engine/loader/mxfp4.py against transformers' own MXFP4 decoder (``convert_moe_packed_tensors``), bit for bit,
on random blocks: every e2m1 code, scales across float32's range, several experts, rows and groups."""

import pytest
import torch

from engine.loader.mxfp4 import decode_mxfp4, decode_mxfp4_state

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _random(E=3, R=10, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g),
            torch.randint(100, 150, (E, R, G), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decodes_as_transformers(dtype):
    blocks, scales = _random()
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = decode_mxfp4(blocks, scales, dtype)
    assert got.shape == (3, 4 * 32, 10) and got.dtype == dtype
    assert torch.equal(got, want)


def test_mxfp4_state_pairs_blocks_with_scales():
    blocks, scales = _random()
    state = decode_mxfp4_state({"x.down_proj_blocks": blocks, "x.down_proj_scales": scales,
                                "x.down_proj_bias": torch.ones(3, 10, dtype=torch.float64)}, torch.float32)
    assert sorted(state) == ["x.down_proj", "x.down_proj_bias"]
    assert state["x.down_proj_bias"].dtype == torch.float32
    with pytest.raises(ValueError, match="x.down_proj_blocks has no x.down_proj_scales"):
        decode_mxfp4_state({"x.down_proj_blocks": blocks}, torch.float32)
