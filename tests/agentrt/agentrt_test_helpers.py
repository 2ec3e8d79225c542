"""Small helpers for the agentrt API tests."""

from __future__ import annotations

import time
from typing import Callable

import httpx

from agentrt.procs import tls_context
from engine.types import RequestOutput

MODEL = "SmolLM2-135M-Instruct"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                   "required": ["city"], "additionalProperties": False}}}


def metric(url: str, name: str, headers: dict | None = None) -> float:
    """One unlabelled sample from the server's /metrics."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10, verify=tls_context()).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(f"{name} not in /metrics")


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0, interval_s: float = 0.2) -> bool:
    """Poll until ``condition()`` is true; False if the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


class OneReply:
    """The stream an ``EngineClient.generate`` returns, for tests whose engine double answers at once:
    one finished output of ``reply`` (3 prompt tokens, 1 completion token), or nothing if ``reply`` is
    empty (a stream closed before any output)."""

    def __init__(self, request_id: str, reply: str = "ok") -> None:
        self.outputs = [RequestOutput(request_id, reply, [1], finished=True, finish_reason="stop", prompt_tokens=3,
                                      completion_tokens=1)] if reply else []

    async def placed(self):
        return None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    async def aclose(self):
        return None
