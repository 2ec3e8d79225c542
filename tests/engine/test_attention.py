"""The torch attention backend against the plain reference, on random paged batches."""

import random

import pytest
import torch

from engine.attention import BatchLayout, create_backend
from engine.attention.reference import reference_attention
from engine.kv_pool import KVCache, zeros_on_first_write

HQ, HKV, D, P = 6, 2, 16, 4


def make_batch(rng, num_pages, specs, shared_prefix_pages=0, shuffle=True):
    """specs: list of (q_len, kv_len). Pages are random (or in order), optionally sharing a prefix."""
    free = list(range(num_pages - 1, 0, -1))
    if shuffle:
        rng.shuffle(free)
    shared = [free.pop() for _ in range(shared_prefix_pages)]
    tables, slots = [], []
    for ql, kl in specs:
        n = -(-kl // P)
        own = [free.pop() for _ in range(n - len(shared))] if n > len(shared) else []
        pages = (shared + own)[:n]
        tables.append(pages)
        slots.extend(pages[i // P] * P + i % P for i in range(kl - ql, kl))
    return BatchLayout([q for q, _ in specs], [k for _, k in specs], tables, torch.tensor(slots))


def random_backend(num_layers, num_pages, dtype=torch.float32, plan=None):
    """A torch backend over an HSD pool of random K/V; ``plan`` forces its decode plan."""
    kv = KVCache(num_layers, num_pages, P, HKV, D, dtype, "cpu", layout="HSD")
    for t in kv.k + kv.v:
        t.normal_()
    backend = create_backend("torch", kv=kv, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    backend.force_decode_plan = plan
    return kv, backend


def run_against_reference(kv, backend, layout, layer, dtype=torch.float32):
    """Plan ``layout``, run one layer on random q/k/v; returns (backend output, reference output)."""
    T = layout.num_tokens
    q = torch.randn(T, HQ, D, dtype=dtype)
    k_new, v_new = torch.randn(T, HKV, D, dtype=dtype), torch.randn(T, HKV, D, dtype=dtype)
    backend.plan(layout)
    out = backend.forward(layer, q, k_new, v_new)
    return out, reference_attention(kv, layer, layout, q)


@pytest.mark.parametrize("layout_name", ["HSD"])
@pytest.mark.parametrize("compact", [True, False])
def test_torch_backend_matches_reference(layout_name, compact):
    rng = random.Random(0 if compact else 1)
    torch.manual_seed(0)
    num_pages = 40 if compact else 400   # a sparse pool forces the gathered-union path
    kv, backend = random_backend(2, num_pages, plan="union")
    # decode rows sharing a 2-page prefix, a cold prefill, a chunk over a cached prefix
    specs = [(1, 11), (1, 9), (5, 5), (1, 17), (3, 14)]
    layout = make_batch(rng, num_pages, specs, shared_prefix_pages=2, shuffle=not compact)
    out, ref = run_against_reference(kv, backend, layout, 1)
    decode_plan = backend.decode
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the two planning modes were both exercised across the parameters
    assert isinstance(decode_plan[1], tuple) == compact


@pytest.mark.parametrize("case", ["shared-prefix", "distinct", "one-row", "scattered", "mixed-with-prefill",
                                  "long-rows-in-place"])
def test_cascade_decode_matches_reference(case):
    """The cascade plan (shared prefix once, each row's own pages, merged by log-sum-exp) against the
    plain reference, with rows of very different lengths so they fall into several padded groups."""
    rng = random.Random(hash(case) % 1000)
    torch.manual_seed(1)
    num_pages = 300
    kv, backend = random_backend(2, num_pages, plan="cascade")
    specs, shared, shuffle = {
        "shared-prefix": ([(1, 13), (1, 9), (1, 40), (1, 10), (1, 33)], 2, False),
        "distinct": ([(1, 5), (1, 61), (1, 17), (1, 2), (1, 18)], 0, False),
        "one-row": ([(1, 23)], 0, False),
        "scattered": ([(1, 21), (1, 14), (1, 50)], 3, True),          # shared pages not one range
        "mixed-with-prefill": ([(1, 12), (4, 4), (1, 30), (3, 15)], 2, True),
        "long-rows-in-place": ([(1, 300), (1, 9), (1, 270), (1, 14)], 1, False),  # own pages in one range
    }[case]
    layout = make_batch(rng, num_pages, specs, shared_prefix_pages=shared, shuffle=shuffle)
    out, ref = run_against_reference(kv, backend, layout, 0)
    plan = backend.cascade
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert backend.decode is None and plan is not None
    assert (plan.shared is not None) == (shared > 0)
    if case == "shared-prefix":
        assert isinstance(plan.shared, tuple) and len(plan.groups) >= 2   # a view; lengths 40, 33 apart from 9-13
    if case == "scattered":
        assert isinstance(plan.shared, torch.Tensor)                       # gathered
    assert sorted(b for b, _, _ in plan.in_place) == ([0, 2] if case == "long-rows-in-place" else [])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cascade_decode_in_half_precision_matches_reference(dtype):
    """Half-precision KV takes the other matmul orientation (keys as stored, scores transposed)."""
    rng = random.Random(7)
    torch.manual_seed(2)
    kv, backend = random_backend(1, 300, dtype, plan="cascade")
    layout = make_batch(rng, 300, [(1, 300), (1, 9), (1, 33), (1, 14), (2, 20)], shared_prefix_pages=1,
                        shuffle=False)
    out, ref = run_against_reference(kv, backend, layout, 0, dtype)
    assert backend.cascade.in_place and backend.cascade.groups
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_a_row_is_read_in_place_only_when_its_pages_are_one_run():
    """A row whose first and last pages are len-1 apart but whose pages are not p, p+1, ... (one page
    replaced by a far one) must be gathered: a view of the range would read another sequence's page."""
    torch.manual_seed(3)
    kv, backend = random_backend(1, 400, plan="cascade")
    run = list(range(100, 170))                     # 70 pages, 280 slots: long enough to be read in place
    broken = run[:30] + [300] + run[31:]            # first and last still 69 apart
    tables = [run, broken, list(range(10, 14))]
    kv_lens = [70 * P - 1, 70 * P - 2, 13]
    slots = [t[(kl - 1) // P] * P + (kl - 1) % P for t, kl in zip(tables, kv_lens)]
    layout = BatchLayout([1, 1, 1], kv_lens, tables, torch.tensor(slots))
    out, ref = run_against_reference(kv, backend, layout, 0)
    assert [b for b, _, _ in backend.cascade.in_place] == [0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_decode_plan_is_chosen_by_cost():
    """Distinct contexts take the cascade (the union would score every row against every context);
    a single row whose pages are one range takes the union, read in place without a copy."""
    kv = KVCache(1, 600, P, HKV, D, torch.float32, "cpu", layout="HSD")
    backend = create_backend("torch", kv=kv, num_heads=HQ, num_kv_heads=HKV, head_dim=D, cpu_kernel=False)
    rng = random.Random(3)
    backend.plan(make_batch(rng, 600, [(1, 64)] * 8, shuffle=False))
    assert backend.cascade is not None and backend.decode is None
    backend.plan(make_batch(rng, 600, [(1, 64)], shuffle=False))  # one row, its pages in one range: no copy
    assert backend.decode is not None and backend.cascade is None


def test_length_groups_bound_the_padding():
    from engine.attention.torch_backend import _GROUP_SLACK, _length_groups
    lengths = [5, 600, 7, 590, 40, 8, 45, 1]
    groups = _length_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for g in groups:
        assert lengths[g[0]] == max(lengths[b] for b in g)
        assert lengths[g[0]] * len(g) <= _GROUP_SLACK * sum(lengths[b] for b in g)
    assert len(groups) < len(lengths)  # rows of like length do share a group


def test_write_then_gather_roundtrip_both_layouts():
    for layout in ("NHD", "HSD"):
        kv = KVCache(1, 8, P, HKV, D, torch.float32, "cpu", layout=layout)
        slots = torch.tensor([5, 9, 30])
        k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
        kv.write(0, slots, k, v)
        gk, gv = kv.gather(0, slots)
        torch.testing.assert_close(gk, k.transpose(0, 1))
        torch.testing.assert_close(gv, v.transpose(0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_cpu_pool_reads_zero_and_takes_memory_only_where_written(dtype):
    """The pool's CPU tensors (``zeros_on_first_write``) are zeros of their shape and dtype that take memory
    only for the pages written: 512 MiB of them leave the process's resident set as it was (``torch.zeros``
    grows it by all 512 MiB), one written row adds a page or so, and the tensor keeps its memory alive."""
    import gc
    import os

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20

    rows = 2 ** 29 // (1024 * torch.empty((), dtype=dtype).element_size())
    before = resident_mib()
    pool = zeros_on_first_write((rows, 1024), dtype, "cpu")
    assert pool.shape == (rows, 1024) and pool.dtype == dtype and pool.is_contiguous()
    assert resident_mib() - before < 16
    pool[rows // 2] = 3
    gc.collect()
    assert resident_mib() - before < 16
    assert bool((pool[rows // 2] == 3).all()) and int(torch.count_nonzero(pool)) == 1024
    dense = torch.zeros((rows, 1024), dtype=dtype)
    assert resident_mib() - before > 400            # the measure sees what torch.zeros writes
    del dense


def test_unknown_backend_and_layout():
    with pytest.raises(ValueError, match="available"):
        create_backend("nope")
    with pytest.raises(ValueError, match="layout"):
        KVCache(1, 8, P, HKV, D, torch.float32, "cpu", layout="XYZ")


@pytest.mark.parametrize("plan", ["union", "cascade"])
def test_short_extends_join_the_decode_plans(plan):
    """Speculative verifications (a request's last token and its draft over its cached context) are
    served as one decode row per query, each seeing the keys up to its own position."""
    rng = random.Random(11)
    torch.manual_seed(4)
    kv, backend = random_backend(1, 200, plan=plan)
    layout = make_batch(rng, 200, [(5, 40), (1, 30), (3, 17), (16, 60), (6, 6), (17, 50)], shared_prefix_pages=2)
    out, ref = run_against_reference(kv, backend, layout, 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    rows = (backend.decode[0] if plan == "union" else backend.cascade.rows).tolist()
    assert len(rows) == 5 + 1 + 3 + 16                   # not the fresh prefill, not the 17-token extend
    assert [start for start, _, _, _ in backend.prefills] == [5 + 1 + 3 + 16, 5 + 1 + 3 + 16 + 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_over_a_cached_prefix_match_reference(dtype):
    """Prefill chunks over cached keys on both sides of _SDPA_MIN_Q (the masked SDPA path and the
    grouped one), beside a cold prefill and a decode row, against the reference."""
    from engine.attention.torch_backend import _SDPA_MIN_Q

    rng = random.Random(5)
    torch.manual_seed(5)
    specs = [(_SDPA_MIN_Q, _SDPA_MIN_Q + 37), (_SDPA_MIN_Q - 1, _SDPA_MIN_Q + 50), (40, 40), (1, 23),
             (_SDPA_MIN_Q + 3, 3 * _SDPA_MIN_Q + 1)]
    num_pages = sum(-(-kl // P) for _, kl in specs) + 2
    kv, backend = random_backend(1, num_pages, dtype)
    layout = make_batch(rng, num_pages, specs)
    out, ref = run_against_reference(kv, backend, layout, 0, dtype)
    assert [end - start for start, end, _, _ in backend.prefills] == [q for q, _ in specs if q > 1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("n_cached,ql", [(1, 130), (300, 128), (517, 200)])
def test_extend_attention_matches_the_masked_computation(n_cached, ql):
    """The unmasked split (cached keys for every query, the chunk's own keys causal, merged by log-sum-exp)
    against the plain masked softmax in float64, with grouped KV heads."""
    from engine.attention.torch_backend import _FLASH_CPU, extend_attention

    if _FLASH_CPU is None:
        pytest.skip("this torch has no fused CPU attention returning the log-sum-exp")
    torch.manual_seed(n_cached)
    kl = n_cached + ql
    q = torch.randn(ql, HQ, D)
    k, v = torch.randn(HKV, kl, D), torch.randn(HKV, kl, D)
    out = extend_attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, n_cached)   # k strided
    kr, vr = (t.repeat_interleave(HQ // HKV, dim=0).double() for t in (k, v))                # (Hq, kl, D)
    s = q.transpose(0, 1).double() @ kr.transpose(1, 2) / D ** 0.5                            # (Hq, ql, kl)
    s.masked_fill_(torch.arange(kl)[None, :] > torch.arange(n_cached, kl)[:, None], float("-inf"))
    ref = (torch.softmax(s, -1) @ vr).transpose(0, 1)                                         # (ql, Hq, D)
    assert out.shape == (ql, HQ, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_long_float32_chunks_over_a_cached_prefix_take_the_split(monkeypatch):
    """A float32 or bfloat16 chunk of at least _SDPA_MIN_Q queries over cached keys goes through
    extend_attention (a shorter one keeps the grouped path)."""
    from engine.attention import torch_backend
    from engine.attention.torch_backend import _SDPA_MIN_Q

    if torch_backend._FLASH_CPU is None:
        pytest.skip("this torch has no fused CPU attention returning the log-sum-exp")
    calls = []
    real = torch_backend.extend_attention
    monkeypatch.setattr(torch_backend, "extend_attention", lambda *a: calls.append(a[3]) or real(*a))
    specs = [(_SDPA_MIN_Q, _SDPA_MIN_Q + 37), (_SDPA_MIN_Q - 1, _SDPA_MIN_Q + 50)]
    for dtype in (torch.float32, torch.bfloat16):
        rng = random.Random(6)
        num_pages = sum(-(-kl // P) for _, kl in specs) + 2
        kv, backend = random_backend(1, num_pages, dtype)
        out, ref = run_against_reference(kv, backend, make_batch(rng, num_pages, specs), 0, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert calls == [37, 37]
