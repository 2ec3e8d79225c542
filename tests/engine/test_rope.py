"""engine/models/rope.py against transformers' own RoPE functions (modeling_rope_utils.ROPE_INIT_FUNCTIONS):
the inverse frequencies and attention scaling of every type, from the same config.json the loader reads."""

import pytest
import torch

from engine.loader.hf_loader import config_from_hf
from engine.models.rope import RotaryEmbedding, inv_freq

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PHI_FACTORS = dict(short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[1.5 + 0.5 * i for i in range(8)])
CASES = {  # name: (config class, config kwargs)
    "linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    "dynamic": ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama3": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),   # one wavelength (32.5) in the smoothed band
    "yarn": ("Qwen2Config", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "yarn_mscale": ("Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                     "mscale_all_dim": 1.0, "beta_fast": 16,
                                                     "original_max_position_embeddings": 64}}),
    "yarn_attention_factor": ("Qwen2Config", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                               "attention_factor": 1.3, "truncate": False,
                                                               "original_max_position_embeddings": 64}}),
    "longrope": ("Phi3Config", {"original_max_position_embeddings": 32,
                                "rope_scaling": {"type": "longrope", **PHI_FACTORS}}),
    "longrope_partial": ("Phi3Config", {"original_max_position_embeddings": 32, "partial_rotary_factor": 0.5,
                                        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                                         "long_factor": [2.0, 3.0, 4.0, 5.0]}}),
}


def _both(name):
    cls, extra = CASES[name]
    hf_cfg = getattr(transformers, cls)(**BASE, **extra)
    raw = {**hf_cfg.to_dict(), "architectures": [cls.replace("Config", "ForCausalLM")]}
    return hf_cfg, config_from_hf(raw, name)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seq_len", [None, 20, 33, 300])
def test_families_rope_inv_freq_is_transformers(name, seq_len):
    hf_cfg, ours = _both(name)
    kind = hf_cfg.rope_parameters["rope_type"]
    ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, torch.device("cpu"), seq_len=seq_len)
    got, scale = inv_freq(ours, seq_len)
    assert ours.rope_scaling["rope_type"] == kind
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def test_families_rope_longrope_table_follows_the_context():
    """longrope: an engine whose context passes original_max_position_embeddings rotates with the long
    factors, one whose context does not with the short ones; both scaled by the attention factor."""
    hf_cfg, ours = _both("longrope")
    rope = RotaryEmbedding(ours)
    pos = torch.tensor([5, 40])
    for context, seq_len in ((256, 33), (32, None)):
        rope.fit_context(context)
        table = rope.table(pos, torch.float32)
        inv, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_cfg, torch.device("cpu"), seq_len=seq_len)
        angle = torch.outer(pos.double(), inv.double())                       # (2, R/2)
        torch.testing.assert_close(table.cos[:, 0, :8], (angle.cos() * scale).float())
        torch.testing.assert_close(table.signed_sin[:, 0, 8:], (angle.sin() * scale).float())


def test_families_partial_rotary_leaves_the_tail_alone():
    _, ours = _both("longrope_partial")
    rope = RotaryEmbedding(ours)
    x = torch.randn(3, 2, 16)
    out = rope(x, torch.tensor([1, 7, 30]))
    assert rope.partial and rope.rotary_dim == 8
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[1:, :, :8], x[1:, :, :8])
