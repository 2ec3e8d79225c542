import pytest

from engine import EngineConfig, LLMEngine
from tests.engine.served import SERVED


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model, loaded once for the engine tests."""
    return LLMEngine(EngineConfig(kv_cache_tokens=32768, max_batched_tokens=256))


@pytest.fixture(scope="module")
def served_engine():
    """The default model as a server runs it (``SERVED``), for one module."""
    engine = LLMEngine(EngineConfig(kv_cache_tokens=32768, max_batched_tokens=256, **SERVED))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tokenizer(default_engine):
    return default_engine.tokenizer
