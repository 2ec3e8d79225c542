"""benchmarks/step_overhead.py --kv-contents: what the contexts' pages hold when a step reads them."""

import pytest
import torch

from benchmarks import step_overhead
from engine import SamplingParams
from engine.kv_pool import KVCache
from engine.request import Request
from engine.scheduler import ScheduledBatch

P, HKV, D, LAYERS = 4, 2, 8, 3


def batch_on(pages: list[list[int]]) -> ScheduledBatch:
    reqs = []
    for i, own in enumerate(pages):
        req = Request(f"r{i}", list(range(len(own) * P)), SamplingParams(max_tokens=1))
        req.pages = own
        reqs.append(req)
    return ScheduledBatch(reqs, [1] * len(reqs))


def pools() -> dict[str, KVCache]:
    return {"int8": KVCache(LAYERS, 10, P, HKV, D, torch.float32, "cpu", layout="HSD", kv_dtype=torch.int8),
            "bfloat16": KVCache(LAYERS, 10, P, HKV, D, torch.float32, "cpu", layout="HSD", kv_dtype=torch.bfloat16)}


def test_random_contents_fill_the_batchs_pages_alike_in_every_pool_and_layer(monkeypatch):
    monkeypatch.setattr(step_overhead, "_contents", "random")
    batch = batch_on([[1, 2], [5, 2]])                      # page 2 shared, as a common prefix is
    kvs = pools()
    for kv in kvs.values():
        step_overhead.write_contents(kv, batch)
    used = torch.tensor([s for p in (1, 2, 5) for s in range(p * P, p * P + P)])
    unused = torch.tensor([s for p in (0, 3, 4, 6, 7, 8, 9) for s in range(p * P, p * P + P)])
    k8, v8 = kvs["int8"].gather(0, used)
    for layer in range(LAYERS):
        k, v = kvs["bfloat16"].gather(layer, used)
        assert float(k.std()) == pytest.approx(2, rel=0.25) and float(v.std()) == pytest.approx(1, rel=0.25)
        torch.testing.assert_close(k8, k, atol=0.06, rtol=0.02)         # the same keys, up to int8's steps
        torch.testing.assert_close(v8, v, atol=0.03, rtol=0.02)
        assert not kvs["bfloat16"].gather(layer, unused)[0].any()      # nothing outside the batch's pages


def test_unwritten_contents_leave_the_pages_as_they_were():
    assert step_overhead._contents == "unwritten"            # the default
    kv = pools()["bfloat16"]
    step_overhead.write_contents(kv, batch_on([[1, 2]]))
    assert not any(t.any() for t in kv.k + kv.v)
