"""K-quant GGUF files on the block kernel (``quantization="gguf"``): Q4_K tensors as 4-bit blocks of 32, exactly
their dequantization before the kernel's float16 scales; tensors in wider blocks (Q6_K, Q8_0, ...) as 8-bit blocks,
and a fused layer with such a part all in 8 bits; the engine on a K-quant mix against the same file dequantized."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.loader import blocks_servable, gguf_weight_types, resolve_model
from engine.loader.gguf_file import GGUFTensor, dequantize, q4_blocks, read_gguf
from engine.models.qlinear import BlockLinear
from engine.models.qmatmul import Q4Blocks, Q8Blocks
from engine.models.quant import Int4Groups
from tests.engine.test_gguf_dequant import random_tensor
from tests.engine.test_quant import assert_close_to

Q4_K = gguf.GGMLQuantizationType.Q4_K


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_q4_k_blocks_are_its_dequantization_bit_for_bit():
    """Random super-blocks (packed 6-bit scales and minimums, zero and subnormal float16 d and dmin): the eight
    blocks of 32 of each, ``d * q + m``, equal the GGUF dequantization in float32."""
    t = random_tensor("Q4_K", 64, 512, seed=11)
    q, d, m = q4_blocks(t)
    assert q.shape == (64 * 512 // 32, 32) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert torch.equal(bits((d * q.float() + m).reshape(64, 512)), bits(dequantize(t)))


def test_q4_k_as_kernel_blocks_within_float16_scales():
    """The kernel keeps a block's scale and minimum in float16: d * sc and dmin * m rounded once, at most 2^-11
    of each (or a float16 subnormal step, 2^-24, for the smallest)."""
    t = random_tensor("Q4_K", 32, 256, seed=12)
    q, d, m = q4_blocks(t)
    blocks = Q4Blocks.from_groups(Int4Groups.from_blocks(q, d, m, 32))
    ref = dequantize(t).reshape(-1, 32)
    bound = 2 ** -11 * (15 * d.abs() + m.abs()) + 16 * 2 ** -24
    assert torch.all((blocks.dequantize().reshape(-1, 32) - ref).abs() <= bound)
    assert not torch.equal(blocks.dequantize().reshape(-1, 32), ref)      # the rounding is real, and bounded


def test_q4_blocks_refuses_a_wider_type_by_name():
    t = random_tensor("Q6_K", 4, 256, seed=1)
    with pytest.raises(ValueError, match="not Q4_0, Q4_1 or Q4_K"):
        q4_blocks(t)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 (rows, cols), cols a multiple of 256 -> Q4_K blocks (rows, cols / 256 * 144) uint8: per block of
    32 its min (<= 0) and range / 15, the super-block's d and dmin the largest of those over 63, each then
    rounded to 6 bits. A plain encoder (llama.cpp's searches its scales), enough to make valid blocks."""
    rows, cols = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    n = x.shape[0]
    lo = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - lo) / 15
    d16, dmin16 = (step.max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    d, dmin = d16.astype(np.float32)[:, None], dmin16.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63)
    dj, mj = (d * sc)[..., None], (dmin * mn)[..., None]
    q = np.clip(np.round(np.divide(x + mj, dj, out=np.zeros_like(x), where=dj > 0)), 0, 15).astype(np.uint8)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)                  # blocks 2g (low) and 2g + 1 (high)
    out = np.concatenate([d16.view(np.uint8).reshape(n, 2), dmin16.view(np.uint8).reshape(n, 2), scales, qs], 1)
    return out.reshape(rows, -1)


def test_the_test_encoder_makes_blocks_that_decode_near_their_weights():
    w = np.random.default_rng(0).normal(0, 0.02, (16, 512)).astype(np.float32)
    raw = quantize_q4_k(w)
    t = GGUFTensor("w", (512, 16), int(Q4_K), 0, raw.size, raw.reshape(-1))
    back = dequantize(t).numpy()
    ref = gguf.quants.dequantize(raw, Q4_K)
    assert np.array_equal(back, ref)
    # a 4-bit grid over each block's range, the scales in 6 bits: within ~1/15 of a block's range, plus the
    # 6-bit rounding of its step and minimum
    assert np.abs(back - w).max() <= 0.15 * np.ptp(w.reshape(-1, 32), axis=1).max()


def recode(path: str, out) -> dict[str, str]:
    """The default model as a K-quant mix, as llama.cpp's Q4_K_M lays one out where shapes allow: every
    ffn_down (1536 inputs, whole super-blocks) Q4_K in odd layers and Q8_0 in even ones (standing for Q6_K:
    wider blocks), attn_v Q8_0 in even layers; the rest as stored (Q4_1; 576 inputs take no Q4_K). Returns the
    type of each recoded tensor."""
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        w.add_key_value(field.name, field.contents(), kind,
                        sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    ours = {t.name: t for t in read_gguf(path).tensors}
    types = {}
    for t in reader.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        if t.name.endswith("ffn_down.weight"):
            types[t.name] = "Q4_K" if layer % 2 else "Q8_0"
        elif t.name.endswith("attn_v.weight") and layer % 2 == 0:
            types[t.name] = "Q8_0"
        if t.name not in types:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        dense = dequantize(ours[t.name]).numpy()
        kind = gguf.GGMLQuantizationType[types[t.name]]
        data = quantize_q4_k(dense) if types[t.name] == "Q4_K" else gguf.quants.quantize(dense, kind)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return types


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("kquant") / "smollm2-kquant-mix.gguf"
    types = recode(resolve_model(None)[0], out)
    assert sorted(set(types.values())) == ["Q4_K", "Q8_0"]
    return str(out)


@pytest.mark.slow
def test_a_k_quant_mix_on_blocks_agrees_with_the_file_dequantized(kquant_file):
    """Odd layers: ffn_down on its Q4_K blocks, q/k/v on the Q4_1 ones. Even layers: ffn_down on 8-bit blocks
    (its Q8_0), and q/k/v fused in 8 bits (v stored wider: q and k requantized beside it). Against float32 on
    the same file dequantized, teacher-forced: within the 8-bit activations' noise, the tolerances of the
    all-Q4_1 file (tests/engine/test_qmatmul_engine.py)."""
    assert gguf_weight_types(kquant_file) == {"Q4_1", "Q4_K", "Q8_0"} and blocks_servable({"Q4_1", "Q4_K", "Q8_0"})
    assert EngineConfig(model=kquant_file, dtype="auto").resolved_quantization(gguf_weight_types(kquant_file)) in \
        ("off", "gguf")                                       # measured; int4 would cut the Q8_0 parts to 4 bits
    eng = LLMEngine(EngineConfig(model=kquant_file, dtype="float32", quantization="gguf", kv_cache_tokens=4096))
    ref = LLMEngine(EngineConfig(model=kquant_file, dtype="float32", quantization="off", kv_cache_tokens=4096))
    odd, even = eng.model.layers[1], eng.model.layers[2]
    assert isinstance(odd.mlp.down_proj.blocks, Q4Blocks) and isinstance(odd.self_attn.qkv_proj.blocks, Q4Blocks)
    assert isinstance(even.mlp.down_proj.blocks, Q8Blocks) and isinstance(even.self_attn.qkv_proj.blocks, Q8Blocks)
    assert isinstance(even.mlp.gate_up_proj, BlockLinear) and isinstance(even.mlp.gate_up_proj.blocks, Q4Blocks)
    # the blocks hold the file's values: Q4_K within its float16 scales, Q8_0 exactly, v's rows exactly
    dense = ref.model.layers
    w = dense[1].mlp.down_proj.weight
    assert (odd.mlp.down_proj.blocks.dequantize() - w).abs().max() <= 2 ** -10 * w.abs().max()
    assert torch.equal(even.mlp.down_proj.blocks.dequantize(), dense[2].mlp.down_proj.weight)
    cfg = eng.model.cfg
    v = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim                  # q and k rows first, then v's
    assert torch.equal(even.self_attn.qkv_proj.blocks.dequantize()[v:], dense[2].self_attn.qkv_proj.weight[v:])
    assert_close_to(ref, eng, "k-quant mix, gguf vs float32", 60, top1=0.93, mean_kl=0.01, top_change=0.5)
