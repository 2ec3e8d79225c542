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
from engine.loader.gguf_file import GGUFTensor, dequantize, q4_blocks
from engine.models import decode_step
from engine.models.qlinear import BlockLinear
from engine.models.qmatmul import Q4Blocks, Q8Blocks, load as load_qmatmul
from engine.models.quant import Int4Groups
from benchmarks.kquant_decode import quantize_q4_k, recode
from tests.engine.test_gguf_dequant import random_tensor
from tests.engine.test_quant import assert_close_to

Q4_K = gguf.GGMLQuantizationType.Q4_K
# the engine tests run the block kernel (and the one-call step): skipped only without a C compiler, as their siblings
needs_kernels = pytest.mark.skipif(load_qmatmul() is None or decode_step._library() is None,
                                   reason="no C compiler: the kernels could not be built")


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


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("kquant") / "smollm2-kquant-mix.gguf"
    types = recode(resolve_model(None)[0], out)
    assert sorted(set(types.values())) == ["Q4_K", "Q8_0"]
    return str(out)


@needs_kernels
@pytest.mark.slow
def test_a_k_quant_mix_on_blocks_agrees_with_the_file_dequantized(kquant_file):
    """Odd layers: ffn_down on its Q4_K blocks, q/k/v on the Q4_1 ones. Even layers: ffn_down on 8-bit blocks
    (its Q8_0), and q/k/v fused in 8 bits (v stored wider: q and k requantized beside it). Against float32 on
    the same file dequantized, teacher-forced: within the 8-bit activations' noise, the tolerances of the
    all-Q4_1 file (tests/engine/test_qmatmul_engine.py). Measured when written (AVX-512 EPYC): top-1 346/360,
    mean KL 0.0026 nats, largest top-token change 0.28 nats."""
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


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_call_decode_step_takes_a_mix_of_4_and_8_bit_layers(kquant_file, dtype):
    """Its 8-bit projections go through the 8-bit kernel from the C loop too (float32's MLP as three calls where a
    part is 8-bit), so the step's logits are the Python loop's bit for bit, as on an all-4-bit file."""
    from tests.engine.test_decode_step import CASES, batch_of, both_paths

    eng = LLMEngine(EngineConfig(model=kquant_file, dtype=dtype, quantization="gguf", kv_cache_tokens=4096))
    assert eng.active_kernels["decode_step"] and eng.runner.model.decode_step is not None
    assert eng.runner.model.decode_step.bits[:4, 0].tolist() == [1 | 8, 0, 1 | 8, 0]     # even layers: qkv, down
    for case in ("b1", "b3_mixed", "verify"):
        fast, ref, counting = both_paths(eng, batch_of(eng, **CASES[case]))
        assert counting.ran == 1 and torch.equal(fast, ref), (case, (fast - ref).abs().max().item())
    eng.close()
