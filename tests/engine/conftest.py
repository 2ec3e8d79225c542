import pytest

from engine import EngineConfig, LLMEngine


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model, loaded once for the engine tests."""
    return LLMEngine(EngineConfig(kv_cache_tokens=32768, max_batched_tokens=256))


@pytest.fixture(scope="session")
def tokenizer(default_engine):
    return default_engine.tokenizer
