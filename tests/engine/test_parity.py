"""Greedy token-for-token parity with Hugging Face transformers on the same GGUF file."""

import functools
import os

import pytest
import torch

from engine import SamplingParams
from engine.tokenizer import encode_chat
from engine.loader.gguf_loader import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three programming languages and one use of each.",
    "hi",
    "Translate 'good morning' into Spanish and German, then count to five.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model():
    """transformers' own GGUF path (its reader and dequantizers, not ours). It builds gguf-py's tensor name table
    anew for each of the ~400 modules it walks (``get_gguf_hf_weights_map``); the table depends only on the
    architecture and the layer count, so while loading it is built once: 18.8 -> 13.4 s on the 2-core Zen 3 host."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    path = default_model_path()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids, n):
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        # an explicit mask: the prompt contains <|im_end|>, which is also the pad id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.slow
def test_greedy_parity_batched_with_transformers(default_engine, hf_model):
    prompts = [encode_chat(default_engine.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 3  # different lengths in one batch
    ours = default_engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                           ignore_eos=True))
    for prompt, res in zip(prompts, ours):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert res.token_ids == ref, (default_engine.tokenizer.decode(res.token_ids),
                                      default_engine.tokenizer.decode(ref))


@pytest.mark.slow
def test_logits_match_transformers(default_engine, hf_model):
    """Last-position logits of one prompt agree closely (fp32)."""
    prompt = encode_chat(default_engine.tokenizer, [{"role": "user", "content": PROMPTS[2]}])
    res = default_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    lp = res[0].logprobs[0]
    assert lp.token_id == int(ref.argmax())
    for tok, val in lp.top:
        assert abs(val - float(ref[tok])) < 1e-3
