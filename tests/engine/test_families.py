"""Model families against transformers, token for token (float32, greedy): tiny random checkpoints that
transformers writes itself (save_pretrained), prompts past every RoPE scaling threshold (the tiny configs'
original_max_position_embeddings is 32; prompts are 36-48 tokens; Phi-3's longrope also in an engine whose
context is 32 tokens, where transformers keeps the short factors), then the same weights written as a GGUF file (llama.cpp's names and keys, tests/engine/
gguf_families.py) loaded by our GGUF loader to the same tokens. ``pytest tests/engine -k families``."""

import pytest
import torch

from benchmarks.moe_checkpoint import save_tokenizer
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader.gguf_file import GGUFFile
from engine.loader.gguf_loader import default_model_path, gguf_tokenizer
from tests.engine.gguf_families import write_gguf

transformers = pytest.importorskip("transformers")

ORIG = 32   # original_max_position_embeddings of every scaled case
COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.0 + 0.9 * i for i in range(8)]}
CASES = {  # name: (transformers class prefix, config kwargs)
    "llama3": ("Llama", {"rope_scaling": {   # wavelengths 6.3 (kept), 19.9 (smoothed), 63+ (divided)
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG}}),
    "llama_linear": ("Llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "qwen2_dynamic": ("Qwen2", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "qwen25_yarn": ("Qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "qwen3_moe_yarn": ("Qwen3Moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                    "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
                                    "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                     "original_max_position_embeddings": ORIG}}),
    "phi3_longrope": ("Phi3", {"original_max_position_embeddings": ORIG, "rope_scaling": LONGROPE,
                               "pad_token_id": 0}),
    "phi4mini_partial": ("Phi3", {"original_max_position_embeddings": ORIG, "partial_rotary_factor": 0.75,
                                  "tie_word_embeddings": True, "pad_token_id": 0,
                                  "rope_scaling": {**LONGROPE, "short_factor": LONGROPE["short_factor"][:6],
                                                   "long_factor": LONGROPE["long_factor"][:6]}}),
}
PROMPT_LENS = (48, 40, 36)
SHORT_PROMPT_LENS = (20, 14)  # + NEW_TOKENS within ORIG
NEW_TOKENS = 8


GGUF_CASES = sorted(set(CASES) - {"qwen2_dynamic"})   # llama.cpp has no dynamic NTK RoPE to write


@pytest.fixture(scope="module")
def default_gguf():
    return GGUFFile(default_model_path())


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    return gguf_tokenizer(default_gguf)


def write_checkpoint(name, root, tokenizer):
    """A tiny random model of the case, saved by transformers; returns (model, directory)."""
    prefix, extra = CASES[name]
    cfg = getattr(transformers, f"{prefix}Config")(**{**COMMON, **extra})
    torch.manual_seed(0)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # random init is tiny; scale up so greedy paths are not all one token
        for p in ref.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    path = root / name
    ref.save_pretrained(path)
    save_tokenizer(tokenizer, path)
    return ref, path


def prompts(lens=PROMPT_LENS):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lens]


def transformers_greedy(ref, prompt):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(path, lens=PROMPT_LENS, **config):
    # 32-token steps: the longer prompts are prefilled in two chunks
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=2048, max_batched_tokens=32, **config))
    res = engine.generate(prompts(lens), SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    return engine, [r.token_ids for r in res]


class Checkpoints(dict):
    """name -> (transformers' tokens per prompt, checkpoint directory), each written on first use (so a
    ``-k`` selection writes only its own); the same weights as <name>.gguf for GGUF_CASES."""

    def __init__(self, root, tokenizer, default_gguf):
        super().__init__()
        self.root, self.tokenizer, self.fields = root, tokenizer, default_gguf.fields

    def __missing__(self, name):
        ref, path = write_checkpoint(name, self.root, self.tokenizer)
        if name in GGUF_CASES:
            write_gguf(path, ref.config, CASES[name][0], self.root / f"{name}.gguf", self.fields)
        short = prompts(SHORT_PROMPT_LENS) if name.startswith("phi") else []
        self[name] = ([transformers_greedy(ref, p) for p in prompts() + short], path)
        return self[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer, default_gguf):
    return Checkpoints(tmp_path_factory.mktemp("families"), tokenizer, default_gguf)


@pytest.mark.parametrize("name", sorted(CASES))
def test_families_hf_greedy_matches_transformers(name, checkpoints):
    expected, path = checkpoints[name]
    engine, got = engine_greedy(path)
    assert got == expected[:len(PROMPT_LENS)]
    assert all(len(set(t)) > 1 for t in got)   # a test that could not tell models apart would be useless
    rope = CASES[name][1].get("rope_scaling", {})
    assert engine.model_config.rope_scaling.get("rope_type") == rope.get("rope_type", rope.get("type"))


@pytest.mark.parametrize("name", ["phi3_longrope", "phi4mini_partial"])
def test_families_hf_longrope_short_context_matches_transformers(name, checkpoints):
    """An engine whose context is the original length rotates with the short factors, as transformers does
    for every sequence within it."""
    expected, path = checkpoints[name]
    _, got = engine_greedy(path, SHORT_PROMPT_LENS, max_model_len=ORIG)
    assert got == expected[len(PROMPT_LENS):]


@pytest.mark.parametrize("name", GGUF_CASES)
def test_families_gguf_greedy_matches_transformers(name, checkpoints):
    expected, path = checkpoints[name]
    engine, got = engine_greedy(path.parent / f"{name}.gguf")
    assert got == expected[:len(PROMPT_LENS)]
    cfg = engine.model_config
    assert cfg.architecture == ("qwen3_moe" if "moe" in name else CASES[name][0].lower())
    rope = CASES[name][1].get("rope_scaling", {})
    kind = rope.get("rope_type", rope.get("type"))
    # llama.cpp's converter stores llama3 as per-dimension divisors (the rope_freqs tensor)
    assert cfg.rope_scaling.get("rope_type") == ("factors" if kind == "llama3" else kind)
    assert cfg.partial_rotary_factor == CASES[name][1].get("partial_rotary_factor", 1.0)


KERNEL_CASES = ["qwen25_yarn", "phi3_longrope", "phi4mini_partial", "qwen3_moe_yarn"]


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_families_torch_paths_match_transformers(name, checkpoints):
    """The tests above run the CPU C kernels (decode attention, RoPE + K/V write) where they apply; the
    pure-torch paths they fall back to give transformers' tokens too."""
    expected, path = checkpoints[name]
    _, got = engine_greedy(path, cpu_kernels=False)
    assert got == expected[:len(PROMPT_LENS)]


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_families_bf16_kernels_compute_the_torch_paths_values(name, checkpoints, caplog):
    """bfloat16 prefill on the CPU: the C layer operations (add + RMSNorm, SwiGLU) and RoPE + K/V write on
    the scaled tables, q/k/v biases, fused Phi-3 weights and MoE layers give the pure-torch paths' logits
    bit for bit (the decode kernel, which sums in another order, is not in a prefill); a partial rotary
    model says in the log that its RoPE stays in torch (the kernel rotates whole heads)."""
    _, path = checkpoints[name]
    out = {}
    for kernels in (True, False):
        with caplog.at_level("INFO", logger="engine.models.llama"):
            engine = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=2048, max_batched_tokens=64,
                                            dtype="bfloat16", cpu_kernels=kernels))
            res = engine.generate(prompts(), SamplingParams(max_tokens=1, temperature=0, logprobs=5))
        out[kernels] = [(r.token_ids, r.logprobs[0].top) for r in res]
        assert (engine.model.cpu_ops is not None) == kernels
    assert out[True] == out[False]
    assert ("not the C rope_store kernel" in caplog.text) == name.startswith("phi4mini")
