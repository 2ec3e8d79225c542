"""The C layer operations (engine/models/cpu_ops.py): the fused residual add + RMSNorm and SiLU-multiply
against torch's own operations, in bfloat16 and float32, and the model through them against its plain
layers."""

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine
from engine.cpu_build import build
from engine.models.cpu_ops import SOURCE, LayerOps
from engine.models.packed_linear import PackedLinear
from kernel_build import KernelBuild

BUILD = KernelBuild(lambda: LayerOps(build(SOURCE)))   # skipped only without a compiler on PATH
ops = BUILD.value
pytestmark = BUILD.skip_mark()
_built = BUILD.autouse_require()   # a compile error fails every test here
op = ops.add_rms_norm if ops is not None else None


def plain(x, delta, w, eps):
    """What the plain layers compute: a bfloat16 add, then the norm in float32, narrowed."""
    x = x if delta is None else x + delta
    return x, F.rms_norm(x.float(), w.shape, w, eps).to(torch.bfloat16)


@pytest.mark.parametrize("T,H", [(1, 576), (7, 64), (40, 2048), (3, 100)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_op_matches_torch(T, H, with_delta):
    torch.manual_seed(T * H)
    x = (torch.randn(T, H) * 3).to(torch.bfloat16)
    delta = (torch.randn(T, H) * 2).to(torch.bfloat16) if with_delta else None
    w = torch.randn(H) * 0.5
    ref_x, ref = plain(x, delta, w, 1e-5)
    got = op(x, delta, w, 1e-5)                      # x is updated in place
    assert torch.equal(x, ref_x)                     # the add rounds exactly as torch's bfloat16 add
    diff = (got.float() - ref.float()).abs()
    # float32 sums of squares in another order: at most one bfloat16 step apart, and rarely that
    assert torch.all(diff <= ref.float().abs() * 2 ** -7 + 1e-30)
    assert (diff == 0).float().mean() >= 0.99


@pytest.mark.parametrize("T,H", [(1, 576), (7, 64), (40, 2048), (3, 100)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_fused_op_in_float32_matches_torch(T, H, with_delta):
    """The float32 add is torch's exactly; the norm differs by the order of its sum of squares alone: a few
    float32 steps at most (measured when written: 3.9e-7 relative, 40-70% of the values equal)."""
    torch.manual_seed(T * H)
    x = torch.randn(T, H) * 3
    delta = torch.randn(T, H) * 2 if with_delta else None
    w = torch.randn(H) * 0.5
    ref_x = x if delta is None else x + delta
    ref = F.rms_norm(ref_x, w.shape, w, 1e-5)
    got = op(x, delta, w, 1e-5)
    assert got.dtype == torch.float32 and torch.equal(x, ref_x)
    assert torch.all((got - ref).abs() <= ref.abs() * 2 ** -20 + 1e-30)


def test_hidden_size_beyond_the_kernel_is_refused():
    x = torch.zeros(1, 20000, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="hidden size"):
        op(x, None, torch.ones(20000), 1e-5)


@pytest.mark.parametrize("T,I", [(1, 1536), (5, 64), (40, 1536), (2, 37)])
def test_silu_mul_matches_torch(T, I):
    """silu(gate) * up as torch computes it on bfloat16 tensors (silu rounded, then the product): the
    exponential is another float32 approximation, so at most one bfloat16 step apart, and rarely."""
    torch.manual_seed(T * I)
    gate_up = (torch.randn(T, 2 * I) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])         # silu's limits: 0, 0, x, -0
    gate, up = gate_up.split(I, dim=-1)
    ref = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == (T, I) and got.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    assert torch.all(diff <= ref.float().abs() * 2 ** -7 + 1e-30)
    assert (diff == 0).float().mean() >= 0.99
    assert torch.equal(got[0, :4].float(), ref[0, :4].float())


@pytest.mark.parametrize("T,I", [(1, 1536), (5, 64), (40, 1536), (2, 37)])
def test_silu_mul_in_float32_matches_torch(T, I):
    """float32: the exponential's approximation (relative error below 1e-7) and the division's rounding,
    a few float32 steps (measured when written: 9.1e-7 relative at most)."""
    torch.manual_seed(T * I)
    gate_up = torch.randn(T, 2 * I) * 4
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 100.0, -100.0])
    gate, up = gate_up.split(I, dim=-1)
    ref = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == (T, I) and got.dtype == torch.float32
    assert torch.all((got - ref).abs() <= ref.abs() * 2 ** -18 + 1e-30)
    assert torch.equal(got[0, :4], ref[0, :4])


def test_silu_mul_refuses_another_dtype_or_an_odd_input():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ops.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))


PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]


def _fused_against_plain(engine: LLMEngine, scored: int = 24) -> tuple[int, int, float, float]:
    """The engine's model with and without its C layer ops over its own greedy continuations of PROMPTS
    (tests/engine/test_quant.py ``paths_compared``)."""
    from tests.engine.test_quant import paths_compared

    return paths_compared(engine, engine.model.use_cpu_ops, PROMPTS, scored)


def _within_bfloat16_noise(engine: LLMEngine, what: str) -> None:
    """``_fused_against_plain`` within the noise of bfloat16 (or of 8-bit activations, as large):
    top-1 >= 90%, mean KL <= 0.005, largest top-token change <= 0.35 nats."""
    from tests.engine.test_quant import assert_paths_agree

    assert_paths_agree(what, _fused_against_plain(engine), top1=0.90, kl_max=0.005, worst_max=0.35)


def _prefill_in_c(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a ``dtype`` pool's prefill chunks run in the C prefill kernel here (bfloat16 only on vdpbf16ps,
    float32 only on AVX vectors, and where it measured faster than torch's path: the probe's answer is cached
    per process, so it is the engine's)."""
    from engine.attention.cpu_kernel import load_prefill

    from engine.attention.torch_backend import prefill_kernel_wins

    kernel = load_prefill()
    return kernel is not None and kernel.vectorized(dtype) and prefill_kernel_wins(kernel, 9, 3, 64, dtype)   # the default model's heads


@pytest.mark.slow
def test_model_with_the_c_layer_ops_scores_as_the_plain_layers():
    """The default model in bfloat16, fused and plain. Per operation the two agree but for a rare last-bit
    difference of a norm's output (float32 sums of squares in another order); through 30 bfloat16 layers
    that grows to the noise of bfloat16 itself. Measured when written: top-1 93/96, mean KL 0.0017, largest
    change of the plain top token's log-prob 0.16 nats (bf16 against float32 on the same model: KL 0.0011,
    0.22 nats, tests/engine/test_quant.py). Tolerances: top-1 >= 90%, mean KL <= 0.005, <= 0.35 nats."""
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_cache_tokens=4096))
    assert engine.model.cpu_ops is not None
    # logged, in /metrics; the weights are not gguf blocks here (quantization auto in explicit bfloat16)
    assert engine.active_kernels == {"decode_attention": True, "prefill_attention": _prefill_in_c(),
                                     "layer_ops": True, "qmatmul": False, "decode_step": False,
                                     "packed_linear": False}
    _within_bfloat16_noise(engine, "fused vs plain")


@pytest.mark.slow
def test_model_in_float32_with_the_c_layer_ops_scores_as_the_plain_layers():
    """float32 on dense weights (``quantization`` off) is the configuration tested against transformers: the
    engine keeps torch's elementwise ops there (its projections may run oneDNN's packed GEMM, float32 too:
    tests/engine/test_packed_linear.py). Turned on by hand, the ops differ from torch's by a few float32 steps, so the
    log-probs agree to float32 noise. Measured when written: top-1 96/96, mean KL 1.8e-8, largest
    top-token change 1e-5 nats. Tolerances: every top-1 equal, mean KL <= 1e-6, <= 1e-3 nats."""
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="off", kv_cache_tokens=4096))
    assert engine.model.cpu_ops is None
    assert engine.active_kernels == {"decode_attention": True, "prefill_attention": _prefill_in_c(torch.float32),
                                     "layer_ops": False, "qmatmul": False, "decode_step": False,
                                     "packed_linear": isinstance(engine.model.lm_head, PackedLinear)}
    assert engine.model.use_cpu_ops(True)
    from tests.engine.test_quant import assert_paths_agree

    assert_paths_agree("float32, fused vs plain", _fused_against_plain(engine))


@pytest.mark.slow
def test_model_in_float32_on_gguf_blocks_with_the_c_layer_ops_scores_as_the_plain_layers():
    """float32 on the GGUF's blocks (what ``auto`` runs on an AVX2-only CPU): there each projection
    quantizes its input to 8 bits, and a last-bit change of a norm's output moves an activation across a
    rounding boundary now and then (~1e-5 of them), a step of max|x| / 127 in its block: the noise of the
    8-bit activations, as large as bfloat16's, so this test's tolerances are the bfloat16 one's above.
    Measured when written: top-1 92/96, mean KL 0.0022, 0.25 nats (tests/engine/test_qmatmul_engine.py:
    the blocks against float32 weights, 0.0033 and 0.20). Tolerances: top-1 >= 90%, mean KL <= 0.005,
    <= 0.35 nats."""
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="gguf", kv_cache_tokens=4096))
    # decode steps' layers in one C call (engine/models/decode_step.py), the same values as the loop
    assert engine.active_kernels == {"decode_attention": True, "prefill_attention": _prefill_in_c(torch.float32),
                                     "layer_ops": True, "qmatmul": True, "decode_step": True, "packed_linear": False}
    _within_bfloat16_noise(engine, "float32 gguf, fused vs plain")


def test_engines_without_the_c_kernels_count_none_active():
    """``cpu_kernels=False``: the plain layers, and every kernel reported off."""
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_tokens=1024, cpu_kernels=False))
    assert engine.model.cpu_ops is None
    assert engine.active_kernels == {"decode_attention": False, "prefill_attention": False, "layer_ops": False,
                                     "qmatmul": False, "decode_step": False, "packed_linear": False}
    assert engine.stats().cpu_kernels == engine.active_kernels
