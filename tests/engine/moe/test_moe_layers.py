"""MoE block: config validation, HF routing rules, dense oracle, tiny HF checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from benchmarks.moe_checkpoint import read_hf_config, write_tiny_checkpoint
from engine.moe.checkpoint import SafetensorsDict
from engine.moe.config import MoEConfig, Topology, moe_layer_indices
from engine.moe.layers import MoEBlock

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    return {f: write_tiny_checkpoint(root / f, f, seed=5) for f in FAMILIES}


@pytest.mark.parametrize("kwargs, message", [
    (dict(family="gpt"), "family must be one of"),
    (dict(top_k=9), "top_k"),
    (dict(hidden=0), "hidden must be an integer >= 1"),
    (dict(family="mixtral", shared_expert_intermediate=8), "has no shared expert"),
    (dict(family="mixtral", norm_topk_prob=False), "always renormalises"),
])
def test_config_rejects_bad_values(kwargs, message):
    base = dict(family="qwen2_moe", num_experts=8, top_k=2, hidden=16, intermediate=8)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**(base | kwargs))


def test_topology_maps_ranks_to_nodes():
    topo = Topology(nodes=2, ranks_per_node=3)
    assert topo.world_size == 6
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert list(topo.ranks_of(1)) == [3, 4, 5]
    with pytest.raises(ValueError, match="outside"):
        topo.node_of(6)


def test_checkpoint_has_hf_names_and_config_fields(checkpoints):
    for family, d in checkpoints.items():
        hf = json.loads((d / "config.json").read_text())
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            names = set(f.keys())
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                "model.layers.1.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight"} <= names
        if family == "mixtral":
            assert hf["architectures"] == ["MixtralForCausalLM"] and hf["num_local_experts"] == 8
            assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
            assert "model.layers.0.block_sparse_moe.gate.weight" in names
        else:
            assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
            assert hf["moe_intermediate_size"] == 16
        if family == "qwen2_moe":
            assert {"model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.self_attn.q_proj.bias",
                    "model.layers.0.mlp.shared_expert.up_proj.weight"} <= names
        if family == "qwen3_moe":
            assert "model.layers.1.self_attn.q_norm.weight" in names
            assert not any("shared_expert" in n for n in names)
        assert moe_layer_indices(hf) == [0, 1]


def test_routing_rules(checkpoints):
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(0))
    sums = {}
    for family, d in checkpoints.items():
        cfg = MoEConfig.from_hf_config(read_hf_config(d))
        block = MoEBlock.from_hf_state_dict(cfg, SafetensorsDict(d), "model.layers.0.")
        ids, w = block.route(x)
        probs = torch.softmax(block.routing.gate(x), -1)
        assert torch.equal(ids, probs.topk(2, -1).indices)
        if family == "qwen2_moe":  # norm_topk_prob false: the raw softmax mass
            assert torch.allclose(w, probs.topk(2, -1).values)
        sums[family] = w.sum(-1)
    assert torch.allclose(sums["mixtral"], torch.ones(40)) and torch.allclose(sums["qwen3_moe"], torch.ones(40))
    assert float(sums["qwen2_moe"].min()) < 0.99


def test_sparse_forward_matches_dense_oracle(checkpoints):
    x = torch.randn(33, 32, generator=torch.Generator().manual_seed(1))
    for d in checkpoints.values():
        cfg = MoEConfig.from_hf_config(read_hf_config(d))
        block = MoEBlock.from_hf_state_dict(cfg, SafetensorsDict(d), "model.layers.1.")
        out, ref = block(x), block.reference_forward(x)
        assert out.shape == (33, 32)
        assert float((out - ref).abs().max()) <= 1e-6
        assert float(ref.abs().max()) > 1e-3  # not trivially zero


def test_block_matches_transformers(checkpoints):
    transformers = pytest.importorskip("transformers")
    x = torch.randn(1, 21, 32, generator=torch.Generator().manual_seed(2))
    for family, d in checkpoints.items():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        cfg = MoEConfig.from_hf_config(read_hf_config(d))
        ours = MoEBlock.from_hf_state_dict(cfg, SafetensorsDict(d), "model.layers.1.")
        with torch.no_grad():
            theirs = model.model.layers[1].mlp(x)[0]
        assert float((ours(x[0]) - theirs).abs().max()) <= 1e-5, family


def test_loader_names_missing_tensor(checkpoints):
    cfg = MoEConfig.from_hf_config(read_hf_config(checkpoints["mixtral"]))
    sd = dict(SafetensorsDict(checkpoints["mixtral"]))
    del sd["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    with pytest.raises(ValueError, match="experts.3.w1"):
        MoEBlock.from_hf_state_dict(cfg, sd, "model.layers.0.")
