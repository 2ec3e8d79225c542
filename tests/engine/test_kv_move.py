"""Pages moved between two engines of the default model (engine/kv_move.py), without HTTP: pages exported by
one engine (from its device pool, then from its host and disk tiers) and imported by the other give the
same greedy tokens as on the holder (float32), with the imported blocks counted as cached; an import that
would not attach to the cache inserts nothing; layouts name the model, dtype and page shape."""

from __future__ import annotations

import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.kv_move import ON_DISK

P = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def holder():
    # 4 usable pages: a 40-token prompt (2 full blocks before its last token) at a time; evicted pages go to
    # a 1-page host tier, then to the disk tier
    llm = LLMEngine(EngineConfig(kv_cache_tokens=5 * P, max_batched_tokens=64, kv_host_tokens=1 * P,
                                 kv_disk_tokens=64 * P))
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def target():
    llm = LLMEngine(EngineConfig(kv_cache_tokens=64 * P))
    yield llm
    llm.close()


def prompt(engine: LLMEngine, text: str) -> list[int]:
    ids = engine.tokenizer.encode(text * 6)[:40]
    assert len(ids) == 40
    return ids


def run_command(engine: LLMEngine, op: str, *args):
    """A transfer operation through the engine's command queue, applied by a step (as its thread would)."""
    fut = engine.request_kv(op, *args)
    engine.step()
    return fut.result(timeout=5)


def test_layouts_agree_between_engines_of_one_model(holder, target):
    assert holder.mover.layout == target.mover.layout
    lay = holder.mover.layout
    assert lay.page_dtype == "float32" and lay.page_size == P and lay.layout == "HSD"
    assert lay.page_shape == (2, holder.model_config.num_layers, holder.model_config.num_kv_heads, P,
                              holder.model_config.head_dim)


@pytest.mark.slow
def test_pages_from_the_device_pool_give_the_holders_tokens(holder, target):
    ids = prompt(holder, "The agent lists the failing tests of the payments service. ")
    holder.flush_cache()
    [ref] = holder.generate([ids], GREEDY)
    assert run_command(holder, "held", ids[:32], "") == 2
    exported = run_command(holder, "export", ids[:32], "", 0, 8)
    assert [h for h, _ in exported] == holder.mover.hashes(ids[:32], "")
    assert all(isinstance(p, torch.Tensor) and p.shape == holder.kv.page_shape for _, p in exported)
    assert run_command(target, "held", ids[:32], "") == 0
    assert run_command(target, "import", ids[:32], "", 0, [p for _, p in exported]) == 2
    [moved] = target.generate([ids], GREEDY)
    assert moved.cached_tokens == 32
    assert moved.token_ids == ref.token_ids, (moved.token_ids, ref.token_ids)


@pytest.mark.slow
def test_pages_from_the_host_and_disk_tiers_are_the_device_pages(holder):
    ids = prompt(holder, "A subagent reads the design notes about cache eviction. ")
    other = prompt(holder, "Meanwhile a second session summarises yesterday's build logs. ")
    holder.flush_cache()
    holder.generate([ids], GREEDY)
    device = run_command(holder, "export", ids[:32], "", 0, 2)
    holder.generate([other], GREEDY)                      # the pool needs the room: ids' blocks go down a tier
    deadline = time.monotonic() + 20
    while holder.tiers.disk._staged and time.monotonic() < deadline:   # the disk writer catches up
        time.sleep(0.01)
    assert run_command(holder, "held", ids[:32], "") < 2  # not on the device any more
    tiered = run_command(holder, "export", ids[:32], "", 0, 2)
    assert len(tiered) == 2
    for (h, page), (h2, want) in zip(tiered, device):
        if isinstance(page, str):
            assert page == ON_DISK
            page = holder.tiers.read_disk(h)
        assert h == h2 and torch.equal(page, want)


def test_an_import_that_would_not_attach_inserts_nothing(holder, target):
    ids = prompt(target, "An import of the third block alone has nothing to hang from. ")
    pages = [torch.zeros(target.kv.page_shape)]
    before = target.cache.cached_pages
    assert run_command(target, "import", ids[:48], "", 2, pages) == 0
    assert target.cache.cached_pages == before


def test_pins_are_listed_with_their_sequence(target):
    ids = prompt(target, "A pinned session waits for its tool to finish running. ")
    target.generate([ids], GREEDY)
    target.pin("sess-1", ids, 30.0)
    pins = [p for p in run_command(target, "pinned") if p[0] == "sess-1"]
    target.unpin("sess-1")
    assert len(pins) == 1
    _, tokens, salt, left = pins[0]
    assert tokens == ids[:32] and salt == "" and 0 < left <= 30


def test_an_unknown_operation_is_refused(target):
    with pytest.raises(ValueError, match="unknown KV transfer operation 'move'"):
        target.request_kv("move")
