"""Sliding-window families (Mistral, Gemma 3, gpt-oss): our loader and models against transformers,
token for token (fp32, greedy), on tiny random checkpoints transformers writes itself, with prompts
longer than every window (8 and 12 tokens here; prompts of 45 and 70) and a 64-token step budget, so
prefill is chunked and later chunks extend over cached pages. The scaled RoPE cases are the released
checkpoints' settings (Gemma 3 4B+: linear factor 8 on the global layers; gpt-oss: yarn factor 32,
beta_fast 32, beta_slow 1, truncate false) with an original length of 32, below every prompt.
"""

import json

import numpy as np

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
ORIG = 32   # original_max_position_embeddings of the scaled cases: every prompt passes it
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": ORIG, "truncate": False}
SCALED = {  # case: (family, config overrides)
    # the 4B+ checkpoints' global RoPE; the local layers here take a scaled table of their own (factor 2,
    # base 10k), so a table used for the wrong kind of layer shows
    "gemma3_linear": ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}),
    "gpt_oss_yarn": ("gpt_oss", {"rope_parameters": GPT_OSS_YARN}),
}
CASES = {**{f: (f, {}) for f in FAMILIES}, **SCALED}


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



def assert_greedy_as_transformers(ours: LLMEngine, ref) -> None:
    """Ten greedy tokens of each prompt, and their log-probabilities, as transformers' ``ref`` gives them
    (and not a constant reply: a model that lost its weights would repeat one token)."""
    res = ours.generate(prompts(), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0))
    for prompt, r in zip(prompts(), res):
        tokens, logprobs = greedy_reference(ref, prompt, 10)
        assert r.token_ids == tokens
        assert [lp.logprob for lp in r.logprobs] == pytest.approx(logprobs, abs=2e-4)
        assert len(set(r.token_ids)) > 1

def greedy_reference(ref, prompt, n):
    """transformers' greedy tokens and each one's log-probability."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_families_windows_greedy_matches_transformers(case, tmp_path, tokenizer):
    family, overrides = CASES[case]
    ref = write_checkpoint(family, tmp_path, tokenizer, **overrides)
    ours = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=1024, max_batched_tokens=64))
    assert ours.model_config.architecture == family
    rope_type = {"gemma3_linear": "linear", "gpt_oss_yarn": "yarn"}.get(case)
    assert ours.model_config.rope_scaling.get("rope_type") == rope_type
    windows = [a.window for a in ours.runner.attn.layer_attention]
    assert windows == {"mistral": [8, 8], "gemma3": [12, None, 12, None], "gpt_oss": [8, None]}[family]
    res = ours.generate(prompts(), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0))
    for prompt, r in zip(prompts(), res):
        tokens, logprobs = greedy_reference(ref, prompt, 10)
        assert r.token_ids == tokens
        # the log-probabilities too: a monotone change (a final soft-cap) keeps greedy tokens
        assert [lp.logprob for lp in r.logprobs] == pytest.approx(logprobs, abs=2e-4)
        assert len(set(r.token_ids)) > 1  # a test that could not tell models apart would be useless


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": ORIG}
REFUSED = {  # case: (family, field (a.b: key b of a), value, text the error must hold)
    "gemma3_attn_softcap": ("gemma3", "attn_logit_softcapping", 50.0, "'attn_logit_softcapping' = 50.0"),
    "gemma3_bidirectional": ("gemma3", "use_bidirectional_attention", True, "'use_bidirectional_attention' = True"),
    "gemma3_gelu": ("gemma3", "hidden_activation", "gelu", "'hidden_activation' = 'gelu'"),
    "gemma3_unknown_field": ("gemma3", "attention_multiplier", 2.0, "'attention_multiplier' = 2.0"),
    # longrope's short / long switch is the engine's context, through model.rope only: one table per kind
    "gemma3_longrope": ("gemma3", "rope_parameters.full_attention", dict(LONGROPE, rope_theta=1e6),
                        "rope_parameters.full_attention={'rope_type': 'longrope'"),
    "gemma3_rope_partial_rotary": ("gemma3", "rope_parameters.sliding_attention",
                                   {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                                   "rope_parameters.sliding_attention={'rope_type': 'default', "
                                   "'rope_theta': 10000.0, 'partial_rotary_factor': 0.5}"),
    "gemma3_rope_parameter": ("gemma3", "rope_parameters.full_attention",
                              {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6, "mrope_section": [2, 2]},
                              "'mrope_section' = [2, 2]"),
    "gpt_oss_rope_type": ("gpt_oss", "rope_parameters", {"rope_type": "mrope", "rope_theta": 1e4},
                          "rope_parameters={'rope_type': 'mrope', 'rope_theta': 10000.0}"),
    "gpt_oss_layer_types": ("gpt_oss", "layer_types", ["sliding_attention", "chunked_attention"],
                            "layer_types=['sliding_attention', 'chunked_attention']"),
    # MXFP4 experts are read (test_families_windows_mxfp4_checkpoint_...); other quantizations are not
    "gpt_oss_quantized": ("gpt_oss", "quantization_config", {"quant_method": "awq"},
                          "'quantization_config' = {'quant_method': 'awq'}"),
    "gpt_oss_experts_per_token": ("gpt_oss", "experts_per_token", 3, "'experts_per_token' = 3"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_families_windows_refused_fields(case, tmp_path, tokenizer):
    """A field we do not implement stops the load with its name and value, not a silently different model."""
    family, field, value, text = REFUSED[case]
    write_checkpoint(family, tmp_path, tokenizer)
    cfg = json.loads((tmp_path / "config.json").read_text())
    top, _, key = field.partition(".")
    if key:
        cfg[top][key] = value
    else:
        cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=256))
    assert text in str(err.value)


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


RELEASED = {  # the released checkpoints' config.json fields and RoPE spelling (transformers 4.5x), tiny dimensions
    "gemma3": dict(FAMILIES["gemma3"][2], architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"factor": 8.0, "rope_type": "linear"},
                   cache_implementation="hybrid"),
    "gpt_oss": dict(FAMILIES["gpt_oss"][2], architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    rope_parameters=None, rope_theta=150000, experts_per_token=2, initial_context_length=4096,
                    hidden_act="silu", quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
                    rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                  "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}),
}


@pytest.mark.parametrize("family", sorted(RELEASED))
def test_families_windows_released_rope_spelling_matches_transformers(family):
    """The older spelling (``rope_scaling`` + ``rope_theta``, Gemma's ``rope_local_base_freq``) read into the
    same cos / sin tables transformers computes from it, for every kind of layer."""
    from engine.loader.hf_loader import config_from_hf
    from engine.models.gemma3 import _ropes
    from engine.models.rope import RotaryEmbedding

    raw = {k: v for k, v in RELEASED[family].items() if v is not None}
    ours = config_from_hf(raw, "released")
    cfg_cls = FAMILIES[family][0]
    ref_cfg = cfg_cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    pos = torch.arange(0, 512, 7)
    x = torch.zeros(1, dtype=torch.float32)
    if family == "gemma3":
        ref = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(ref_cfg)
        pairs = zip(_ropes(ours), ("full_attention", "sliding_attention"))
        tables = [(r.cos_short[pos], ref(x, pos[None], kind)[0][0]) for r, kind in pairs]
        assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    else:
        ref = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(ref_cfg)
        tables = [(RotaryEmbedding(ours).cos_short[pos, :8], ref(x, pos[None])[0][0])]   # HF: one half
        assert ours.rope_scaling["truncate"] is False and ref.attention_scaling > 1.3
    for got, want in tables:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


GGUF_CASES = {  # case: (family, config overrides); llama.cpp fixes Gemma 3's pattern (every 6th layer global),
    # its local RoPE's scaling (none) and its attention scale (1/sqrt(head_dim) below 62 layers) in code; the
    # local base is written (rope.freq_base_swa): 20k here, not llama.cpp's default 10k, so reading it shows
    "gemma3_gguf": ("gemma3", {"num_hidden_layers": 6, "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}}),
    "gpt_oss_gguf": ("gpt_oss", {"rope_parameters": GPT_OSS_YARN}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_families_windows_gguf_greedy_matches_transformers(case, tmp_path, tokenizer):
    """The same random weights written as llama.cpp's converter writes arch ``gemma3`` / ``gpt-oss``
    (tests/engine/gguf_families.py), loaded from the GGUF file, give transformers' greedy tokens."""
    from engine.loader.gguf_file import GGUFFile
    from engine.loader.gguf_loader import default_model_path
    from tests.engine.gguf_families import write_family_gguf

    family, overrides = GGUF_CASES[case]
    ref = write_checkpoint(family, tmp_path, tokenizer, **overrides)
    path = tmp_path / f"{case}.gguf"
    write_family_gguf(tmp_path, ref.config, path, GGUFFile(default_model_path()).fields)
    ours = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=1024, max_batched_tokens=64))
    cfg = ours.model_config
    assert cfg.architecture == family
    assert cfg.rope_scaling.get("rope_type") == ("linear" if family == "gemma3" else "yarn")
    windows = [a.window for a in ours.runner.attn.layer_attention]
    assert windows == {"gemma3": [12] * 5 + [None], "gpt_oss": [8, None]}[family]
    assert_greedy_as_transformers(ours, ref)


@pytest.mark.slow
def test_families_windows_gguf_mxfp4_experts_match_transformers(tmp_path, tokenizer):
    """gpt-oss's released GGUF files keep the experts as MXFP4 blocks: loaded (decoded to float), they give the
    greedy tokens of transformers' model holding the same decoded experts (decoded by the gguf package's
    reader, the oracle)."""
    import gguf

    from engine.loader.gguf_file import GGUFFile
    from engine.loader.gguf_loader import default_model_path
    from tests.engine.gguf_families import write_family_gguf

    family, overrides = GGUF_CASES["gpt_oss_gguf"]
    ref = write_checkpoint(family, tmp_path, tokenizer, **overrides)
    path = tmp_path / "mxfp4.gguf"
    write_family_gguf(tmp_path, ref.config, path, GGUFFile(default_model_path()).fields, mxfp4_experts=True)
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def decoded(name):   # (E, rows, cols) float32, as the file's blocks decode
        t = stored[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(arr).reshape([int(d) for d in reversed(t.shape)]))

    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            gate, up = decoded(f"blk.{i}.ffn_gate_exps.weight"), decoded(f"blk.{i}.ffn_up_exps.weight")   # (E, I, H)
            before = layer.mlp.experts.gate_up_proj.clone()
            layer.mlp.experts.gate_up_proj.copy_(torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(decoded(f"blk.{i}.ffn_down_exps.weight").transpose(1, 2))
            assert not torch.equal(before, layer.mlp.experts.gate_up_proj)   # 4-bit values: the model changed
    ours = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=1024, max_batched_tokens=64))
    assert_greedy_as_transformers(ours, ref)


def _mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, rows, cols) float -> the checkpoint's (blocks (E, rows, cols/32, 16), scales (E, rows, cols/32)):
    quantized by the gguf package's MXFP4 quantizer (the same e2m1 codes and e8m0 scales), repacked from its
    blocks (scale byte, then element j in the low nibble of byte j and element j + 16 in its high nibble)
    into the checkpoint's (elements 2b, 2b + 1 in byte b's low, high nibbles)."""
    import gguf

    E, rows, cols = w.shape
    q = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    q = torch.from_numpy(q.reshape(E, rows, cols // 32, 17))
    codes = torch.cat([q[..., 1:] & 0x0F, q[..., 1:] >> 4], dim=-1)                 # (E, rows, G, 32)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), q[..., 0].contiguous()


def test_families_windows_mxfp4_checkpoint_matches_transformers(tmp_path, tokenizer):
    """gpt-oss's released Hugging Face checkpoints hold the experts as MXFP4 (``*_blocks`` / ``*_scales``,
    ``quantization_config`` mxfp4): decoded at load, they give the greedy tokens of transformers' model
    holding the experts as transformers' own ``convert_moe_packed_tensors`` decodes them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    family, overrides = GGUF_CASES["gpt_oss_gguf"]
    ref = write_checkpoint(family, tmp_path, tokenizer, **overrides)
    (weights,) = tmp_path.glob("*.safetensors")
    state = load_file(weights)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{i}.mlp.experts.{proj}"
                blocks, scales = _mxfp4_pack(state.pop(name).transpose(1, 2))   # groups along the input dim
                state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
                decoded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                assert not torch.equal(decoded, getattr(experts, proj))         # 4-bit values: the model changed
                getattr(experts, proj).copy_(decoded)
    save_file(state, weights, metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ours = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=1024, max_batched_tokens=64))
    assert_greedy_as_transformers(ours, ref)
