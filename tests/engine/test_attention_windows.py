"""Non-plain layers (sliding window, sinks, soft-cap, scale) in the torch backend against the plain
reference, on random paged batches: prefill, short and long extends over cached pages, decode."""

import random

import pytest
import torch

from engine.attention import BatchLayout
from engine.attention.base import AttentionBackend, LayerAttention
from engine.attention.reference import reference_attention
from tests.engine.test_attention import D, HKV, HQ, P, make_batch, random_backend

# one cold prefill longer than every window, a long extend over cached pages (goes past _DECODE_MAX_Q),
# a short extend (would be decode rows), decode rows of several lengths
SPECS = [(23, 23), (20, 37), (3, 26), (1, 19), (1, 9), (1, 2)]
SINKS = torch.linspace(-1.0, 2.0, HQ)
CASES = {
    "window": LayerAttention(window=5),
    "window-1": LayerAttention(window=1),
    "window-past-context": LayerAttention(window=64),
    "sinks": LayerAttention(sinks=SINKS),
    "softcap": LayerAttention(softcap=1.5),
    "scale": LayerAttention(scale=0.0625),
    "gpt-oss": LayerAttention(window=6, sinks=SINKS),
    "everything": LayerAttention(window=7, scale=0.3, softcap=2.0, sinks=SINKS),
}


@pytest.mark.parametrize("plan", [None, "cascade"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_attention_matches_reference(case, plan):
    torch.manual_seed(2)
    kv, backend = random_backend(3, 120, plan=plan)
    spec = CASES[case]
    backend.set_layer_attention([LayerAttention(), spec, LayerAttention(window=3)])
    layout = make_batch(random.Random(3), 120, SPECS, shared_prefix_pages=0)
    q = torch.randn(layout.num_tokens, HQ, D) * 3   # sharp scores: a wrong mask or cap shows
    for layer in range(3):
        k, v = torch.randn(layout.num_tokens, HKV, D), torch.randn(layout.num_tokens, HKV, D)
        backend.plan(layout)
        out = backend.forward(layer, q, k, v)
        ref = reference_attention(kv, layer, layout, q, backend.layer_attention[layer])
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_window_one_sees_only_its_own_token():
    """An oracle without the reference: with a window of 1 every query reads only its own value."""
    kv, backend = random_backend(1, 40, plan=None)
    backend.set_layer_attention([LayerAttention(window=1)])
    layout = make_batch(random.Random(4), 40, [(9, 9), (1, 14), (4, 20)])
    q, k, v = torch.randn(layout.num_tokens, HQ, D), torch.randn(layout.num_tokens, HKV, D), \
        torch.randn(layout.num_tokens, HKV, D)
    backend.plan(layout)
    out = backend.forward(0, q, k, v)
    torch.testing.assert_close(out, v.repeat_interleave(HQ // HKV, dim=1))


def test_keys_outside_the_window_do_not_matter():
    """Overwriting every key older than the window leaves the output as it was; a plain layer changes."""
    kv, backend = random_backend(2, 40, plan=None)
    backend.set_layer_attention([LayerAttention(window=4), LayerAttention()])
    pages = [5, 9, 2, 30, 11]
    layout = BatchLayout([2], [18], [pages], torch.tensor([pages[i // P] * P + i % P for i in (16, 17)]))
    q, k, v = torch.randn(2, HQ, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    backend.plan(layout)
    before = [backend.forward(layer, q, k, v) for layer in range(2)]
    old = torch.tensor([pages[i // P] * P + i % P for i in range(18 - 2 - 3)])   # older than 4 back of query 0
    for layer in range(2):
        kv.k[layer][:, old] = torch.randn_like(kv.k[layer][:, old])
        kv.v[layer][:, old] = torch.randn_like(kv.v[layer][:, old])
    after = [backend.forward(layer, q, None, None) for layer in range(2)]
    torch.testing.assert_close(after[0], before[0])
    assert not torch.allclose(after[1], before[1])


def test_a_backend_without_the_feature_refuses_it():
    kv, _ = random_backend(2, 8)
    base = AttentionBackend(kv, HQ, HKV, D)
    base.set_layer_attention([LayerAttention(), LayerAttention()])   # plain layers are fine
    with pytest.raises(ValueError, match=r"layers \[1\] ask for window 4, sinks"):
        base.set_layer_attention([LayerAttention(), LayerAttention(window=4, sinks=SINKS)])


@pytest.mark.parametrize("field, value", [("window", 0), ("softcap", -1.0), ("scale", 0.0)])
def test_layer_attention_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        LayerAttention(**{field: value})


def test_every_layer_special_skips_the_plain_plans():
    """With no plain layer (Gemma 3, gpt-oss) a step builds only the masked plan, and it still matches."""
    torch.manual_seed(5)
    kv, backend = random_backend(2, 120, plan=None)
    backend.set_layer_attention([LayerAttention(window=4, sinks=SINKS), LayerAttention(scale=0.1)])
    layout = make_batch(random.Random(6), 120, SPECS)
    q = torch.randn(layout.num_tokens, HQ, D) * 3
    backend.plan(layout)
    assert backend.prefills == [] and backend.kernel_decode is None and backend.cascade is None
    for layer in range(2):
        k, v = torch.randn(layout.num_tokens, HKV, D), torch.randn(layout.num_tokens, HKV, D)
        out = backend.forward(layer, q, k, v)
        torch.testing.assert_close(out, reference_attention(kv, layer, layout, q, backend.layer_attention[layer]),
                                   atol=2e-5, rtol=2e-5)
