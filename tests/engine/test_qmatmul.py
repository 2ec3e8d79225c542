"""The GGUF-block matmul kernel (engine/models/csrc/qmatmul.c) against its plain references.

* Exactness: the kernel computes, per block, ``d * xd * sum(q * xq) (+ m * xs)`` on the activations
  ``quantize_activations`` gives; ``reference_matmul`` computes the same in float64. Tolerance: 1e-5 of
  ``|x| @ |W|.T`` (float32 accumulation of the blocks in another order) plus 1e-6.
* Against the plain float matmul on the dequantized weights: the error of rounding each activation to
  8 bits is at most half a step, so ``|y - x @ W.T| <= sum_b (xd_b / 2) * sum_j |w_bj|`` (plus the
  float32 tolerance above); the test asserts that bound.
* The fused SwiGLU MLP (``QMatmulLib.swiglu``, ``BlockLinear.swiglu``): the values of its three calls
  (gate/up projection, the layer ops' SiLU-multiply, down projection), and on every build within the
  8-bit rounding bound of the plain float computation.
* Random blocks (odd N, K a multiple of 32, M = 1..8 and 11 past one pass, float32 and bfloat16
  activations), extreme blocks (the integer sums at their bounds), the default model's real layers (Q4_1
  layers, the Q8_0 token_embd LM head), on every build this CPU runs: the native one (AVX512-VNNI here
  where the CPU has it), the AVX2 one (``-mno-avx512f``: what a CPU without AVX-512 runs) and the
  portable C (``-mno-avx2``).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from engine.loader.gguf_file import GGUFFile, dequantize, q4_blocks, q8_blocks
from engine.loader.gguf_loader import default_model_path
from engine.models.qlinear import BlockLinear
from engine.cpu_build import build
from engine.cpu_info import cpu_flags
from engine.models.qmatmul import (SOURCE, Packed, Q4Blocks, Q8Blocks, QMatmulLib, pack, quantize_activations,
                                   reference_matmul)
from engine.models.quant import Int4Groups, quantize_int4
from kernel_build import KernelBuild

BUILD = KernelBuild(lambda: QMatmulLib(build(SOURCE)))   # skipped only without a compiler on PATH
lib = BUILD.value
pytestmark = BUILD.skip_mark()
# the builds besides the native one: extra flags, and the variant they give on a CPU with AVX2, FMA, F16C
BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2",)}
HAS_AVX2 = {"avx2", "fma", "f16c"} <= cpu_flags()


@pytest.fixture(scope="module", params=list(BUILDS))
def variant_lib(request):
    """Each build of the kernel; the AVX2 one must be the AVX2 path wherever the CPU has AVX2."""
    BUILD.require()
    built = lib if request.param == "native" else QMatmulLib(build(SOURCE, BUILDS[request.param]))
    if request.param == "portable":
        assert built.variant == "portable"
    if request.param == "avx2":
        assert built.variant == ("avx2" if HAS_AVX2 else "portable")
    return built


_built = BUILD.autouse_require()   # a compile error fails every test here


def random_q4(n: int, k: int, gen: torch.Generator, q4_0: bool = False) -> Q4Blocks:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3
    m = -8 * d if q4_0 else (torch.rand(n, k // 32, generator=gen) - 0.5) * 0.2
    return Q4Blocks.from_groups(Int4Groups(q, d, m))


def random_q8(n: int, k: int, gen: torch.Generator) -> Q8Blocks:
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)   # -128: a file may hold it
    return Q8Blocks(q, (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float())


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 40                  # an outlier channel, as real residual streams have
    x[0, 32:64] = 0                # an all-zero block: scale 0
    return x


def assert_exact(y: torch.Tensor, x: torch.Tensor, w) -> None:
    scale = x.abs().double() @ w.dequantize().abs().double().t()             # (M, N)
    err = (y.double() - reference_matmul(x, w)).abs()
    bound = 1e-5 * scale + 1e-6
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def assert_within_rounding(y: torch.Tensor, x: torch.Tensor, w) -> None:
    M, K = x.shape
    wd = w.dequantize().double()
    _, xd, _ = quantize_activations(x)
    per_block = wd.abs().view(wd.shape[0], K // 32, 32).sum(-1)             # (N, K/32)
    bound = (xd.double() / 2) @ per_block.t() + 1e-5 * (x.abs().double() @ wd.abs().t()) + 1e-6
    err = (y.double() - x.double() @ wd.t()).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
@pytest.mark.parametrize("n,k", [(37, 96), (101, 576), (5, 32), (48, 1536)])
def test_kernel_matches_its_reference_on_random_blocks(variant_lib, kind, n, k):
    gen = torch.Generator().manual_seed(n * k + len(kind))
    w = random_q8(n, k, gen) if kind == "q8_0" else random_q4(n, k, gen, q4_0=kind == "q4_0")
    packed = pack(w)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 11):
        x = activations(m, k, gen)
        y = variant_lib.matmul(x, packed)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert_exact(y, x, w)
        assert_within_rounding(y, x, w)
        # bfloat16 in: the same float32 sums (bf16 -> f32 is exact), rounded to bfloat16 out
        xb = x.bfloat16()
        yb = variant_lib.matmul(xb, packed)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, variant_lib.matmul(xb.float(), packed).bfloat16())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_prefill_chunks_match_the_reference_row_by_row(variant_lib, kind):
    """Many rows at once (a prefill chunk: passes of 8 rows by groups of 16 output rows as the threads' tasks,
    a last pass of fewer rows, the activations quantized in parallel): each row's values are exactly those of
    that row alone, and within the reference's tolerance."""
    gen = torch.Generator().manual_seed(11)
    n, k = 83, 192
    w = random_q8(n, k, gen) if kind == "q8_0" else random_q4(n, k, gen)
    packed = pack(w)
    x = activations(77, k, gen)
    y = variant_lib.matmul(x, packed)
    assert_exact(y, x, w)
    for r in (0, 8, 39, 76):
        assert torch.equal(y[r], variant_lib.matmul(x[r:r + 1].contiguous(), packed)[0])
    xb = x.bfloat16()
    assert torch.equal(variant_lib.matmul(xb, packed), variant_lib.matmul(xb.float(), packed).bfloat16())


def test_integer_sums_at_their_bounds(variant_lib):
    """The largest sums the paths hold: 4-bit q = 15 against xq = +-127 (an AVX2 block's int16 pair sums
    reach 8 * 2 * 15 * 127 = 30480), 8-bit q = -128 against xq = -127 (|q| * xq pairs of 2 * 128 * 127)."""
    n, k = 19, 64
    x = torch.full((2, k), 3.0)
    x[1] = -3.0
    ones = torch.ones(n, k // 32)
    w4 = Q4Blocks.from_groups(Int4Groups(torch.full((n, k), 15, dtype=torch.uint8), ones * 0.5, ones * -0.25))
    w8 = Q8Blocks(torch.full((n, k), -128, dtype=torch.int8), ones * 0.125)
    for w, want in ((w4, 15 * 0.5 - 0.25), (w8, -128 * 0.125)):
        y = variant_lib.matmul(x, w)
        assert_exact(y, x, w)
        assert torch.allclose(y[0], torch.full((n,), 3.0 * k * want), rtol=1e-6)
        assert torch.allclose(y[1], -y[0], rtol=1e-6)


def test_pack_round_trips_and_refuses_scales_float16_cannot_hold():
    gen = torch.Generator().manual_seed(6)
    for w in (random_q4(37, 96, gen), random_q8(21, 64, gen)):
        p = pack(w)
        assert isinstance(p, Packed) and p.shape == w.shape and p.data.shape[0] == -(-w.shape[0] // 16)
        back = p.unpack()
        assert type(back) is type(w) and torch.equal(back.dequantize(), w.dequantize())
    w = random_q8(16, 32, gen)
    with pytest.raises(ValueError, match="float16 values"):
        pack(Q8Blocks(w.qs, w.d + 1e-6))


def test_activation_quantization_is_the_kernels():
    """quantize_activations (the reference's) rounds as the C code does, element for element."""
    gen = torch.Generator().manual_seed(1)
    x = activations(3, 128, gen)
    xq, xd, xs = (torch.empty(3, 128, dtype=torch.int8), torch.empty(3, 4), torch.empty(3, 4))
    fn = lib.lib.qmm_quantize_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn(x.data_ptr(), 3, 128, xq.data_ptr(), xd.data_ptr(), xs.data_ptr())
    rq, rd, rs = quantize_activations(x)
    assert torch.equal(xq, rq.view(3, 128)) and torch.equal(xd, rd) and torch.equal(xs, rs)
    assert xq.abs().max() == 127 and torch.all(xq[0, 32:64] == 0) and xd[0, 1] == 0


@pytest.mark.slow
def test_default_models_layers(variant_lib):
    """Layer 0's Q4_1 projections and the Q8_0 token_embd (the tied LM head) as stored in the file:
    the repacked blocks dequantize bit for bit as the reader does, and the kernel matches its reference."""
    reader = GGUFFile(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    gen = torch.Generator().manual_seed(2)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight",
                 "token_embd.weight"):
        t = tensors[name]
        want = dequantize(t)                                                   # (N, K) float32
        if t.type_name == "Q8_0":
            w = Q8Blocks.from_blocks(*q8_blocks(t), want.shape[0])
        else:
            assert t.type_name == "Q4_1"
            w = Q4Blocks.from_groups(Int4Groups.from_blocks(*q4_blocks(t), want.shape[0]))
        assert torch.equal(w.dequantize(), want), name
        packed = pack(w)
        for m in (1, 5):
            x = activations(m, want.shape[1], gen)
            y = variant_lib.matmul(x, packed)
            assert_exact(y, x, w)
            assert_within_rounding(y, x, w)


def test_builds_agree():
    """Every build this CPU runs gives the native build's figures up to float32 summation order."""
    others = [QMatmulLib(build(SOURCE, flags)) for flags in BUILDS.values() if flags]
    gen = torch.Generator().manual_seed(3)
    for w in (random_q4(67, 192, gen), random_q8(67, 192, gen)):
        for m in (1, 4, 8):
            x = activations(m, 192, gen)
            scale = x.abs() @ w.dequantize().abs().t()
            a = lib.matmul(x, w)
            for other in others:
                assert bool(((a - other.matmul(x, w)).abs() <= 2e-5 * scale + 1e-6).all()), other.variant


def test_block_linear_runs_few_rows_on_blocks_and_many_on_the_dense_weight():
    gen = torch.Generator().manual_seed(4)
    dense = torch.randn(48, 128, generator=gen) * 0.1
    blocks = Q4Blocks.from_groups(quantize_int4(dense))
    layer = BlockLinear(lib, blocks, dense, bias=torch.randn(48, generator=gen), max_rows=4)
    few, many = torch.randn(4, 128, generator=gen), torch.randn(5, 128, generator=gen)
    assert torch.equal(layer(few), lib.matmul(few, blocks) + layer.bias)
    assert torch.equal(layer(many), F.linear(many, dense, layer.bias))
    xb = few.bfloat16()
    y = layer(xb.view(2, 2, 128))                                              # dtype and leading shape kept
    assert y.dtype == torch.bfloat16 and y.shape == (2, 2, 48)
    assert torch.equal(y.view(4, 48), (lib.matmul(xb, blocks) + layer.bias).bfloat16())
    strided = torch.randn(128, 3, generator=gen).t()                           # not contiguous: copied first
    assert torch.equal(layer(strided), lib.matmul(strided.contiguous(), blocks) + layer.bias)
    with pytest.raises(RuntimeError):                                          # a wrong K never reaches C
        layer(torch.randn(1, 96, generator=gen))


def test_prefill_on_blocks_runs_every_step_on_the_blocks():
    """``prefill_on_blocks``: steps of any size on the blocks, and back to the dense weight past max_rows."""
    from engine.models.qlinear import prefill_on_blocks
    from engine.models.quant import MAX_QUANT_ROWS

    gen = torch.Generator().manual_seed(12)
    dense = torch.randn(48, 128, generator=gen) * 0.1
    blocks = Q4Blocks.from_groups(quantize_int4(dense))
    model = torch.nn.Sequential(BlockLinear(lib, blocks, dense))
    many = torch.randn(3 * MAX_QUANT_ROWS + 5, 128, generator=gen)
    prefill_on_blocks(model, True)
    assert model[0].max_rows is None and torch.equal(model(many), lib.matmul(many, blocks))
    prefill_on_blocks(model, False)
    assert model[0].max_rows == MAX_QUANT_ROWS and torch.equal(model(many), F.linear(many, dense))


def _mlp_blocks(gen: torch.Generator, k: int = 96, i: int = 64, n: int = 37):
    """A SwiGLU MLP's 4-bit blocks: gate/up (2 i, k), down (n, i), as BlockLinear layers."""
    gate_up, down = random_q4(2 * i, k, gen), random_q4(n, i, gen)
    return (BlockLinear(lib, gate_up, torch.zeros(2 * i, k)), BlockLinear(lib, down, torch.zeros(n, i)),
            gate_up, down)


def test_swiglu_is_the_three_calls_it_fuses():
    """One kernel call for the MLP gives exactly what the gate/up projection, the layer ops' SiLU-multiply
    (the same silu, kernel_math.h) and the down projection give as three calls (both libraries built for
    this CPU)."""
    from engine.models.cpu_ops import LayerOps, SOURCE as OPS_SOURCE

    ops = LayerOps(build(OPS_SOURCE))
    gen = torch.Generator().manual_seed(6)
    gate_up, down, _, _ = _mlp_blocks(gen)
    for m in (1, 2, 3, 8, 29):
        if m > 8:   # a prefill chunk: only with the layers taking every step on their blocks
            gate_up.max_rows = down.max_rows = None
        x = activations(m, 96, gen)
        y = gate_up.swiglu(down, x)
        assert y.shape == (m, 37) and y.dtype == torch.float32
        assert torch.equal(y, down(ops.silu_mul(gate_up(x))))


def test_swiglu_on_every_build_is_within_rounding_of_the_float_mlp(variant_lib):
    """Each build's fused MLP against the plain float computation: the gate/up output exact to its own
    reference, then the down projection within the 8-bit rounding bound of silu(gate) * up."""
    gen = torch.Generator().manual_seed(7)
    _, _, gu_blocks, dn_blocks = _mlp_blocks(gen)
    for m in (1, 2, 5):
        x = activations(m, 96, gen)
        y = variant_lib.swiglu(x, pack(gu_blocks), pack(dn_blocks))
        gate, up = variant_lib.matmul(x, gu_blocks).split(64, dim=-1)
        act = F.silu(gate) * up
        assert_within_rounding(y, act, dn_blocks)


def test_swiglu_leaves_other_steps_to_the_separate_calls():
    """None (the caller runs the three calls) for bfloat16, more rows than the kernel takes, a bias, an
    8-bit layer or a down projection that is no BlockLinear."""
    gen = torch.Generator().manual_seed(8)
    gate_up, down, gu_blocks, dn_blocks = _mlp_blocks(gen)
    x = torch.randn(1, 96, generator=gen)
    assert gate_up.swiglu(down, x) is not None
    assert gate_up.swiglu(down, x.bfloat16()) is None
    assert gate_up.swiglu(down, torch.randn(9, 96, generator=gen)) is None          # > MAX_QUANT_ROWS
    assert gate_up.swiglu(torch.nn.Linear(64, 37), x) is None
    biased = BlockLinear(lib, dn_blocks, torch.zeros(37, 64), bias=torch.ones(37))
    assert gate_up.swiglu(biased, x) is None
    q8 = BlockLinear(lib, Q8Blocks.quantize(torch.randn(37, 64, generator=gen)), torch.zeros(37, 64))
    assert gate_up.swiglu(q8, x) is None


def test_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(5)
    w = random_q4(8, 64, gen)
    with pytest.raises(ValueError, match=r"contiguous float32 or bfloat16 \(M, 64\)"):
        lib.matmul(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match=r"contiguous float32"):
        lib.matmul(torch.randn(1, 64, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Blocks.quantize(torch.randn(4, 40))
    with pytest.raises(ValueError, match="dense weight shape"):
        BlockLinear(lib, w, torch.randn(8, 32))
