"""Building a model on the meta device and allocating it (engine/models/__init__.py ``materialize``),
against torch's ``Module.to_empty`` and the build it replaced."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from engine.loader import load_model_files
from engine.models import build_model, materialize
from engine.models.llama import LlamaModel, keep_float32_norms


def _described(module: nn.Module) -> list[tuple]:
    params = [(n, tuple(p.shape), p.dtype, p.device.type, p.requires_grad)
              for n, p in module.named_parameters(remove_duplicate=False)]
    buffers = [(n, tuple(b.shape), b.dtype, b.device.type) for n, b in module.named_buffers(remove_duplicate=False)]
    return params + buffers


def test_materialize_allocates_what_to_empty_does_and_keeps_a_shared_weight_shared():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4, bias=False)).to(torch.bfloat16)
        net.register_buffer("scale", torch.ones(3))
        net[2].weight = net[0].weight   # tied, as an embedding and an LM head can be
        net[1].weight.requires_grad_(False)
    reference = copy.deepcopy(net).to_empty(device="cpu")
    got = materialize(net, "cpu")
    assert _described(got) == _described(reference)
    assert all(p.device.type == "cpu" for p in got.parameters())
    assert got[2].weight.data_ptr() == got[0].weight.data_ptr()
    assert got[0].weight.data_ptr() != got[0].bias.data_ptr()


@pytest.mark.slow
def test_the_default_model_builds_as_it_did_through_to_empty():
    """The weights, buffers and dtypes of the build through ``materialize`` equal the old build's: allocated in
    float32 by ``to_empty``, then converted to the target dtype, then loaded."""
    files = load_model_files(None, torch.bfloat16)
    got = build_model(files.config, files.state, torch.bfloat16, "cpu")
    with torch.device("meta"):
        reference = LlamaModel(files.config)
    reference = reference.to_empty(device="cpu").to(torch.bfloat16)
    reference.rope = reference.rope.__class__(files.config)
    reference.load_hf_state_dict(files.state)
    keep_float32_norms(reference)
    theirs = reference.state_dict()
    ours = got.state_dict()
    assert list(ours) == list(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


@pytest.mark.slow
def test_a_model_build_does_not_import_sympy():
    """What ``materialize`` is for: torch's ``to_empty`` imports its symbolic-shapes module and sympy, 0.2-0.4 s
    of every server's start."""
    code = ("import sys, torch\n"
            "from engine.loader import load_model_files\n"
            "from engine.models import build_model\n"
            "files = load_model_files(None, torch.bfloat16)\n"
            "build_model(files.config, files.state, torch.bfloat16, 'cpu')\n"
            "print('sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


def test_fused_weights_load_their_parts_in_order_and_a_wrong_or_missing_part_is_named():
    """q, k, v into the fused qkv_proj's rows in that order (and gate, up into gate_up_proj); a part of
    the wrong shape or a missing one is a ValueError naming it."""
    files = load_model_files(None, torch.float32)
    model = build_model(files.config, files.state, torch.float32, "cpu")
    attn, mlp, state = model.layers[3].self_attn, model.layers[3].mlp, files.state
    q, k, v = (state[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    gate, up = (state[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    bad = dict(state)
    bad["model.layers.3.self_attn.k_proj.weight"] = k[:-1]
    with pytest.raises(ValueError, match=r"layers\.3\.self_attn\.qkv_proj\.weight: shape"):
        model.load_hf_state_dict(bad)
    del bad["model.layers.3.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing 1 weights.*layers.3.self_attn.k_proj"):
        model.load_hf_state_dict(bad)


@pytest.mark.slow
def test_a_weight_the_checkpoint_already_holds_is_shared_not_copied():
    """Same dtype, one part: the parameter is the checkpoint's tensor (no second copy); a fused parameter and
    one in another dtype are copies; the values are the checkpoint's either way."""
    files = load_model_files(None, torch.float32)
    state = files.state
    model = build_model(files.config, state, torch.float32, "cpu")
    o_proj, embed = state["model.layers.2.self_attn.o_proj.weight"], state["model.embed_tokens.weight"]
    assert model.layers[2].self_attn.o_proj.weight.data_ptr() == o_proj.data_ptr()
    assert model.embed_tokens.weight.data_ptr() == embed.data_ptr()
    qkv = model.layers[2].self_attn.qkv_proj.weight
    assert qkv.data_ptr() != state["model.layers.2.self_attn.q_proj.weight"].data_ptr()
    assert model.layers[2].self_attn.o_proj.weight.requires_grad == qkv.requires_grad   # as built
    assert not o_proj.requires_grad                     # the checkpoint's tensor itself is left as it was
    bf16 = build_model(files.config, state, torch.bfloat16, "cpu")
    assert bf16.layers[2].self_attn.o_proj.weight.data_ptr() != o_proj.data_ptr()
    assert torch.equal(bf16.layers[2].self_attn.o_proj.weight, o_proj.to(torch.bfloat16))
    sliced = dict(state)       # a view into a larger tensor is copied: sharing it would keep all of it alive
    sliced["model.layers.2.self_attn.o_proj.weight"] = torch.cat([o_proj, o_proj])[:o_proj.shape[0]]
    again = build_model(files.config, sliced, torch.float32, "cpu")
    view = sliced["model.layers.2.self_attn.o_proj.weight"]
    assert again.layers[2].self_attn.o_proj.weight.data_ptr() != view.data_ptr()
    assert torch.equal(again.layers[2].self_attn.o_proj.weight, o_proj)


def _loaded(dense_blocks: bool):
    from engine.loader.gguf_loader import load_gguf
    from engine.loader.tokenizer_files import default_model_path

    groups: dict = {}
    _, state, _ = load_gguf(default_model_path(), torch.float32, groups, dense_blocks=dense_blocks)
    return state, groups


@pytest.mark.slow
def test_a_load_without_the_block_layers_dense_weights_keeps_the_same_blocks_and_the_rest():
    """``dense_blocks=False``: each layer weight kept as blocks is a meta tensor of its shape in the state, its
    blocks those of the full load; every other tensor (embeddings, norms) is loaded as before."""
    full, full_groups = _loaded(True)
    bare, bare_groups = _loaded(False)
    assert list(bare) == list(full) and list(bare_groups) == list(full_groups)
    layer_blocks = {k for k in full_groups if k.startswith("model.layers.")}
    assert len(layer_blocks) == 7 * 30                       # q, k, v, o, gate, up, down of 30 layers
    for name, tensor in bare.items():
        assert tensor.shape == full[name].shape and tensor.dtype == full[name].dtype, name
        assert tensor.is_meta == (name in layer_blocks), name
        if not tensor.is_meta:
            assert torch.equal(tensor, full[name]), name
    for name, g in full_groups.items():
        for field in ("q", "scale", "minimum", "qs", "d"):
            if hasattr(g, field):
                assert torch.equal(getattr(bare_groups[name], field), getattr(g, field)), (name, field)


def test_a_fused_weight_with_only_some_parts_unloaded_is_refused():
    from engine.models.llama import copy_hf_weights

    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = nn.Linear(4, 12, bias=False)
    module = nn.Module()
    module.layers = nn.ModuleList([layer])
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    state = {q: torch.ones(4, 4), k: torch.empty(4, 4, device="meta"), v: torch.ones(4, 4)}
    with pytest.raises(ValueError, match="some of its parts were not loaded"):
        copy_hf_weights(module, state)
    state[q] = state[v] = state[k]
    before = layer.self_attn.qkv_proj.weight.clone()
    copy_hf_weights(module, state)                           # all unloaded: left as it was
    assert torch.equal(layer.self_attn.qkv_proj.weight, before)


@pytest.mark.slow
def test_a_gguf_build_on_blocks_reads_no_dense_layer_weight_and_serves_the_same(monkeypatch, caplog):
    """Where every step runs the block layers on their blocks (the prefill pick forced so here, whatever this
    machine measured), the build does not decode their dense weights (the loader gets ``dense_blocks=False``),
    and the engine gives the tokens and log-probs of the build that decoded them and dropped them after, through
    decode steps and a 600-token prefill. Only the build that read them logs them as memory released."""
    import logging
    import engine.builder as builder
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.loader import load_model_files as real_load
    from engine.models import cpu_pick

    monkeypatch.setattr(cpu_pick, "pick_prefill_on_blocks", lambda shapes, dtype: True)
    asked = []

    def load(path, dtype=None, int4_groups=False, dense_blocks=True):
        asked.append(dense_blocks)
        return real_load(path, dtype, int4_groups=int4_groups, dense_blocks=dense_blocks)
    monkeypatch.setattr(builder, "load_model_files", load)
    config = EngineConfig(kv_cache_tokens=2048, max_batched_tokens=256, quantization="gguf")
    lines = []
    with caplog.at_level(logging.INFO, logger="engine"):
        bare = LLMEngine(config)
        lines.append([r.getMessage() for r in caplog.records if "gguf prefill on the blocks" in r.getMessage()])
        caplog.clear()
        monkeypatch.setattr(builder, "_blocks_only", lambda *args: False)
        full = LLMEngine(config)
        lines.append([r.getMessage() for r in caplog.records if "gguf prefill on the blocks" in r.getMessage()])
    assert asked == [False, True]
    (never_read,), (released,) = lines
    assert "dense weights were never read" in never_read and "released" not in never_read, never_read
    assert released.endswith("MiB of dense weights released") and int(released.split()[5]) > 0, released
    prompts = [list(range(100, 700)), list(range(2000, 2040))]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    got, want = bare.generate(prompts, params), full.generate(prompts, params)
    assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in want]


def test_a_build_that_read_no_dense_weights_refuses_a_dense_prefill(monkeypatch):
    """The pick made after the build must agree with the one the load was made for; were it to differ, the block
    layers would have no weights for a dense prefill: the build fails instead of serving garbage."""
    import engine.builder as builder
    from engine import EngineConfig
    from engine.models import cpu_pick

    monkeypatch.setattr(cpu_pick, "prefill_runs_on_blocks", lambda cfg, dtype: True)
    monkeypatch.setattr(cpu_pick, "pick_prefill_on_blocks", lambda shapes, dtype: False)
    with pytest.raises(RuntimeError, match="loaded for prefill on its blocks"):
        builder.load_model(EngineConfig(kv_cache_tokens=1024, quantization="gguf"))
