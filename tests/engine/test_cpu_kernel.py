"""The compiled CPU decode-attention kernel (engine/attention/cpu_kernel.py) against the plain reference."""

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention import BatchLayout, create_backend
from engine.attention.cpu_kernel import SOURCE, DecodeKernel, KernelRows
from engine.cpu_build import build
from engine.attention.reference import reference_attention
from engine.kv_pool import KVCache
from kernel_build import KernelBuild, built_for, skip_off_x86_64

BUILD = KernelBuild(lambda: DecodeKernel(build(SOURCE)))   # skipped only without a compiler on PATH
kernel = BUILD.value
pytestmark = BUILD.skip_mark()
_built = BUILD.autouse_require()   # a compile error fails every test here


def paged_rows(rng, lens, page_size, num_pages):
    """Each row's pages, drawn at random from the pool (no two rows share one)."""
    free = list(range(num_pages))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // page_size))] for n in lens]


def reference_rows(q, k, v, tables, lens, P):
    """Softmax attention in float64, row by row: (out (B, Hq, D), lse (B, Hq))."""
    B, Hq, D = q.shape
    G = Hq // k.shape[0]
    out, lse = torch.zeros(B, Hq, D, dtype=torch.float64), torch.full((B, Hq), -math.inf, dtype=torch.float64)
    for b, (pages, n) in enumerate(zip(tables, lens)):
        if n == 0:
            continue
        slots = torch.tensor([pages[i // P] * P + i % P for i in range(n)])
        kk = k[:, slots].double().repeat_interleave(G, 0)             # (Hq, n, D)
        vv = v[:, slots].double().repeat_interleave(G, 0)
        s = torch.einsum("hd,hnd->hn", q[b].double(), kk) / math.sqrt(D)
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), vv)
        lse[b] = torch.logsumexp(s, -1)
    return out, lse


def portable_kernel():
    """The kernel built without AVX512-BF16 (the float32-widening scores every x86 CPU runs), where
    the default build uses vdpbf16ps: both paths are tested on a machine that has it."""
    if not kernel.dpbf16:
        return kernel
    return DecodeKernel(build(SOURCE, extra_flags=("-mno-avx512bf16",)))


def avx2_kernel():
    """The kernel built for AVX2 only (``AGENTRT_KERNEL_MARCH=x86-64-v3``), as on most users' CPUs."""
    return built_for("x86-64-v3", lambda: DecodeKernel(build(SOURCE)))


@pytest.mark.parametrize("variant", ["native", "portable", "x86-64-v3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("Hq,Hkv,D,P", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 24, 1), (12, 3, 64, 128)])
def test_kernel_matches_reference(variant, dtype, tol, Hq, Hkv, D, P):
    """Rows on both sides of the 256-key chunk boundary, pages scattered over the pool, GQA groups of
    1-4, the two compiled head dims and a generic one; output and log-sum-exp; with and without the
    AVX512-BF16 scores."""
    kern = {"native": lambda: kernel, "portable": portable_kernel, "x86-64-v3": avx2_kernel}[variant]()
    if variant != "native":
        assert not kern.dpbf16   # no AVX512-BF16 in either build
    rng = random.Random(Hq * 1000 + D + P)
    torch.manual_seed(D + P)
    lens = [1, 15, 16, 17, 255, 256, 257, 600, 1100]
    num_pages = sum(-(-n // P) for n in lens) + 7
    k = torch.randn(Hkv, num_pages * P, D).to(dtype)
    v = torch.randn(Hkv, num_pages * P, D).to(dtype)
    q = (torch.randn(len(lens), Hq, D) * 2).to(dtype)
    tables = paged_rows(rng, lens, P, num_pages)
    lse = torch.empty(len(lens), Hq)
    out = kern(q, k, v, KernelRows(tables, lens, P), lse=lse)
    ref, ref_lse = reference_rows(q, k, v, tables, lens, P)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_a_row_without_keys_gives_zeros_and_minus_infinity():
    k = torch.randn(2, 64, 16)
    q = torch.randn(2, 4, 16)
    lse = torch.empty(2, 4)
    out = kernel(q, k, k.clone(), KernelRows([[], [3]], [0, 5], 16), lse=lse)
    assert torch.equal(out[0], torch.zeros(4, 16)) and torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    ref, _ = reference_rows(q[1:], k, k, [[3]], [5], 16)
    torch.testing.assert_close(out[1].double(), ref[0], atol=1e-5, rtol=1e-5)


def test_rows_are_checked_against_their_pages_and_the_pool():
    with pytest.raises(ValueError, match="needs 2 pages"):
        KernelRows([[1]], [17], 16)
    k = torch.zeros(1, 4 * 16, 8)                                    # a pool of 4 pages
    with pytest.raises(ValueError, match="page 4 is outside a pool of 4 pages"):
        kernel(torch.zeros(1, 1, 8), k, k, KernelRows([[0, 4]], [20], 16))


def test_large_scores_do_not_overflow():
    """Scores of several hundred (the exponent is taken after subtracting the chunk's maximum)."""
    k = torch.randn(1, 512, 32)
    q = torch.randn(1, 2, 32) * 40
    lens, tables = [512], [list(range(32))]
    lse = torch.empty(1, 2)
    out = kernel(q, k, k.clone(), KernelRows(tables, lens, 16), lse=lse)
    ref, ref_lse = reference_rows(q, k, k, tables, lens, 16)
    assert torch.isfinite(out).all() and lse.abs().max() > 100
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_a_peaked_softmax_matches_reference(dtype, tol):
    """Queries 25x a standard normal: for a good share of keys exp(score - max) falls below float32's
    smallest normal, where their products with the values are subnormal (the kernel flushes those,
    kernel_math.h ``subnormals_flushed``); the output is still the float64 softmax's."""
    rng = random.Random(5)
    torch.manual_seed(5)
    lens, P, Hq, Hkv, D = [300, 700], 16, 9, 3, 64
    num_pages = sum(-(-n // P) for n in lens) + 3
    k = torch.randn(Hkv, num_pages * P, D).to(dtype)
    v = torch.randn(Hkv, num_pages * P, D).to(dtype)
    q = (torch.randn(len(lens), Hq, D) * 25).to(dtype)
    tables = paged_rows(rng, lens, P, num_pages)
    ref, _ = reference_rows(q, k, v, tables, lens, P)
    slots = torch.tensor([tables[0][i // P] * P + i % P for i in range(lens[0])])
    s = torch.einsum("hd,hnd->hn", q[0].double(), k[:, slots].double().repeat_interleave(Hq // Hkv, 0)) / D ** 0.5
    below = (s - s.max(-1, keepdim=True).values).exp() < torch.finfo(torch.float32).tiny
    assert float(below.double().mean()) > 0.2                    # exp(s - max) under float32's smallest normal
    out = kernel(q, k, v, KernelRows(tables, lens, P))
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_the_kernel_leaves_torchs_subnormals_as_they_were():
    """The kernel flushes subnormals in its threads (the SSE control register's FTZ and DAZ bits) and puts the
    bits back: torch's own arithmetic afterwards, on the same OpenMP threads, still gives subnormals."""
    k = torch.randn(3, 64 * 16, 64)
    q = torch.randn(8, 9, 64) * 12
    kernel(q, k, k.clone(), KernelRows([[i * 8 + j for j in range(8)] for i in range(8)], [128] * 8, 16))
    tiny = torch.full((1 << 22,), 1e-39)                          # subnormal; torch splits it over the threads
    assert bool(((tiny * 3) > 0).all()) and bool(((tiny + tiny) == 2e-39).all())


def backend_batch(rng, specs, shared_pages, P, num_pages):
    free = list(range(num_pages))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_pages)]
    tables, slots = [], []
    for ql, kl in specs:
        n = -(-kl // P)
        pages = (shared + [free.pop() for _ in range(max(0, n - len(shared)))])[:n]
        tables.append(pages)
        slots.extend(pages[i // P] * P + i % P for i in range(kl - ql, kl))
    return BatchLayout([q for q, _ in specs], [k for _, k in specs], tables, torch.tensor(slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared_pages", [0, 3])
def test_backend_decode_through_the_kernel_matches_reference(dtype, shared_pages):
    """The torch backend with the kernel: decode rows (with a prefix every row shares: merged with the
    matmul over it), speculative verifications (a decode row per query), a prefill chunk beside them."""
    P, Hq, Hkv, D = 16, 6, 2, 32
    rng = random.Random(shared_pages)
    torch.manual_seed(shared_pages)
    specs = [(1, 300), (1, 60), (4, 90), (1, 49), (1, 600)] + ([] if shared_pages else [(20, 20)])
    num_pages = 120
    kv = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD")
    for t in kv.k + kv.v:
        t.normal_()
    backend = create_backend("torch", kv=kv, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    assert backend.kernel is not None
    layout = backend_batch(rng, specs, shared_pages, P, num_pages)
    T = layout.num_tokens
    q = torch.randn(T, Hq, D, dtype=dtype)
    backend.plan(layout)
    out = backend.forward(0, q, torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype))
    ref = reference_attention(kv, 0, layout, q)
    assert backend.kernel_decode is not None and backend.decode is None and backend.cascade is None
    assert (backend.kernel_decode.shared is not None) == bool(shared_pages)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_without_the_kernel_the_torch_plans_serve():
    kv = KVCache(1, 8, 16, 2, 32, torch.float32, "cpu", layout="HSD")
    backend = create_backend("torch", kv=kv, num_heads=4, num_kv_heads=2, head_dim=32, cpu_kernel=False)
    assert backend.kernel is None
    backend.plan(BatchLayout([1], [5], [[2]], torch.tensor([2 * 16 + 4])))
    assert backend.kernel_decode is None and (backend.decode is not None or backend.cascade is not None)


def _rope_cfg(head_dim: int, max_pos: int) -> SimpleNamespace:
    """What RotaryEmbedding reads of a ModelConfig: plain RoPE, theta 10000."""
    return SimpleNamespace(head_dim=head_dim, max_position_embeddings=max_pos, rope_theta=10000.0,
                           rope_scaling={}, partial_rotary_factor=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,Hq,Hkv,D", [(1, 9, 3, 64), (37, 9, 3, 64), (5, 8, 2, 128), (3, 4, 4, 24)])
def test_rope_store_is_the_models_rope_and_the_pools_write(dtype, T, Hq, Hkv, D):
    """The C RoPE + K/V write against RopeTable.apply and KVCache.write: bit for bit (bfloat16 rounds each
    product and the sum as torch does; float32 keeps the products apart), slots scattered over the pool
    (37 rows: the threaded path), nothing else in the pool touched."""
    from engine.models.llama import RotaryEmbedding

    torch.manual_seed(T * D)
    P, num_pages = 16, 64
    qkv = (torch.randn(T, Hq + 2 * Hkv, D) * 3).to(dtype)
    table = RotaryEmbedding(_rope_cfg(D, 8192)).table(torch.randint(0, 8000, (T,)), dtype)
    slots = torch.randperm(num_pages * P)[:T]
    kv_ref = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD")
    kv = KVCache(1, num_pages, P, Hkv, D, dtype, "cpu", layout="HSD")
    for a, b in zip(kv_ref.k + kv_ref.v, kv.k + kv.v):
        a.normal_()
        b.copy_(a)
    rotated = table.apply(qkv[:, :Hq + Hkv])
    kv_ref.write(0, slots, rotated[:, Hq:], qkv[:, Hq + Hkv:])
    q = kernel.rope_store(qkv, table.cos, table.signed_sin, slots, kv.k[0], kv.v[0], Hq)
    assert torch.equal(q, rotated[:, :Hq])
    assert torch.equal(kv.k[0], kv_ref.k[0]) and torch.equal(kv.v[0], kv_ref.v[0])


def test_rope_store_refuses_mismatched_shapes():
    kv = KVCache(1, 4, 16, 2, 32, torch.float32, "cpu", layout="HSD")
    cos = torch.ones(3, 1, 32)
    with pytest.raises(ValueError, match="contiguous qkv"):     # 4 heads + 2 x 2 is 8, not 7
        kernel.rope_store(torch.zeros(3, 7, 32), cos, cos, torch.arange(3), kv.k[0], kv.v[0], 4)
    with pytest.raises(ValueError, match="int64 slots"):
        kernel.rope_store(torch.zeros(3, 8, 32), cos, cos, torch.arange(3, dtype=torch.int32), kv.k[0], kv.v[0], 4)
    with pytest.raises(ValueError, match="k and v"):             # a pool of another head dim
        other = KVCache(1, 4, 16, 2, 16, torch.float32, "cpu", layout="HSD")
        kernel.rope_store(torch.zeros(3, 8, 32), cos, cos, torch.arange(3), other.k[0], other.v[0], 4)
    with pytest.raises(ValueError, match="one dtype"):
        kernel.rope_store(torch.zeros(3, 8, 32), cos.bfloat16(), cos, torch.arange(3), kv.k[0], kv.v[0], 4)


def test_backend_stores_in_c_only_where_every_slot_is_in_the_pool():
    """rotate_and_store is offered with the kernel and slots inside the pool; a forced torch plan, the
    kernel off, or a slot outside the pool (which the C side would write unchecked) leave it to the
    layer's own RoPE and KVCache.write, which raises on that slot as before."""
    from engine.models.llama import RotaryEmbedding

    P, Hq, Hkv, D = 16, 4, 2, 32
    kv = KVCache(1, 8, P, Hkv, D, torch.float32, "cpu", layout="HSD")
    table = RotaryEmbedding(_rope_cfg(D, 256)).table(torch.tensor([4]), torch.float32)
    qkv = torch.randn(1, Hq + 2 * Hkv, D)
    inside = BatchLayout([1], [5], [[2]], torch.tensor([2 * P + 4]))
    outside = BatchLayout([1], [5], [[8]], torch.tensor([8 * P + 4]))
    backend = create_backend("torch", kv=kv, num_heads=Hq, num_kv_heads=Hkv, head_dim=D)
    backend.plan(inside)
    q = backend.rotate_and_store(0, qkv, table)
    assert q is not None and torch.equal(kv.k[0][:, 2 * P + 4], table.apply(qkv[:, Hq:Hq + Hkv])[0])
    backend.plan(outside)
    assert backend.rotate_and_store(0, qkv, table) is None
    backend.force_decode_plan = "torch"
    backend.plan(inside)
    assert backend.rotate_and_store(0, qkv, table) is None
    off = create_backend("torch", kv=kv, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, cpu_kernel=False)
    off.plan(inside)
    assert off.rotate_and_store(0, qkv, table) is None


@pytest.mark.slow
def test_build_is_cached_and_a_broken_source_says_why(tmp_path, monkeypatch):
    # a source of its own: caching does not depend on what is compiled, and the kernels' own sources
    # build in the shared cache above (decode_attention.c alone took 8.6 CPU-s to compile afresh here)
    monkeypatch.setenv("AGENTRT_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "small.c"
    source.write_text("int small(void) { return 7; }\n")
    first = build(source)
    stamp = first.stat().st_mtime_ns
    assert build(source) == first and first.stat().st_mtime_ns == stamp   # cached: not rebuilt
    bad = tmp_path / "broken.c"
    bad.write_text("int f(void) { return undeclared_name; }\n")
    with pytest.raises(RuntimeError, match="undeclared_name"):
        build(bad)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler' is not on PATH"):
        build(bad)


def test_processes_that_need_one_library_at_once_compile_it_once(tmp_path):
    """On an empty cache (a fresh machine: the suite's processes and servers start at once) the first
    builder holds the library's lock; the others wait and load its result instead of compiling it again.
    The compiler here is a wrapper that records each compile and takes a second over it."""
    import ctypes
    import os
    import shutil
    import subprocess
    import sys

    real = shutil.which("cc") or shutil.which("gcc")
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "slowcc"
    wrapper.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] || {{ echo compile >> {log}; sleep 1; }}\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    source = tmp_path / "tiny.c"
    source.write_text("int answer(void) { return 42; }\n")
    cache = tmp_path / "cache"
    code = ("import sys; from pathlib import Path; from engine.cpu_build import build; "
            "print(build(Path(sys.argv[1])))")
    env = {**os.environ, "CC": str(wrapper), "AGENTRT_KERNEL_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(source)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len(set(outs)) == 1 and outs[0].endswith(".so")
    assert log.read_text().splitlines() == ["compile"]                  # one compile, not three
    assert ctypes.CDLL(outs[0]).answer() == 42
    assert [p.name for p in cache.iterdir() if p.suffix == ".so"] == [Path(outs[0]).name]   # no temp file left


def test_the_shared_header_is_included_and_keys_the_cache(tmp_path, monkeypatch):
    """A kernel includes engine/csrc/kernel_math.h from the include path; a change to a header rebuilds
    every kernel (its key changes), and the header's helpers compute what they claim."""
    import ctypes
    import math

    from engine import cpu_build
    monkeypatch.setenv("AGENTRT_KERNEL_CACHE", str(tmp_path / "cache"))
    probe = tmp_path / "probe.c"
    probe.write_text('#include "kernel_math.h"\nfloat probe_exp(float x) { return exp_nonpos(x); }\n'
                     'uint16_t probe_bf16(float x) { return f32_to_bf16(x); }\n')
    first = build(probe)
    lib = ctypes.CDLL(str(first))
    lib.probe_exp.restype, lib.probe_exp.argtypes = ctypes.c_float, [ctypes.c_float]
    lib.probe_bf16.restype, lib.probe_bf16.argtypes = ctypes.c_uint16, [ctypes.c_float]
    for x in (0.0, -1e-3, -0.5, -1.0, -10.0, -50.0, -86.0):
        assert lib.probe_exp(x) == pytest.approx(math.exp(x), rel=2e-7), x
    one_third = torch.tensor([1 / 3]).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
    assert lib.probe_bf16(1 / 3) == one_third   # nearest even, as torch rounds
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "kernel_math.h").write_text((cpu_build.INCLUDE_DIR / "kernel_math.h").read_text() + "\n/* v2 */\n")
    monkeypatch.setattr(cpu_build, "INCLUDE_DIR", headers)
    rebuilt = build(probe)
    assert rebuilt != first and rebuilt.exists()

def test_skips_only_without_a_compiler_and_fails_on_a_compile_error(tmp_path, monkeypatch):
    """The guard above: a broken source with a compiler on PATH is an error, never a skip; with no
    compiler on PATH (CC unset, an empty PATH) it is a skip whose reason says so."""
    monkeypatch.setenv("AGENTRT_KERNEL_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return 1 }\n")
    guard = KernelBuild(lambda: build(broken))
    assert guard.skip_reason is None and guard.value is None
    assert isinstance(guard.error, RuntimeError) and "broken.c" in str(guard.error)
    with pytest.raises(pytest.fail.Exception, match="did not build although a compiler is on PATH"):
        guard.require()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    guard = KernelBuild(lambda: build(broken))
    assert guard.error is None and guard.value is None
    assert guard.skip_reason == "no C compiler: neither cc nor gcc is on PATH (shutil.which found none)"
    guard.require()   # no error: the skip mark alone decides
    monkeypatch.setenv("CC", "no-such-cc")
    assert "CC='no-such-cc' is not on PATH" in KernelBuild(lambda: None).skip_reason


def _zmm_instructions(lib) -> int:
    """Instructions of ``lib`` that use a 512-bit (AVX-512) register."""
    import shutil
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not on PATH: cannot read the built library's instructions")
    text = subprocess.run([objdump, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return sum("%zmm" in line for line in text.splitlines())


@pytest.mark.slow
def test_kernel_march_builds_for_the_named_target(monkeypatch):
    """``AGENTRT_KERNEL_MARCH=x86-64-v3``: the kernels built for AVX2 only (what most users' CPUs run), on
    a machine that may have more: no AVX-512 instruction in the library, its own cache entry, and it
    computes what the native build does. A value that is no target name is refused, naming the variable."""
    from engine.cpu_build import kernel_march

    skip_off_x86_64("x86-64-v3")
    # the shared kernel cache, as a server uses it: each build is compiled once per machine, so only a fresh
    # machine pays the two compiles (9 s here), and the cache must keep the two targets apart
    monkeypatch.delenv("AGENTRT_KERNEL_MARCH", raising=False)
    native = build(SOURCE)
    monkeypatch.setenv("AGENTRT_KERNEL_MARCH", "x86-64-v3")
    assert kernel_march() == "x86-64-v3"
    avx2 = build(SOURCE)
    assert avx2 != native and avx2.parent == native.parent
    assert _zmm_instructions(avx2) == 0
    from engine.cpu_info import flags_line
    if " avx512f" in f" {flags_line()} ":
        assert _zmm_instructions(native) > 0   # the native build here does use AVX-512: the target mattered
    # what it computes: test_kernel_matches_reference's "x86-64-v3" variant
    for bad in ("x86-64 -v3", "-O0", "native;rm"):
        monkeypatch.setenv("AGENTRT_KERNEL_MARCH", bad)
        with pytest.raises(ValueError, match="AGENTRT_KERNEL_MARCH=.* is not a -march target name"):
            build(SOURCE)
