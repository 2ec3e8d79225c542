"""Dense Hugging Face directories (Llama, Mistral, Qwen2, Qwen3): our loader and model vs transformers.

Tiny random checkpoints are written by transformers itself (save_pretrained), with the
default model's real tokenizer, so the loader reads real files in the real layout.
"""

import pytest
import torch

from benchmarks.moe_checkpoint import save_tokenizer
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import encode_chat

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_directory_greedy_matches_transformers(family, tmp_path, tokenizer):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    ref = model_cls(cfg_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random init is tiny; scale up so greedy paths are not all one token
        for p in ref.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    ref.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    ours = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_tokens=2048, max_batched_tokens=64))
    assert ours.model_config.architecture == family
    prompts = [encode_chat(ours.tokenizer, [{"role": "user", "content": t}])
               for t in ("hello there", "what is two plus two?")]
    res = ours.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, r in zip(prompts, res):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                               do_sample=False, eos_token_id=None, pad_token_id=2)
        assert r.token_ids == out[0, len(prompt):].tolist()
        assert len(set(r.token_ids)) > 1  # a test that could not tell models apart would be useless
