"""8-bit KV pages (EngineConfig.kv_cache_dtype="int8"): the quantizer, the pool's reads and writes, the C
decode kernel and rope_store against the torch path, int8 against float32 attention, pages for the tiers."""

import math
import random

import pytest
import torch

from engine import EngineConfig
from engine.attention import create_backend
from engine.attention.cpu_kernel import SOURCE, DecodeKernel, KernelRows, i8_case_flags, load
from engine.cpu_build import build
from engine.attention.reference import reference_attention
from engine.kv_pool import KVCache, kv_bytes_per_token, pool_pages, quantize_int8
from engine.kv_tier import DiskTier, HostTier
from kernel_build import KernelBuild, built_for
from test_cpu_kernel import backend_batch as batch   # tests/engine is on the path (no __init__.py)

# this CPU's build with every int8 loop nest (the engine's builds hold one or none: test_an_int8_pool_gets_...)
BUILD = KernelBuild(lambda: DecodeKernel(build(SOURCE)))
kernel = BUILD.value
needs_kernel = BUILD.skip_mark()
_built = BUILD.autouse_require()   # a compile error fails every test here


def int8_pool(num_pages, P=16, Hkv=2, D=32, dtype=torch.float32, layers=1):
    """An int8 pool filled with the quantized form of random normal K/V (scales as real writes give)."""
    kv = KVCache(layers, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD", kv_dtype=torch.int8)
    slots = torch.arange(num_pages * P)
    for layer in range(layers):
        kv.write(layer, slots, torch.randn(len(slots), Hkv, D) * 2, torch.randn(len(slots), Hkv, D))
    return kv


def test_quantize_is_symmetric_absmax_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.rand(50, 3, 1) * 10
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (50, 3)
    torch.testing.assert_close(s, x.abs().amax(-1) / 127)
    assert torch.equal(q.abs().amax(-1), torch.full((50, 3), 127, dtype=torch.int8))   # the absmax is +-127
    assert ((q.float() * s[..., None] - x).abs() <= s[..., None] / 2 * (1 + 1e-5)).all()
    q0, s0 = quantize_int8(torch.zeros(2, 8))
    assert torch.equal(q0, torch.zeros(2, 8, dtype=torch.int8)) and torch.equal(s0, torch.ones(2))


def test_write_then_gather_and_ranges_dequantize():
    torch.manual_seed(1)
    kv = KVCache(2, 8, 4, 2, 16, torch.float32, "cpu", layout="HSD", kv_dtype=torch.int8)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([4, 5, 9, 20, 31])
    kv.write(1, slots, k, v)
    kg, vg = kv.gather(1, slots)                                   # (Hkv, 5, D)
    for got, x in ((kg, k), (vg, v)):
        q, s = quantize_int8(x.transpose(0, 1))
        assert torch.equal(got, q.float() * s[..., None])
    kr, _ = kv.slot_range(1, 4, 2)
    assert torch.equal(kr, kg[:, :2])
    assert kv.bytes_per_token == 2 * 2 * 2 * (16 + 4)


@pytest.mark.parametrize("plan", [None, "union", "cascade"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_backend_on_int8_pages_matches_reference(plan, dtype, tol):
    """Every path of the torch backend over an int8 pool (the C kernel, the two torch decode plans,
    prefill chunks with and without a cached prefix) against the reference over the same pages."""
    rng = random.Random(3)
    torch.manual_seed(3)
    kv = int8_pool(120, dtype=dtype)
    backend = create_backend("torch", kv=kv, num_heads=6, num_kv_heads=2, head_dim=32)
    backend.force_decode_plan = plan
    layout = batch(rng, [(1, 300), (1, 60), (4, 90), (1, 600), (20, 20), (140, 200)], 3, 16, 120)
    T = layout.num_tokens
    q = torch.randn(T, 6, 32, dtype=dtype)
    backend.plan(layout)
    out = backend.forward(0, q, torch.randn(T, 2, 32, dtype=dtype), torch.randn(T, 2, 32, dtype=dtype))
    assert (backend.kernel_decode is not None) == (plan is None and kernel is not None)
    torch.testing.assert_close(out.float(), reference_attention(kv, 0, layout, q).float(), atol=tol, rtol=tol)


@needs_kernel
def test_an_int8_pool_gets_the_build_with_its_own_loop_nest():
    """The engine's build for an int8 pool holds only that pool's (query group, head dim) loop nest, a float
    pool's none (compiling all 16 is most of a first start's kernel builds); each computes what the full build
    does: the same nest for the pool's pair, the generic calls for a pair outside the 16."""
    assert i8_case_flags((3, 64)) == ("-DI8_ONE_G=3", "-DI8_ONE_D=64")
    assert i8_case_flags(None) == i8_case_flags((10, 64)) == i8_case_flags((2, 96)) == ("-DI8_NO_CASES",)
    assert kernel.i8_cases == -1
    rng = random.Random(7)
    for Hq, Hkv, D, cases in ((9, 3, 64, 3064), (8, 2, 128, 4128), (20, 2, 64, 0)):
        kv = int8_pool(40, 16, Hkv, D)
        backend = create_backend("torch", kv=kv, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
        assert backend.kernel is load((Hq // Hkv, D)) and backend.kernel.i8_cases == cases
        lens = [1, 255, 300]
        free = list(range(40))
        rng.shuffle(free)
        rows = KernelRows([[free.pop() for _ in range(-(-n // 16))] for n in lens], lens, 16)
        q = torch.randn(len(lens), Hq, D)
        torch.testing.assert_close(backend.kernel.paged(q, kv, 0, rows), kernel.paged(q, kv, 0, rows),
                                   atol=1e-6, rtol=1e-6)
    float_pool = KVCache(1, 8, 16, 3, 64, torch.float32, "cpu", layout="HSD")
    assert create_backend("torch", kv=float_pool, num_heads=9, num_kv_heads=3, head_dim=64).kernel.i8_cases == 0


def reference_rows(q, kv, tables, lens, P):
    """Row-by-row float64 softmax attention over the dequantized pool -> (out, lse)."""
    B, Hq, D = q.shape
    out, lse = torch.zeros(B, Hq, D, dtype=torch.float64), torch.zeros(B, Hq, dtype=torch.float64)
    for b, (pages, n) in enumerate(zip(tables, lens)):
        k, v = kv.gather(0, torch.tensor([pages[i // P] * P + i % P for i in range(n)]))
        G = Hq // k.shape[0]
        s = torch.einsum("hd,hnd->hn", q[b].double(), k.double().repeat_interleave(G, 0)) / math.sqrt(D)
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v.double().repeat_interleave(G, 0))
        lse[b] = torch.logsumexp(s, -1)
    return out, lse


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("variant", ["native", "avx2", "portable"])
@pytest.mark.parametrize("Hq,Hkv,D,P", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 24, 1), (20, 2, 64, 4), (4, 2, 40, 8)])
def test_kernel_reads_int8_pages_as_the_torch_path(variant, Hq, Hkv, D, P):
    """The kernel over int8 pages in place (this CPU's build, the AVX2-only build users get with
    ``AGENTRT_KERNEL_MARCH=x86-64-v3``, and the portable -mno-avx build) against float64 attention over the same
    pages dequantized: tight, output and log-sum-exp. The shapes reach the vectorised passes with a constant and
    a runtime query group (3, 10), and the per-query path (D 24; D 40 under AVX-512, whose 16 lanes do not
    divide it). The AVX2-only build is test_cpu_kernel's x86-64-v3 one (the same flags: compiled once)."""
    if variant == "avx2":
        kern = built_for("x86-64-v3", lambda: DecodeKernel(build(SOURCE)))
    elif variant == "portable":
        kern = DecodeKernel(build(SOURCE, extra_flags=("-mno-avx", "-mno-avx2")))
    else:
        kern = kernel
    rng = random.Random(D + P)
    torch.manual_seed(D + P)
    lens = [1, 17, 255, 256, 257, 1100]
    num_pages = sum(-(-n // P) for n in lens) + 5
    kv = int8_pool(num_pages, P, Hkv, D)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // P))] for n in lens]
    q = torch.randn(len(lens), Hq, D) * 2
    lse = torch.empty(len(lens), Hq)
    out = kern.paged(q, kv, 0, KernelRows(tables, lens, P), lse=lse)
    ref, ref_lse = reference_rows(q, kv, tables, lens, P)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_kernel_over_int8_pages_with_a_peaked_softmax_matches_reference():
    """Queries 25x a standard normal over int8 pages: many keys' weights (probability x the value row's scale)
    fall under float32's smallest normal, which the kernel flushes (kernel_math.h ``subnormals_flushed``); the
    output and log-sum-exp are still float64 attention's over the dequantized pages."""
    rng = random.Random(9)
    torch.manual_seed(9)
    P, lens = 16, [300, 700]
    num_pages = sum(-(-n // P) for n in lens) + 3
    kv = int8_pool(num_pages, P, 3, 64)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // P))] for n in lens]
    q = torch.randn(len(lens), 9, 64) * 25
    lse = torch.empty(len(lens), 9)
    out = kernel.paged(q, kv, 0, KernelRows(tables, lens, P), lse=lse)
    ref, ref_lse = reference_rows(q, kv, tables, lens, P)
    k, _ = kv.gather(0, torch.tensor([tables[0][i // P] * P + i % P for i in range(lens[0])]))
    s = torch.einsum("hd,hnd->hn", q[0].double(), k.double().repeat_interleave(3, 0)) / 8
    assert float(((s - s.max(-1, keepdim=True).values).exp() < torch.finfo(torch.float32).tiny).double().mean()) > 0.2
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_int8_attention_is_within_tolerance_of_float32():
    """The same K/V in a float32 pool and an int8 pool: attention outputs within 0.04, mean 0.003 (keys ~N(0, 4),
    values ~N(0, 1); one quantization step is absmax / 127)."""
    torch.manual_seed(5)
    P, num_pages = 16, 100
    f32 = KVCache(1, num_pages, P, 2, 64, torch.float32, "cpu", layout="HSD")
    i8 = KVCache(1, num_pages, P, 2, 64, torch.float32, "cpu", layout="HSD", kv_dtype=torch.int8)
    slots = torch.arange(num_pages * P)
    k, v = torch.randn(len(slots), 2, 64) * 2, torch.randn(len(slots), 2, 64)
    f32.write(0, slots, k, v)
    i8.write(0, slots, k, v)
    layout = batch(random.Random(5), [(1, 700), (1, 90), (30, 200)], 0, P, num_pages)
    q = torch.randn(layout.num_tokens, 6, 64)
    err = (reference_attention(i8, 0, layout, q) - reference_attention(f32, 0, layout, q)).abs()
    assert err.max() < 0.04 and err.mean() < 0.003


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37])
def test_rope_store_writes_the_bytes_of_the_torch_path(dtype, T):
    """The C RoPE + int8 store against RopeTable.apply and KVCache.write on an int8 pool: the same q, and
    the same int8 values and scales in the pool, bit for bit."""
    from types import SimpleNamespace

    from engine.models.llama import RotaryEmbedding

    torch.manual_seed(T)
    Hq, Hkv, D, P, num_pages = 9, 3, 64, 16, 32
    qkv = (torch.randn(T, Hq + 2 * Hkv, D) * 3).to(dtype)
    plain = SimpleNamespace(head_dim=D, max_position_embeddings=8192, rope_theta=10000.0, rope_scaling={},
                            partial_rotary_factor=1.0)   # what RotaryEmbedding reads of a ModelConfig
    table = RotaryEmbedding(plain).table(torch.randint(0, 8000, (T,)), dtype)
    slots = torch.randperm(num_pages * P)[:T]
    ref = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD", kv_dtype=torch.int8)
    kv = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD", kv_dtype=torch.int8)
    rotated = table.apply(qkv[:, :Hq + Hkv])
    ref.write(0, slots, rotated[:, Hq:], qkv[:, Hq + Hkv:])
    q = kernel.rope_store_int8(qkv, table.cos, table.signed_sin, slots, kv, 0, Hq)
    assert torch.equal(q, rotated[:, :Hq])
    for a, b in ((kv.k, ref.k), (kv.v, ref.v), (kv.k_scale, ref.k_scale), (kv.v_scale, ref.v_scale)):
        assert torch.equal(a[0], b[0])


def test_int8_pages_travel_with_their_scales_through_the_tiers(tmp_path):
    torch.manual_seed(7)
    kv = int8_pool(6, P=4, Hkv=2, D=8, layers=2)
    page = kv.read_page(3)
    assert page.dtype == torch.uint8 and tuple(page.shape) == kv.page_shape == (2, 2, 2, 4 * (8 + 4))
    assert page.numel() == 4 * kv.bytes_per_token    # a page of 4 tokens: values and scales
    host = HostTier(2, kv.page_shape, kv.page_dtype, pin=False)
    disk = DiskTier(str(tmp_path / "d"), 4, kv.page_shape, kv.page_dtype, keep=True)
    host.put(11, page)
    disk.put(12, page)
    disk.close()   # written
    reopened = DiskTier(str(tmp_path / "d"), 4, kv.page_shape, kv.page_dtype, keep=True)
    for restored in (host.get(11).clone(), reopened.read(12)):
        other = KVCache(2, 6, 4, 2, 8, torch.float32, "cpu", layout="HSD", kv_dtype=torch.int8)
        other.write_page(5, restored)
        for layer in range(2):
            s3, s5 = torch.arange(12, 16), torch.arange(20, 24)
            assert all(torch.equal(a, b) for a, b in zip(kv.gather(layer, s3), other.gather(layer, s5)))
            assert torch.equal(other.k_scale[layer][:, 20:24], kv.k_scale[layer][:, 12:16])


def test_settings_are_validated_and_a_byte_budget_sizes_the_pool():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not implemented.*'int8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="int8' needs the torch attention backend, got 'flashinfer'"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="flashinfer")
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive integer"):
        EngineConfig(kv_cache_memory_bytes=0)
    assert EngineConfig(kv_cache_dtype="auto", dtype="float32").resolved_kv_cache_dtype() == "float32"
    # the default model's geometry: 30 layers, 3 KV heads, head dim 64
    per = {d: kv_bytes_per_token(30, 3, 64, t) for d, t in
           (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8))}
    assert per == {"float32": 46080, "bfloat16": 23040, "int8": 12240}
    cfg = EngineConfig(kv_cache_memory_bytes=1 << 30)
    pages = {d: pool_pages(cfg, n) for d, n in per.items()}
    assert pages["int8"] / pages["bfloat16"] == pytest.approx(23040 / 12240, rel=1e-3)
    assert pages["int8"] / pages["float32"] == pytest.approx(46080 / 12240, rel=1e-3)
    assert pool_pages(EngineConfig(kv_cache_tokens=640), 12240) == 40
