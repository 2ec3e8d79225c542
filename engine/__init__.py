"""agentrt's engine: paged KV cache, radix prefix sharing, continuous batching."""

from engine.config import EngineConfig
from engine.types import (EngineOverloaded, EngineStats, GenerationResult, InvalidRequest,
                          RequestOutput, SamplingParams, SchedulingKey)


def __getattr__(name):
    # heavy modules (torch models) load on first use
    if name == "LLMEngine":
        from engine.engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from engine.engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)


__all__ = ["EngineConfig", "LLMEngine", "AsyncEngine", "SamplingParams", "RequestOutput",
           "GenerationResult", "EngineStats", "InvalidRequest", "EngineOverloaded",
           "SchedulingKey"]
