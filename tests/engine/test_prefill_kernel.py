"""The compiled bfloat16 prefill-attention kernel (engine/attention/csrc/prefill_attention.c) against a float64
reference, in its vdpbf16ps build and its portable one, and inside the torch backend."""

import functools
import math
import random

import pytest
import torch

from engine.attention import create_backend
from engine.attention.cpu_kernel import PREFILL_SOURCE, PrefillKernel
from engine.attention.reference import reference_attention
from engine.cpu_build import build
from engine.kv_pool import KVCache
from kernel_build import KernelBuild

BUILD = KernelBuild(lambda: PrefillKernel(build(PREFILL_SOURCE)))   # skipped only without a compiler on PATH
kernel = BUILD.value
pytestmark = BUILD.skip_mark()
_built = BUILD.autouse_require()   # a compile error fails every test here


def portable_kernel():
    """The portable C loops (the build without AVX512-BF16); the default build itself where it has no vdpbf16ps."""
    if not kernel.dpbf16:
        return kernel
    return PrefillKernel(build(PREFILL_SOURCE, extra_flags=("-mno-avx512bf16",)))


def reference(q, k, v, slots):
    """Causal softmax attention in float64: query i of Q sees keys 0 .. L - Q + i of the L at ``slots``."""
    Q, Hq, D = q.shape
    G = Hq // k.shape[0]
    L = slots.numel()
    kk = k[:, slots].double().repeat_interleave(G, 0)                     # (Hq, L, D)
    vv = v[:, slots].double().repeat_interleave(G, 0)
    s = torch.einsum("qhd,hld->hql", q.double(), kk) / math.sqrt(D)
    s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(L - Q, L)[:, None], -math.inf)
    return torch.einsum("hql,hld->qhd", torch.softmax(s, -1), vv)        # (Q, Hq, D)


def case(Q, n_cached, Hq, Hkv, D, seed):
    torch.manual_seed(seed)
    S = n_cached + Q + 37
    k, v = torch.randn(Hkv, S, D).bfloat16(), torch.randn(Hkv, S, D).bfloat16()
    slots = torch.randperm(S)[:n_cached + Q]                              # scattered over the pool
    q = (torch.randn(Q, Hq, D) * 2).bfloat16()                            # peaked softmaxes as well as flat ones
    return q, k, v, slots


@pytest.mark.parametrize("variant", ["native", "portable"])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 1, 64)])
@pytest.mark.parametrize("Q,n_cached", [(1, 0), (7, 0), (64, 0), (65, 63), (130, 70), (33, 1000), (40, 3)])
def test_kernel_matches_reference(variant, Hq, Hkv, D, Q, n_cached):
    """Chunks with and without a cached prefix, on both sides of the 64-key block and 32-query task edges,
    GQA groups of 1-16: within the error of rounding the exact result to bfloat16 (and a planted
    off-by-one in the causal mask or a wrong scale is far outside it)."""
    kern = kernel if variant == "native" else portable_kernel()
    if variant == "portable":
        assert not kern.dpbf16
    q, k, v, slots = case(Q, n_cached, Hq, Hkv, D, Q * 7 + n_cached + D)
    out = kern(q, k, v, slots)
    ref = reference(q, k, v, slots)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.double() - ref).abs()
    rounding = (ref.bfloat16().double() - ref).abs()
    assert err.max().item() <= 2 * rounding.max().item() + 2e-3
    assert err.mean().item() <= 2 * rounding.mean().item() + 2e-4


def test_both_builds_agree():
    if not kernel.dpbf16:
        pytest.skip("this CPU has no AVX512-BF16: its default build is the portable one, nothing to compare")
    q, k, v, slots = case(200, 900, 9, 3, 64, 3)
    a, b = kernel(q, k, v, slots), portable_kernel()(q, k, v, slots)
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


# the float32 path's builds: this CPU's, AVX2 + FMA only (x86-64-v3, a machine that has more), and no AVX at all
# (4 lanes, SSE2: the plain build the vector ones are held against)
F32_FLAGS = {"native": (), "x86-64-v3": ("-march=x86-64-v3",), "no-avx": ("-mno-avx",)}


@functools.cache
def f32_kernel(variant: str) -> PrefillKernel:
    return kernel if variant == "native" else PrefillKernel(build(PREFILL_SOURCE, extra_flags=F32_FLAGS[variant]))


def _avx2_here() -> bool:
    from engine.cpu_info import cpu_flags
    return {"avx2", "fma"} <= cpu_flags()


@pytest.mark.parametrize("variant", list(F32_FLAGS))
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128), (16, 1, 64)])
@pytest.mark.parametrize("Q,n_cached", [(1, 0), (7, 0), (65, 63), (130, 70), (33, 1000), (40, 3)])
def test_float32_kernel_matches_reference(variant, Hq, Hkv, D, Q, n_cached):
    """float32 queries over float32 pages, in each build: within float32 rounding of the float64 reference (a
    planted off-by-one in the causal mask, a wrong scale or a dropped rescale is orders of magnitude outside)."""
    if variant == "x86-64-v3" and not _avx2_here():
        pytest.skip("this CPU cannot run a build for AVX2")
    kern = f32_kernel(variant)
    assert kern.f32_lanes == {"x86-64-v3": 8, "no-avx": 4}.get(variant, kern.f32_lanes)
    q, k, v, slots = case(Q, n_cached, Hq, Hkv, D, Q * 5 + n_cached + D)
    q, k, v = q.float(), k.float(), v.float()
    out = kern(q, k, v, slots)
    assert out.dtype == torch.float32 and out.shape == q.shape
    err = (out.double() - reference(q, k, v, slots)).abs()
    assert err.max().item() <= 3e-5 and err.mean().item() <= 2e-6


def test_float32_builds_agree_and_the_native_one_is_vectorized():
    """The vector builds against the plain one on one chunk (float32 sums in another order: within 1e-5), and the
    default build of an AVX machine runs the vector path (the one the backend takes)."""
    from engine.cpu_info import cpu_flags

    q, k, v, slots = case(200, 900, 9, 3, 64, 3)
    q, k, v = q.float(), k.float(), v.float()
    plain = f32_kernel("no-avx")(q, k, v, slots)
    for variant in ("native", "x86-64-v3") if _avx2_here() else ("native",):
        torch.testing.assert_close(f32_kernel(variant)(q, k, v, slots), plain, atol=1e-5, rtol=1e-5)
    if "avx" in cpu_flags():
        assert kernel.f32_lanes >= 8


@pytest.mark.parametrize("variant", ["native", "no-avx"])
def test_float32_over_int8_pages_reads_them_as_the_gather_dequantizes_them(variant):
    """A float32 model's int8 pool: the float32 path dequantizes each row as it repacks it, to the float32 values
    ``KVCache.gather`` returns (int8 times the scale in float32), so its output is bit for bit its output over the
    gathered copy, and within float32 rounding of the float64 reference over those values."""
    kern = f32_kernel(variant)
    P, Hq, Hkv, D, Q, n_cached = 16, 9, 3, 64, 70, 300
    torch.manual_seed(12)
    kv = KVCache(1, 40, P, Hkv, D, torch.float32, "cpu", layout="HSD", kv_dtype=torch.int8)
    L = n_cached + Q
    slots = torch.randperm(40 * P)[:L]
    kv.write(0, slots, torch.randn(L, Hkv, D), torch.randn(L, Hkv, D))
    q = torch.randn(Q, Hq, D) * 2
    out = kern.paged(q, kv, 0, slots)
    k, v = kv.gather(0, slots)                                            # (Hkv, L, D) float32
    assert out.dtype == torch.float32 and torch.equal(out, kern(q, k.contiguous(), v.contiguous(), torch.arange(L)))
    assert (out.double() - reference(q, k, v, torch.arange(L))).abs().max().item() <= 3e-5
    with pytest.raises(ValueError, match="int8 with float32 scales"):
        kern(q, kv.k[0], kv.v[0], slots)                                  # int8 pages without their scales


@pytest.mark.parametrize("variant", ["native", "portable"])
def test_int8_pages_are_read_as_the_gather_dequantizes_them(variant):
    """An int8 pool (values and a scale per token and KV head): the kernel dequantizes each row as it repacks it,
    to the bfloat16 values ``KVCache.gather`` returns, so its output is bit for bit the bfloat16 kernel's over
    the gathered copy, and within bfloat16 rounding of the float64 reference over those values."""
    kern = kernel if variant == "native" else portable_kernel()
    P, Hq, Hkv, D, Q, n_cached = 16, 9, 3, 64, 70, 300
    torch.manual_seed(11)
    kv = KVCache(1, 40, P, Hkv, D, torch.bfloat16, "cpu", layout="HSD", kv_dtype=torch.int8)
    L = n_cached + Q
    slots = torch.randperm(40 * P)[:L]
    kv.write(0, slots, torch.randn(L, Hkv, D).bfloat16(), torch.randn(L, Hkv, D).bfloat16())
    q = (torch.randn(Q, Hq, D) * 2).bfloat16()
    out = kern.paged(q, kv, 0, slots)
    k, v = kv.gather(0, slots)                                            # (Hkv, L, D) bfloat16
    assert torch.equal(out, kern(q, k.contiguous(), v.contiguous(), torch.arange(L)))
    ref = reference(q, k, v, torch.arange(L))
    err, rounding = (out.double() - ref).abs(), (ref.bfloat16().double() - ref).abs()
    assert err.max().item() <= 2 * rounding.max().item() + 2e-3
    with pytest.raises(ValueError, match="int8 with float32 scales"):
        kern(q, kv.k[0], kv.v[0], slots)                                  # int8 pages without their scales


def test_output_written_in_place_and_inputs_checked():
    q, k, v, slots = case(20, 30, 9, 3, 64, 4)
    out = torch.full_like(q, float("nan"))
    assert kernel(q, k, v, slots, out=out) is out and not out.isnan().any()
    with pytest.raises(ValueError, match="outside the pool"):
        kernel(q, k, v, torch.cat([slots[:-1], torch.tensor([k.shape[1]])]))
    with pytest.raises(ValueError, match="L >= Q"):
        kernel(q, k, v, slots[:10])
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(q.float(), k, v, slots)                                    # float32 queries over bfloat16 pages
    with pytest.raises(ValueError, match="of q's dtype"):
        kernel(q, k.float(), v.float(), slots)                            # and bfloat16 ones over float32 pages
    out32 = torch.full_like(q, float("nan"), dtype=torch.float32)
    assert kernel(q.float(), k.float(), v.float(), slots, out=out32) is out32 and not out32.isnan().any()
    assert not PrefillKernel.supports(9, 3, 48) and not PrefillKernel.supports(32, 1, 64)
    assert PrefillKernel.supports(32, 8, 128)


def _backend(dtype, num_pages, P=16, Hq=9, Hkv=3, D=64, cpu_kernel=True, model=torch.bfloat16):
    """A backend over a pool of random pages: ``dtype`` bfloat16 or float32, or int8 (pages of a ``model`` model)."""
    if dtype == torch.int8:
        kv = KVCache(1, num_pages, P, Hkv, D, model, "cpu", layout="HSD", kv_dtype=torch.int8)
        slots = torch.arange(num_pages * P)
        kv.write(0, slots, torch.randn(len(slots), Hkv, D).to(model), torch.randn(len(slots), Hkv, D).to(model))
    else:
        kv = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD")
        for t in kv.k + kv.v:
            t.normal_()
    return kv, create_backend("torch", kv=kv, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, cpu_kernel=cpu_kernel)


class _Counting:
    """The kernel, recording each call's query count."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def paged(self, q, *args, **kwargs):
        self.calls.append(q.shape[0])
        return self.kernel.paged(q, *args, **kwargs)


def test_the_backend_takes_the_kernel_for_every_prefill_chunk(monkeypatch):
    """In a batch of a cold prefill, chunks over cached prefixes (short and long) and decode rows, a bfloat16
    pool, or an int8 one of a bfloat16 model, sends every prefill chunk through the kernel (where it runs
    vdpbf16ps), and a float32 pool or a float32 model's int8 one too (where its float32 path is vectorized: AVX);
    each matches the reference."""
    from engine.attention import BatchLayout

    specs = [(40, 40), (17, 300), (150, 700), (1, 90), (3, 50)]
    P, rng = 16, random.Random(9)
    num_pages = sum(-(-kl // P) for _, kl in specs) + 3
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-kl // P))] for _, kl in specs]
    slots = [t[i // P] * P + i % P for (ql, kl), t in zip(specs, tables) for i in range(kl - ql, kl)]
    layout = BatchLayout([q for q, _ in specs], [k for _, k in specs], tables, torch.tensor(slots))
    from engine.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "force_prefill_kernel", True)   # wherever it loaded: no probe
    for dtype, model in ((torch.bfloat16, None), (torch.int8, torch.bfloat16), (torch.float32, None),
                         (torch.int8, torch.float32)):
        torch.manual_seed(1)
        kv, backend = _backend(dtype, num_pages, model=model or dtype)
        calls = []
        if backend.prefill_kernel is not None:
            backend.prefill_kernel = _Counting(backend.prefill_kernel, calls)
        T = layout.num_tokens
        act = kv.dtype
        q = torch.randn(T, 9, 64).to(act)
        backend.plan(layout)
        out = backend.forward(0, q, torch.randn(T, 3, 64).to(act), torch.randn(T, 3, 64).to(act))
        ref = reference_attention(kv, 0, layout, q)   # over the pages as gathered (int8: dequantized)
        tol = 2e-2 if act == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
        if act == torch.float32:   # float32 pages, or int8 ones of a float32 model
            assert calls == ([40, 17, 150] if kernel.vectorized(torch.float32) else [])
            assert (backend.prefill_kernel is None) == (not kernel.vectorized(torch.float32))
        elif kernel.dpbf16:
            assert calls == [40, 17, 150]
        else:
            assert backend.prefill_kernel is None   # the portable loops never replace torch's fused kernel


def test_the_probe_decides_and_forcing_overrides_it(monkeypatch):
    """With ``force_prefill_kernel`` None the backend takes the kernel only where ``prefill_kernel_wins`` measured it
    faster than torch's path; False keeps torch's path even then; the probe itself times both and answers once."""
    from engine.attention import torch_backend

    if not kernel.dpbf16:
        pytest.skip("the kernel runs only on vdpbf16ps (AVX512-BF16), which this CPU lacks")
    for verdict in (True, False):
        monkeypatch.setattr(torch_backend, "prefill_kernel_wins", lambda *a, v=verdict: v)
        assert (_backend(torch.bfloat16, 8)[1].prefill_kernel is not None) == verdict
    monkeypatch.setattr(torch_backend, "prefill_kernel_wins", lambda *a: True)
    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "force_prefill_kernel", False)
    assert _backend(torch.bfloat16, 8)[1].prefill_kernel is None
    monkeypatch.undo()
    from engine.attention.cpu_kernel import load_prefill

    first = torch_backend.prefill_kernel_wins(load_prefill(), 9, 3, 64)
    assert isinstance(first, bool) and torch_backend.prefill_kernel_wins(load_prefill(), 9, 3, 64) is first


def test_the_float32_probe_decides(monkeypatch):
    """A float32 pool takes the kernel only where ``prefill_kernel_wins`` measured its float32 path faster than
    torch's (asked with the pool's dtype), and the probe answers once per dtype."""
    from engine.attention import torch_backend
    from engine.attention.cpu_kernel import load_prefill

    if not kernel.vectorized(torch.float32):
        pytest.skip("the float32 path is taken only where it is vectorized (AVX), which this CPU lacks")
    asked = []
    for verdict in (True, False):
        monkeypatch.setattr(torch_backend, "prefill_kernel_wins", lambda *a, v=verdict: asked.append(a[-1]) or v)
        assert (_backend(torch.float32, 8)[1].prefill_kernel is not None) == verdict
    assert asked == [torch.float32, torch.float32]
    monkeypatch.undo()
    first = torch_backend.prefill_kernel_wins(load_prefill(), 9, 3, 64, torch.float32)
    again = torch_backend.prefill_kernel_wins(load_prefill(), 9, 3, 64, torch.float32)
    assert isinstance(first, bool) and again is first
