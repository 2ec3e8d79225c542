"""MoE models in the engine: tiny HF checkpoints of the three families (real vocabulary,
tiny hidden size) load through ``LLMEngine`` and greedy-decode the same tokens as
``transformers``; with expert parallelism (``ep_size=2``, real processes, gloo) the engine
decodes the same tokens as in one process, for every placement; bad settings fail clearly."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.moe_checkpoint import save_tokenizer, write_tiny_checkpoint
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader.gguf_loader import default_model_path, load_gguf
from engine.loader.model_config import ModelConfig
from engine.moe.ep_group import ExpertParallelGroup
from engine.moe.placement import placement_names

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
PROMPTS = ("The capital of France is", "def fibonacci(n):")
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# qwen3_moe keeps a dense MLP in layer 1 (mlp_only_layers), so both kinds of layer are covered
CHECKPOINT_KWARGS = {"mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {"mlp_only_layers": (1,)}}


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_gguf(default_model_path())[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_tokenizer):
    root = tmp_path_factory.mktemp("moe_engine")
    dirs = {}
    for family in FAMILIES:
        d = write_tiny_checkpoint(root / family, family, seed=7, vocab_size=49152, **CHECKPOINT_KWARGS[family])
        save_tokenizer(default_tokenizer, d)
        dirs[family] = str(d)
    return dirs


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [default_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def single_process_tokens(checkpoints, prompts):
    """Greedy tokens of the single-process engine, per family."""
    out = {}
    for family, d in checkpoints.items():
        engine = LLMEngine(EngineConfig(model=d, device="cpu", kv_cache_tokens=1024))
        out[family] = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    return out


def _transformers_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers' model, full forward per token, argmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))  # (1, T, V) -> last row
        out.append(ids[len(prompt):])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_transformers(family, checkpoints, prompts, single_process_tokens):
    assert single_process_tokens[family] == _transformers_greedy(checkpoints[family], prompts)


def test_moe_layers_follow_the_checkpoint(checkpoints):
    from engine.models.llama import MLP
    from engine.moe.layers import MoEBlock

    engine = LLMEngine(EngineConfig(model=checkpoints["qwen3_moe"], device="cpu", kv_cache_tokens=1024))
    kinds = [type(layer.mlp) for layer in engine.model.layers]
    assert kinds == [MoEBlock, MLP]  # mlp_only_layers = [1]


@pytest.mark.slow
@pytest.mark.parametrize("family, settings", [
    ("mixtral", dict(ep_placement="contiguous")),
    ("qwen2_moe", dict(ep_placement="balanced", ep_redundant=2)),
    ("qwen3_moe", dict(ep_placement="locality", ep_redundant=2, ep_nodes=2)),
], ids=["mixtral-contiguous", "qwen2_moe-balanced", "qwen3_moe-locality-2nodes"])
def test_expert_parallel_engine_equals_single_process(family, settings, checkpoints, prompts,
                                                      single_process_tokens):
    engine = LLMEngine(EngineConfig(model=checkpoints[family], device="cpu", kv_cache_tokens=1024, ep_size=2,
                                    **settings))
    try:
        pids = engine.ep.worker_pids
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        slots = (8 + settings.get("ep_redundant", 0)) // 2
        moe = engine.model.layers[0].mlp.ep
        assert moe.local.num_slots == slots  # rank 0 holds only its own slots
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == single_process_tokens[family]
        assert moe.traffic.tokens > 0 and moe.traffic.pairs_off_rank > 0  # tokens really crossed ranks
    finally:
        engine.close()
    assert _gone(pids)
    engine.close()  # idempotent


@pytest.mark.slow
def test_expert_parallel_rank_exits_when_the_engine_process_is_killed(checkpoints, tmp_path):
    """SIGKILL leaves no chance to clean up: the worker sees EOF on its pipe and exits."""
    script = tmp_path / "ep_engine.py"
    script.write_text(
        "import sys, time\n"
        "from engine import EngineConfig, LLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    e = LLMEngine(EngineConfig(model={checkpoints['mixtral']!r}, device='cpu', kv_cache_tokens=1024, "
        "ep_size=2))\n"
        "    print(e.ep.worker_pids[0], flush=True)\n"
        "    time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[3])
    try:
        worker = int(proc.stdout.readline())
        assert _alive(worker)
    finally:
        proc.kill()
        proc.wait()
    assert _gone([worker])


def test_expert_parallel_rejects_bad_settings(checkpoints):
    with pytest.raises(ValueError, match="must divide the expert slot count: 8 experts"):
        LLMEngine(EngineConfig(model=checkpoints["mixtral"], device="cpu", kv_cache_tokens=1024, ep_size=3))
    # a dense model: only its config matters, so no need to load one
    dense = ModelConfig("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=128)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        ExpertParallelGroup.launch(EngineConfig(model="dense-dir", ep_size=2), dense, torch.float32, "cpu")
    for kwargs, message in [(dict(ep_size=0), "ep_size must be an integer >= 1"),
                            (dict(ep_size=4, ep_nodes=3), "multiple of ep_nodes"),
                            (dict(ep_size=2, ep_placement="random"), "ep_placement must be one of"),
                            (dict(ep_size=2, ep_redundant=-1), "ep_redundant must be")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kwargs)
    for name in placement_names():  # the config accepts every registered placement
        assert EngineConfig(ep_size=2, ep_placement=name).ep_placement == name


def _alive(pid: int) -> bool:
    """Running (Linux /proc; a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)
