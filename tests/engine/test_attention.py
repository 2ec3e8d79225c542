"""The torch attention backend against the plain reference, on random paged batches."""

import random

import pytest
import torch

from engine.attention import BatchLayout, create_backend
from engine.attention.reference import reference_attention
from engine.kv_pool import KVCache

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


@pytest.mark.parametrize("layout_name", ["HSD"])
@pytest.mark.parametrize("compact", [True, False])
def test_torch_backend_matches_reference(layout_name, compact):
    rng = random.Random(0 if compact else 1)
    torch.manual_seed(0)
    num_pages = 40 if compact else 400   # a sparse pool forces the gathered-union path
    kv = KVCache(2, num_pages, P, HKV, D, torch.float32, "cpu", layout=layout_name)
    for t in kv.k + kv.v:
        t.normal_()
    backend = create_backend("torch", kv=kv, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    # decode rows sharing a 2-page prefix, a cold prefill, a chunk over a cached prefix
    specs = [(1, 11), (1, 9), (5, 5), (1, 17), (3, 14)]
    layout = make_batch(rng, num_pages, specs, shared_prefix_pages=2, shuffle=not compact)
    T = layout.num_tokens
    q = torch.randn(T, HQ, D)
    k_new, v_new = torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    backend.plan(layout)
    decode_plan = backend.decode
    out = backend.forward(1, q, k_new, v_new)
    ref = reference_attention(kv, 1, layout, q)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the two planning modes were both exercised across the parameters
    assert isinstance(decode_plan[1], tuple) == compact


def test_write_then_gather_roundtrip_both_layouts():
    for layout in ("NHD", "HSD"):
        kv = KVCache(1, 8, P, HKV, D, torch.float32, "cpu", layout=layout)
        slots = torch.tensor([5, 9, 30])
        k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
        kv.write(0, slots, k, v)
        gk, gv = kv.gather(0, slots)
        torch.testing.assert_close(gk, k.transpose(0, 1))
        torch.testing.assert_close(gv, v.transpose(0, 1))


def test_unknown_backend_and_layout():
    with pytest.raises(ValueError, match="available"):
        create_backend("nope")
    with pytest.raises(ValueError, match="layout"):
        KVCache(1, 8, P, HKV, D, torch.float32, "cpu", layout="XYZ")
