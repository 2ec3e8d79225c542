"""Sliding-window families (Mistral, Gemma 3, gpt-oss): our loader and models against transformers,
token for token (fp32, greedy), on tiny random checkpoints transformers writes itself, with prompts
longer than every window (8 and 12 tokens here; prompts of 45 and 70) and a 64-token step budget, so
prefill is chunked and later chunks extend over cached pages.
"""

import json

import pytest
import torch

from benchmarks.moe_checkpoint import save_tokenizer
from engine import EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, tie_word_embeddings=False)
FAMILIES = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(SMALL, intermediate_size=128, num_hidden_layers=2, sliding_window=8)),
    # layers 0, 2 slide (local RoPE base 10k), 1, 3 are global; scores scaled by 1/sqrt(24), not 1/4
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(SMALL, intermediate_size=128, num_hidden_layers=4, sliding_window=12, sliding_window_pattern=2,
                    query_pre_attn_scalar=24, tie_word_embeddings=True, final_logit_softcapping=2.0)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(SMALL, intermediate_size=32, num_hidden_layers=2, sliding_window=8, num_local_experts=4,
                     num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
}


def write_checkpoint(family, path, tokenizer, **overrides):
    cfg_cls, model_cls, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**dict(kwargs, **overrides))).eval()
    with torch.no_grad():  # random init is tiny; scale up so greedy paths are not all one token
        for name, p in ref.named_parameters():
            if name.endswith("bias"):                       # transformers starts biases at zero
                p.normal_(0.0, 0.2)
            elif p.dim() > 1 or name.endswith("sinks"):
                p.mul_(4.0)
            elif "norm" in name and family == "gemma3":   # Gemma's norms are 1 + w: make w matter
                p.normal_(0.0, 0.5)
            if name.endswith("gate_up_proj"):               # past swiglu_limit (7) often: the clamps matter
                p.mul_(6.0)
    ref.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return ref


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (45, 70)]


def greedy_reference(ref, prompt, n):
    """transformers' greedy tokens and each one's log-probability."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_windows_greedy_matches_transformers(family, tmp_path, tokenizer):
    ref = write_checkpoint(family, tmp_path, tokenizer)
    ours = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=1024, max_batched_tokens=64))
    assert ours.model_config.architecture == family
    windows = [a.window for a in ours.runner.attn.layer_attention]
    assert windows == {"mistral": [8, 8], "gemma3": [12, None, 12, None], "gpt_oss": [8, None]}[family]
    res = ours.generate(prompts(), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0))
    for prompt, r in zip(prompts(), res):
        tokens, logprobs = greedy_reference(ref, prompt, 10)
        assert r.token_ids == tokens
        # the log-probabilities too: a monotone change (a final soft-cap) keeps greedy tokens
        assert [lp.logprob for lp in r.logprobs] == pytest.approx(logprobs, abs=2e-4)
        assert len(set(r.token_ids)) > 1  # a test that could not tell models apart would be useless


@pytest.mark.parametrize("family, field, value", [
    ("gemma3", "attn_logit_softcapping", 50.0),
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma3", "hidden_activation", "gelu"),
    ("gemma3", "rope_parameters.full_attention", {"rope_type": "linear", "factor": 8.0}),
    ("gpt_oss", "rope_parameters", {"rope_type": "yarn", "factor": 32.0}),
    ("gpt_oss", "layer_types", ["sliding_attention", "chunked_attention"]),
])
def test_families_windows_refused_fields(family, field, value, tmp_path, tokenizer):
    """A field we do not implement stops the load with its name, not a silently different model."""
    write_checkpoint(family, tmp_path, tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    if field.startswith("rope_parameters"):
        target = cfg["rope_parameters"] if "." not in field else cfg["rope_parameters"]["full_attention"]
        target.update(value)
    else:
        cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field.split(".")[0]):
        LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=256))


def test_families_windows_gemma3_geglu_is_the_tanh_gelu():
    """GeGLU against transformers' Gemma 3 MLP on large activations (the tanh and erf GELUs differ by
    ~1e-3 there, below what greedy tokens of a tiny model show)."""
    from engine.models.gemma3 import GeGLU
    cfg = transformers.Gemma3TextConfig(**dict(FAMILIES["gemma3"][2], vocab_size=16))
    torch.manual_seed(3)
    ref = transformers.models.gemma3.modeling_gemma3.Gemma3MLP(cfg)
    ours = GeGLU(cfg.hidden_size, cfg.intermediate_size)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        ours.down_proj.weight.copy_(ref.down_proj.weight)
    x = torch.randn(32, cfg.hidden_size) * 20
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_families_windows_gpt_oss_refuses_expert_parallelism(tmp_path, tokenizer):
    """gpt-oss's MoE block is its own (biased router, clamped SwiGLU): engine.moe's ranks would not run it."""
    write_checkpoint("gpt_oss", tmp_path, tokenizer)
    with pytest.raises(ValueError, match="ep_size > 1.*'gpt_oss'"):
        LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=256, ep_size=2))
