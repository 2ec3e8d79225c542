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
