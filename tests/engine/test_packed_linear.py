"""oneDNN's packed float32 linear (engine/models/packed_linear.py) against ``F.linear``: one layer on random
weights, the default model teacher-forced through it, and the once-per-machine pick."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine
from engine.models import cpu_pick
from engine.models.cpu_pick import pick_packed_linear
from engine.models.packed_linear import PackedLinear, available, pack_dense_projections, step_shapes
from engine.models.quant import projections

pytestmark = pytest.mark.skipif(not available(), reason="this torch was built without oneDNN (MKL-DNN)")


PROMPTS = ["List three prime numbers and explain why they are prime."]


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float32 sums of the same products in another order: well inside 1e-5 of the sum of |products|
    (worst-case rounding of K=1536 terms is ~1e-4 of it; measured when written: 3e-7 at most)."""
    return 1e-5 * (x.abs() @ w.abs().t()) + 1e-30


@pytest.mark.parametrize("rows", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (576, 1536, False), (96, 64, True)])
def test_packed_layer_computes_f_linear(rows, n, k, bias):
    torch.manual_seed(rows * n + k)
    w, b = torch.randn(n, k) * 0.05, (torch.randn(n) if bias else None)
    layer = PackedLinear(w, b)
    assert torch.equal(layer.weight, w) and (layer.out_features, layer.in_features) == (n, k)
    x = torch.randn(rows, k) * 2
    with torch.inference_mode():
        got, ref = layer(x), F.linear(x, w, b)
    assert got.shape == ref.shape == (rows, n) and got.dtype == torch.float32
    assert torch.all((got - ref).abs() <= _bound(x, w))
    if rows > 1:   # batched and strided inputs, as the model's views are
        x3 = torch.randn(2, rows, k)
        assert torch.all((layer(x3) - F.linear(x3, w, b)).abs() <= _bound(x3, w))
        strided = torch.randn(rows, 2 * k)[:, ::2]
        assert torch.all((layer(strided) - F.linear(strided, w, b)).abs() <= _bound(strided, w))


def test_a_weight_not_float32_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        PackedLinear(torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        PackedLinear(torch.zeros(4))


def _unpacked(model: nn.Module) -> None:
    """The model's packed layers back to ``nn.Linear`` on the same weights, as built before packing."""
    def plain(layer: PackedLinear) -> nn.Linear:
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        linear.weight = nn.Parameter(layer.weight, requires_grad=False)
        if layer.bias is not None:
            linear.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
        return linear

    for parent, attr, _ in projections(model):
        if isinstance(getattr(parent, attr), PackedLinear):
            setattr(parent, attr, plain(getattr(parent, attr)))
    if isinstance(model.lm_head, PackedLinear):
        tied = torch.equal(model.lm_head.weight, model.embed_tokens.weight)
        model.lm_head = None if tied else plain(model.lm_head)


@pytest.mark.slow
def test_the_default_model_through_packed_layers_scores_as_through_f_linear():
    """The default model in float32 on dense weights, teacher-forced over its own greedy continuations in one
    forward and in steps of 4 tokens, packed against ``F.linear``: float32 noise, as the C layer ops in
    float32 (tests/engine/test_cpu_ops.py). Measured when written: top-1 48/48, mean KL -1.5e-9 (float32
    noise about 0; 2.3e-8 over two prompts), largest top-token change 1.3e-5 nats. Tolerances: every top-1
    equal, mean KL <= 1e-6, <= 1e-3 nats."""
    from tests.engine.test_quant import assert_paths_agree, paths_compared

    engine = LLMEngine(EngineConfig(dtype="float32", quantization="off", kv_cache_tokens=4096))
    model = engine.model
    _unpacked(model)
    assert not any(isinstance(m, PackedLinear) for m in model.modules()) and model.lm_head is None
    assert pack_dense_projections(model) == 4 * len(model.layers) + 1
    assert isinstance(model.lm_head, PackedLinear) and model.embed_tokens.weight.shape == model.lm_head.weight.shape

    def use_packed(on: bool) -> None:
        if on:
            pack_dense_projections(model)
        else:
            _unpacked(model)

    assert_paths_agree("float32, packed vs F.linear", paths_compared(engine, use_packed, PROMPTS))


@pytest.mark.slow
def test_the_engine_packs_where_picked_and_not_without_cpu_kernels():
    engine = LLMEngine(EngineConfig(dtype="float32", quantization="off", kv_cache_tokens=1024))
    model = engine.model
    picked = engine.active_kernels["packed_linear"]
    assert picked == isinstance(model.lm_head, PackedLinear)
    assert all(isinstance(getattr(p, a), PackedLinear) == picked for p, a, _ in projections(model))
    assert picked == pick_packed_linear(tuple(sorted(step_shapes(model).items())))
    plain = LLMEngine(EngineConfig(dtype="float32", quantization="off", kv_cache_tokens=1024, cpu_kernels=False))
    assert not plain.active_kernels["packed_linear"]
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    bf16 = LLMEngine(EngineConfig(dtype="bfloat16", quantization="off", kv_cache_tokens=1024))
    assert not any(isinstance(m, PackedLinear) for m in bf16.model.modules())


@pytest.mark.parametrize("step,batch,chunk,packed", [
    ((2.0, 1.0), (2.0, 1.0), (2.0, 1.0), True),
    ((1.0, 2.0), (1.0, 2.0), (1.0, 2.0), False),
    # the Zen 3 case: a little slower at one row and a chunk, 1.6x faster at a decode batch
    ((21.2, 27.5), (43.0, 26.3), (28.8, 29.0), True),
    # faster at one row only: the batch and the chunk it loses outweigh it
    ((2.0, 1.0), (1.0, 1.5), (1.0, 1.5), False),
    # equal overall (ratios 0.5, 2 and 1): F.linear stays
    ((2.0, 1.0), (1.0, 2.0), (1.0, 1.0), False),
])
def test_the_pick_packs_where_the_three_kinds_of_step_favour_it(tmp_path, monkeypatch, step, batch, chunk, packed):
    """Times cached in the kernel cache are the pick's (no timing in this test): packed where the geometric mean of
    its time ratios to ``F.linear`` at one row, at a decode batch's rows and at a prefill chunk's rows is below 1."""
    monkeypatch.setenv("AGENTRT_KERNEL_CACHE", str(tmp_path))
    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128), "head": (1000, 64)}
    layer = {k: v for k, v in shapes.items() if k != "head"}
    for times, shape, rows in ((step, shapes, 1), (batch, shapes, cpu_pick.BATCH_ROWS),
                               (chunk, layer, cpu_pick.PREFILL_ROWS)):
        key = cpu_pick._key(["off", "packed"], shape, torch.float32, rows)
        (tmp_path / f"pick-{key}.json").write_text(json.dumps({"off": times[0], "packed": times[1]}))
    assert pick_packed_linear.__wrapped__(tuple(sorted(shapes.items()))) is packed


def test_the_pick_times_a_large_model_on_fewer_layers_within_its_byte_budget():
    """Both candidates' weights are held at once while timed: a 7B model's float32 layers (800 MB each) must not
    be timed eight at a time, nor its head beside them."""
    small = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
    assert cpu_pick._step_timed(small) == (small, cpu_pick.LAYERS)          # the default model: 250 MB in all
    seven_b = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
               "head": (32000, 4096)}
    timed, layers = cpu_pick._step_timed(seven_b)
    assert layers == 1 and "head" not in timed
    one_b = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
             "head": (128256, 2048)}
    timed, layers = cpu_pick._step_timed(one_b)
    assert layers == 2 and "head" not in timed
    layer_bytes = 4 * sum(n * k for name, (n, k) in timed.items())
    assert layers * layer_bytes <= cpu_pick.MEASURED_BYTES
