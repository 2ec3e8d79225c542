"""Batch-size buckets and static decode inputs (engine/graph_buckets.py): the padding rules, and a
padded decode step against the unpadded one on the torch attention backend."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import BatchLayout, create_backend
from engine.graph_buckets import SCRATCH_PAGE, DecodeBuffers, batch_buckets, bucket_for
from engine.kv_pool import KVCache

HQ, HKV, D, P = 4, 2, 8, 4


def test_buckets_are_powers_of_two_then_multiples_of_eight_up_to_max():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(1) == (1,)
    assert batch_buckets(3) == (1, 2, 3)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    for bad in (0, -4, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_num_seqs"):
            batch_buckets(bad)


def test_bucket_for_is_the_smallest_that_holds_the_batch():
    for m in (1, 5, 8, 37, 64):
        buckets = batch_buckets(m)
        for n in range(1, m + 1):
            assert bucket_for(n, buckets) == min(b for b in buckets if b >= n)
            assert bucket_for(n, buckets) - n < max(8, (n + 1) // 2 + 1)   # padding stays small
        with pytest.raises(ValueError, match="past the largest bucket"):
            bucket_for(m + 1, buckets)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, batch_buckets(8))


def test_fill_copies_real_rows_and_pads_to_the_scratch_page():
    buf = DecodeBuffers(max_batch=16, max_pages=4, page_size=P)
    ptrs = [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.kv_lens, buf.page_table)]
    big = buf.fill([5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 4, 5, 16, 3, 3, 9, 2, 7],
                   [[3], [4, 9], [5, 6], [7, 8, 10, 11], [12], [13], [14, 15, 16], [17], [18, 19]])
    assert big.bucket == 16 and big.num_real == 9
    step = buf.fill([21, 22, 23], [6, 1, 13], [[2, 7, 9], [4], [8, 5, 11, 12]])
    assert step.bucket == 4 and step.num_real == 3
    assert step.input_ids.tolist() == [21, 22, 23, 0]
    assert step.positions.tolist() == [5, 0, 12, 0]
    # a real row's slot is its last key's: page (position // P) of its table, offset position % P
    assert step.slot_mapping.tolist() == [7 * P + 1, 4 * P + 0, 12 * P + 0, SCRATCH_PAGE * P]
    assert step.kv_lens.tolist() == [6, 1, 13, 1]
    assert step.page_table.tolist() == [[2, 7, 0, 0], [4, 0, 0, 0], [8, 5, 11, 12], [0, 0, 0, 0]]
    # the same storage every time: a captured graph reads the buffers in place
    assert ptrs == [t.data_ptr() for t in (buf.input_ids, buf.positions, buf.slot_mapping, buf.kv_lens,
                                           buf.page_table)]
    assert step.input_ids.data_ptr() == buf.input_ids.data_ptr()
    assert step.layout(P).page_tables == [[2, 7], [4], [8, 5, 11, 12], [0]]


def test_fill_refuses_rows_it_cannot_hold():
    buf = DecodeBuffers(max_batch=4, max_pages=2, page_size=P)
    with pytest.raises(ValueError, match="differ in length"):
        buf.fill([1, 2], [3], [[1], [2]])
    with pytest.raises(ValueError, match="row 0: 5 keys need 2 pages"):
        buf.fill([1], [5], [[1]])
    with pytest.raises(ValueError, match="at most 2"):
        buf.fill([1], [9], [[1, 2, 3]])
    with pytest.raises(ValueError, match="row 1: 0 keys"):
        buf.fill([1, 2], [1, 0], [[1], [2]])
    with pytest.raises(ValueError, match="past the largest bucket"):
        buf.fill([1] * 5, [1] * 5, [[1]] * 5)
    with pytest.raises(ValueError, match="largest bucket must be max_batch"):
        DecodeBuffers(max_batch=8, max_pages=2, page_size=P, buckets=(1, 2, 4))


def random_pool(num_pages: int) -> KVCache:
    kv = KVCache(2, num_pages, P, HKV, D, torch.float32, "cpu", layout="HSD")
    for t in kv.k + kv.v:
        t.normal_()
    return kv


@pytest.mark.parametrize("plan", [None, "union", "cascade"])
def test_padded_decode_matches_the_unpadded_step(plan):
    """Five decode rows padded to 8: the real rows' attention output equals the unpadded step's, and the
    padding rows wrote nothing but the scratch page (every other page as the unpadded step left it)."""
    rng = random.Random(3)
    torch.manual_seed(3)
    num_pages = 64
    kv_lens = [7, 1, 12, 4, 9]
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-k // P))] for k in kv_lens]
    q = torch.randn(len(kv_lens), HQ, D)
    k_new, v_new = torch.randn(len(kv_lens), HKV, D), torch.randn(len(kv_lens), HKV, D)
    pools = [random_pool(num_pages), random_pool(num_pages)]
    for a, b in zip(pools[1].k + pools[1].v, pools[0].k + pools[0].v):
        a.copy_(b)

    def run(kv, layout, pad):
        backend = create_backend("torch", kv=kv, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
        backend.force_decode_plan = plan
        backend.plan(layout)
        zq, zkv = torch.zeros(pad, HQ, D), torch.zeros(pad, HKV, D)
        return backend.forward(1, torch.cat([q, zq]), torch.cat([k_new, zkv]), torch.cat([v_new, zkv]))

    slots = torch.tensor([t[(k - 1) // P] * P + (k - 1) % P for t, k in zip(tables, kv_lens)])
    ref = run(pools[0], BatchLayout([1] * 5, kv_lens, tables, slots), 0)
    step = DecodeBuffers(max_batch=16, max_pages=4, page_size=P).fill([0] * 5, kv_lens, tables)
    assert step.bucket == 8
    out = run(pools[1], step.layout(P), step.bucket - 5)
    torch.testing.assert_close(out[:5], ref, atol=1e-6, rtol=1e-6)
    assert torch.isfinite(out[5:]).all()
    for a, b in zip(pools[1].k + pools[1].v, pools[0].k + pools[0].v):   # (Hkv, pages * P, D)
        torch.testing.assert_close(a[:, P:], b[:, P:], atol=0, rtol=0)
